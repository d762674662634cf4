"""Sharded data parallel with overlap: ``ok.fsdp()`` on FSDP2, prefetch, memory accounting.

Names load on first use, for import speed only: importing one module (``overlapkit.fsdp.mesh``
for a mesh check) does not import ``fully_shard`` and the rest of the package. No module of the
package imports this ``__init__``'s names, so an eager one would make no cycle either
(``tests/test_import_layers.py`` checks the module graph).
"""

from overlapkit.lazy import lazy_exports

_EXPORTS = {
    "FSDPStats": "overlapkit.fsdp.stats",
    "StepUnshard": "overlapkit.fsdp.stats",
    "UnshardEvent": "overlapkit.fsdp.stats",
    "discover_blocks": "overlapkit.fsdp.blocks",
    "fsdp": "overlapkit.fsdp.wrap",
    "fsdp_stats": "overlapkit.fsdp.state",
    "no_sync": "overlapkit.fsdp.zero",
    "overlap_optimizer_step": "overlapkit.fsdp.prefetch",
    "resolve_blocks": "overlapkit.fsdp.blocks",
    "resolve_mixed_precision": "overlapkit.fsdp.keywords",
    "step_by_block": "overlapkit.fsdp.prefetch",
    "unshard_peaks": "overlapkit.fsdp.stats",
    "zero_stage": "overlapkit.fsdp.zero",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
