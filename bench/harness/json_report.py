"""Where a benchmark's ``--json PATH`` goes: one indented JSON file (docs/json-contracts.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json_report(path: Path | None, report: Any) -> None:
    """Write ``report`` to ``path`` as indented JSON, creating its folder; nothing when None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
