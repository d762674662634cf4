"""What ``overlapkit doctor`` prints: its JSON (docs/json-contracts.md), or a table for people."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from overlapkit.doctor.check import FAIL, PASS, WARN, Check, worst

WIDTH = 100


def to_json(checks: Sequence[Check], run: Mapping[str, Any]) -> dict[str, Any]:
    """``{"checks": [{"name", "status", "value", "advice", "details"}], "status", "run"}``."""
    return {
        "checks": [c.to_dict() for c in checks],
        "status": worst(c.status for c in checks),
        "run": dict(run),
    }


def render(checks: Sequence[Check], run: Mapping[str, Any]) -> str:
    """One block per check: status, name and value, the advice indented below."""
    label = {PASS: "PASS", WARN: "WARN", FAIL: "FAIL"}
    name_width = max((len(c.name) for c in checks), default=0)
    lines = [
        f"overlapkit doctor: {run.get('world_size')} rank(s), launched by {run.get('launcher')}",
        "",
    ]
    indent = " " * (2 + 4 + 2 + name_width + 2)
    for check in checks:
        head = f"  {label[check.status]}  {check.name:<{name_width}}  "
        lines += textwrap.wrap(
            check.value, WIDTH, initial_indent=head, subsequent_indent=indent
        ) or [head]
        lines += textwrap.wrap(
            f"-> {check.advice}", WIDTH, initial_indent=indent, subsequent_indent=indent + "   "
        )
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL)}
    lines += [
        "",
        f"{counts[PASS]} passed, {counts[WARN]} warned, {counts[FAIL]} failed"
        + (" (exit code 1)" if counts[FAIL] else ""),
    ]
    return "\n".join(lines)
