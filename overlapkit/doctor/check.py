"""One ``overlapkit doctor`` finding: a check's name, pass/warn/fail, the measured value, advice."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

PASS, WARN, FAIL = "pass", "warn", "fail"
STATUSES = (PASS, WARN, FAIL)

# The checklist of issue 9, in the order the doctor runs and prints them.
CHECK_NAMES = (
    "topology",
    "nic_affinity",
    "bandwidth",
    "algorithms",
    "bucket_size",
    "prefetch",
    "overlap",
    "placement",
    "scaling",
)


@dataclass(frozen=True, slots=True)
class Check:
    """The outcome of one check.

    ``value`` is what was measured or found, in words with units (the JSON carries the numbers
    behind it in ``details``); ``advice`` says what to do, or why nothing needs doing.
    """

    name: str
    status: str
    value: str
    advice: str
    details: dict[str, Any] | None = None
    """Numbers behind ``value`` for machines (extra key of the ``doctor`` JSON)."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(
                f"check {self.name!r}: status must be one of {STATUSES}, got {self.status!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The ``doctor`` JSON entry: ``name``, ``status``, ``value``, ``advice``, ``details``."""
        row = asdict(self)
        if row["details"] is None:
            del row["details"]
        return row


def worst(statuses: Iterable[str]) -> str:
    """The most severe of ``statuses`` (fail > warn > pass); pass for none."""
    return max(statuses, key=STATUSES.index, default=PASS)


def exit_code(checks: Iterable[Check]) -> int:
    """1 when any check failed, else 0 (warnings do not fail a run)."""
    return 1 if any(c.status == FAIL for c in checks) else 0


def parse_only(text: str | None) -> tuple[str, ...]:
    """The checks ``--only a,b`` selects, in checklist order; all of them for None.

    Raises:
        ValueError: an unknown check name (the message lists the valid ones).
    """
    if text is None:
        return CHECK_NAMES
    wanted = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in wanted if name not in CHECK_NAMES]
    if unknown or not wanted:
        raise ValueError(
            f"--only: unknown check(s) {unknown or text!r}; valid: {', '.join(CHECK_NAMES)}"
        )
    return tuple(name for name in CHECK_NAMES if name in wanted)
