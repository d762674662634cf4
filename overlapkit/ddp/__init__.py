"""Data-parallel overlap: instrumented DDP comm hooks, ``ok.ddp`` and ``ok.GradBucketer``.

Names load on first use: ``overlapkit.finite`` and ``overlapkit.tuning.ddp`` import
``overlapkit.ddp.comm_stats`` while ``ok.ddp`` and the bucketer import them, so an eager
``__init__`` would make a cycle of whichever is imported first.
"""

from overlapkit.lazy import lazy_exports

_EXPORTS = {
    "BucketCommRecord": "overlapkit.ddp.comm_stats",
    "BucketSummary": "overlapkit.ddp.comm_stats",
    "CommStats": "overlapkit.ddp.comm_stats",
    "GradBucketer": "overlapkit.ddp.bucketer",
    "comm_stats": "overlapkit.ddp.comm_stats",
    "ddp": "overlapkit.ddp.wrap",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
