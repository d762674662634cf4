"""Profiling: ``ok.profile``, trace analysis of exposed communication, TensorBoard and reports.

Data flows trace file → ``trace_loader`` (events, decoded in runs) → ``rank_trace`` (compact
records of one rank) → ``step_metrics`` (per step metrics, vectorised) → ``analysis`` (all
files, in parallel; ``rank_summary`` across ranks) → ``collectives`` (matched across ranks,
clocks aligned) → ``stragglers`` (who delays whom, why, at what cost) → ``tensorboard`` /
``counters`` / ``report`` / ``timeline`` / ``heatmap``.

Public names load on first use (``overlapkit.lazy``), so the trace analysis, and the worker
processes ``overlapkit report`` starts, import neither torch nor the profiler.
"""

from overlapkit.lazy import lazy_exports

_EXPORTS = {
    "CrossRankStep": "overlapkit.profiling.rank_summary",
    "KindStats": "overlapkit.profiling.analysis",
    "RunReport": "overlapkit.profiling.analysis",
    "StepMetrics": "overlapkit.profiling.analysis",
    "analyze_run": "overlapkit.profiling.analysis",
    "cross_rank": "overlapkit.profiling.rank_summary",
    "Profile": "overlapkit.profiling.profiler",
    "profile": "overlapkit.profiling.profiler",
    "TraceFormatError": "overlapkit.profiling.trace_loader",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
