"""Data-parallel overlap: instrumented DDP comm hooks, ``ok.ddp`` and ``ok.GradBucketer``."""

from overlapkit.ddp.bucketer import GradBucketer
from overlapkit.ddp.comm_stats import BucketCommRecord, BucketSummary, CommStats, comm_stats
from overlapkit.ddp.wrap import ddp

__all__ = ["BucketCommRecord", "BucketSummary", "CommStats", "GradBucketer", "comm_stats", "ddp"]
