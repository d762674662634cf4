"""Placement of the parallel sizes a user chose: axes -> rank grid -> ``DeviceMesh``, the groups'
predicted communication per step (priced by ``overlapkit.cost``), validation, explanation.

The auto-planner that chooses the sizes (``ok.plan(..., auto=True)``) is ``overlapkit.autoplan``,
above this package; ``plan`` here places the sizes it is given.
"""

from overlapkit.planner.axes import MeshAxis
from overlapkit.planner.placement import Placement, PlacementError, naive_placement, plan
from overlapkit.planner.traffic import CollectiveCost, Workload

__all__ = [
    "CollectiveCost",
    "MeshAxis",
    "Placement",
    "PlacementError",
    "Workload",
    "naive_placement",
    "plan",
]
