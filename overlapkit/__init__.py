"""overlapkit: hide distributed-training communication behind compute, and measure what is left.

The public surface (see DESIGN.md)::

    import overlapkit as ok
    model = ok.ddp(model, bucket_mb=25, compress=None)
    bucketer = ok.GradBucketer(model, bucket_mb=25)
    ok.comm_stats(model)
"""

from overlapkit.consistency import ConfigMismatch
from overlapkit.ddp import BucketCommRecord, CommStats, GradBucketer, comm_stats, ddp
from overlapkit.failures import CollectiveFailure
from overlapkit.finite import NonFiniteGradients
from overlapkit.fsdp import fsdp, fsdp_stats
from overlapkit.planner import Estimate, Placement, estimate, plan
from overlapkit.profiling import profile
from overlapkit.topology import Topology, detect_topology, load_topology
from overlapkit.tuning import Trial, TuningReport, tuning_report

__version__ = "0.1.0"

__all__ = [
    "BucketCommRecord",
    "CollectiveFailure",
    "CommStats",
    "ConfigMismatch",
    "Estimate",
    "GradBucketer",
    "NonFiniteGradients",
    "Placement",
    "Topology",
    "Trial",
    "TuningReport",
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
    "tuning_report",
]
