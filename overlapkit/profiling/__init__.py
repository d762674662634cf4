"""Profiling: ``ok.profile``, trace analysis of exposed communication, TensorBoard and reports.

Data flows trace file → ``rank_trace`` (classified intervals) → ``analysis`` (per step metrics
with ``intervals``) → ``tensorboard`` / ``counters`` / ``report`` / ``timeline``.
"""

from overlapkit.profiling.analysis import (
    CrossRankStep,
    KindStats,
    RunReport,
    StepMetrics,
    analyze_run,
    cross_rank,
)
from overlapkit.profiling.profile import Profile, profile
from overlapkit.profiling.trace_loader import TraceFormatError

__all__ = [
    "CrossRankStep",
    "KindStats",
    "Profile",
    "RunReport",
    "StepMetrics",
    "TraceFormatError",
    "analyze_run",
    "cross_rank",
    "profile",
]
