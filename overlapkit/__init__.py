"""overlapkit: hide distributed-training communication behind compute, and measure what is left.

The public surface (see DESIGN.md)::

    import overlapkit as ok
    model = ok.ddp(model, bucket_mb=25, compress=None)
    bucketer = ok.GradBucketer(model, bucket_mb=25)
    ok.comm_stats(model)
"""

from overlapkit.ddp import BucketCommRecord, CommStats, GradBucketer, comm_stats, ddp

__version__ = "0.1.0"

__all__ = ["BucketCommRecord", "CommStats", "GradBucketer", "__version__", "comm_stats", "ddp"]
