"""overlapkit: hide distributed-training communication behind compute, and measure what is left.

The public surface (see DESIGN.md)::

    import overlapkit as ok
    model = ok.ddp(model, bucket_mb=25, compress=None)
    bucketer = ok.GradBucketer(model, bucket_mb=25)
    ok.comm_stats(model)
"""

from overlapkit.ddp import BucketCommRecord, CommStats, GradBucketer, comm_stats, ddp
from overlapkit.fsdp import fsdp, fsdp_stats
from overlapkit.planner import Estimate, Placement, estimate, plan
from overlapkit.profiling import profile
from overlapkit.topology import Topology, detect_topology, load_topology

__version__ = "0.1.0"

__all__ = [
    "BucketCommRecord",
    "CommStats",
    "Estimate",
    "GradBucketer",
    "Placement",
    "Topology",
    "__version__",
    "comm_stats",
    "ddp",
    "detect_topology",
    "estimate",
    "fsdp",
    "fsdp_stats",
    "load_topology",
    "plan",
    "profile",
]
