"""The collective cost model: how long a collective takes on a group of devices placed on a
topology (ring, tree, hierarchical, in-switch reduction, all-to-all, send/recv; NCCL's pipelining
at medium sizes), its calibration from measurements here, and its validation against published
nccl-tests rows. It imports neither placement (``overlapkit.planner``) nor the search
(``overlapkit.autoplan``): a placement is seen only through the ``NamedGroups`` Protocol.
"""

from overlapkit.cost.estimate import (
    ALGORITHMS,
    COLLECTIVES,
    Estimate,
    NamedGroups,
    estimate,
    estimate_shape,
    slowest_estimate,
)
from overlapkit.cost.shape import GroupShape, group_shape, group_shapes

__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "Estimate",
    "GroupShape",
    "NamedGroups",
    "estimate",
    "estimate_shape",
    "group_shape",
    "group_shapes",
    "slowest_estimate",
]
