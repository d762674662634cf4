"""Sharded data parallel with overlap: ``ok.fsdp()`` on FSDP2, prefetch, memory accounting."""

from overlapkit.fsdp.blocks import discover_blocks, resolve_blocks
from overlapkit.fsdp.prefetch import overlap_optimizer_step, step_by_block
from overlapkit.fsdp.state import fsdp_stats
from overlapkit.fsdp.stats import FSDPStats, StepUnshard, UnshardEvent, unshard_peaks
from overlapkit.fsdp.wrap import fsdp, resolve_mixed_precision

__all__ = [
    "FSDPStats",
    "StepUnshard",
    "UnshardEvent",
    "discover_blocks",
    "fsdp",
    "fsdp_stats",
    "overlap_optimizer_step",
    "resolve_blocks",
    "resolve_mixed_precision",
    "step_by_block",
    "unshard_peaks",
]
