"""Data-parallel overlap: instrumented DDP comm hooks, ``ok.ddp`` and ``ok.GradBucketer``.

Names load on first use, for import speed only: ``overlapkit.ddp.hooks`` or ``ok.comm_stats``
then do not import the bucketer's DTensor support or DDP's wrapper. No module of the package
imports this ``__init__``'s names, so an eager one would make no cycle either
(``tests/test_import_layers.py`` checks the module graph).
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
