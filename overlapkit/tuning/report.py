"""What auto-tuning tried and chose: ``TuningReport``, and ``ok.tuning_report`` to read it."""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


@dataclass
class Trial:
    """One candidate measured for a few steps; timings are the slowest rank's, in ms."""

    value: float | int
    """The candidate: bucket size in MiB, or prefetch depth in blocks."""
    step_ms: float
    """Median step time over the trial's measured steps (slowest rank per step), ms."""
    exposed_ms: float | None
    """Median exposed tail (last bucket's completion after its launch at the end of backward),
    ms; None where it is not measured (prefetch)."""
    peak_bytes: int | None = None
    """Prefetch only: peak unsharded block bytes seen during the trial (``ok.fsdp_stats``)."""


@dataclass
class TuningReport:
    """The state of one auto-tuned knob (``ok.tuning_report(model_or_bucketer)``)."""

    knob: str
    """``"bucket_mb"`` or ``"prefetch"``."""
    trials: list[Trial] = field(default_factory=list)
    """Trials in the order they ran (identical on every rank)."""
    chosen: float | int | None = None
    """The value in use once settled; None while tuning."""
    settled: bool = False
    settled_at_step: int | None = None
    """Optimizer step (0-based, counted from the wrap) from which ``chosen`` is in use."""
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict with the field names as keys."""
        return asdict(self)

    def __str__(self) -> str:
        unit = " MiB" if self.knob == "bucket_mb" else " blocks"
        status = (
            f"settled at step {self.settled_at_step}: {self.knob}={self.chosen:g}{unit}"
            if self.settled
            else "still tuning"
        )
        lines = [
            f"auto-tuned {self.knob}: {status}",
            f"{'value':>10} {'step ms':>9} {'tail ms':>9}",
        ]
        for t in self.trials:
            mark = "  <- chosen" if self.settled and t.value == self.chosen else ""
            tail = "-" if t.exposed_ms is None else f"{t.exposed_ms:.1f}"
            peak = "" if t.peak_bytes is None else f"  peak {t.peak_bytes / 2**20:.1f} MiB"
            lines.append(f"{t.value:>10g} {t.step_ms:>9.1f} {tail:>9}{peak}{mark}")
        if self.reason:
            lines.append(f"reason: {self.reason}")
        return "\n".join(lines)


class _Reports(Protocol):
    def report(self) -> TuningReport: ...


# Tuners by the object the user holds (a DDP module, a GradBucketer, an FSDP root), without
# keeping that object alive.
_TUNERS: weakref.WeakKeyDictionary[Any, _Reports] = weakref.WeakKeyDictionary()


def register_tuner(owner: Any, tuner: _Reports) -> None:
    """Make ``tuner`` what ``tuning_report(owner)`` reads."""
    _TUNERS[owner] = tuner


def tuning_report(obj: Any) -> TuningReport:
    """What auto-tuning of ``obj`` tried and chose (a snapshot; call again for updates).

    Args:
        obj: a model from ``ok.ddp(..., bucket_mb="auto")`` or ``ok.fsdp(..., prefetch="auto")``,
            or an ``ok.GradBucketer(..., bucket_mb="auto")``.

    Returns:
        TuningReport: trials so far, the chosen value and whether tuning has settled.

    Raises:
        ValueError: ``obj`` was not wrapped with ``"auto"``.

    Example:
        >>> model = ok.ddp(model, bucket_mb="auto")
        >>> ...  # train a few dozen steps
        >>> print(ok.tuning_report(model))
    """
    tuner = _TUNERS.get(obj)
    if tuner is None:
        raise ValueError(
            f"ok.tuning_report: this {type(obj).__name__} was not wrapped with 'auto'; use "
            "ok.ddp(model, bucket_mb='auto'), ok.GradBucketer(model, bucket_mb='auto') or "
            "ok.fsdp(model, prefetch='auto')"
        )
    return tuner.report()
