"""Data-parallel overlap: instrumented DDP comm hooks, ``ok.ddp`` and ``ok.GradBucketer``.

Names load on first use: ``overlapkit.ddp.finite`` and ``overlapkit.tuning.ddp`` import
``overlapkit.ddp.comm_stats`` while ``ok.ddp`` and the bucketer import them, so an eager
``__init__`` would make a cycle of whichever is imported first.
"""

# Eager: ``comm_stats`` is also the name of its sub-module, and importing a sub-module binds it
# on the package, where a lazy function would never be looked up again. The module imports
# nothing of overlapkit, so this makes no cycle.
from overlapkit.ddp.comm_stats import BucketCommRecord, BucketSummary, CommStats, comm_stats
from overlapkit.lazy import lazy_exports

_EXPORTS = {
    "GradBucketer": "overlapkit.ddp.bucketer",
    "ddp": "overlapkit.ddp.wrap",
}
__all__ = ["BucketCommRecord", "BucketSummary", "CommStats", "GradBucketer", "comm_stats", "ddp"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
