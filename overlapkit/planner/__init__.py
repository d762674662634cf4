"""Placement and cost: where parallel groups go on a topology, and what their collectives cost."""

from overlapkit.planner.axes import MeshAxis
from overlapkit.planner.cost import COLLECTIVES, Estimate, estimate, group_shape, slowest_estimate
from overlapkit.planner.placement import Placement, PlacementError, naive_placement, plan
from overlapkit.planner.traffic import CollectiveCost, Workload

__all__ = [
    "COLLECTIVES",
    "CollectiveCost",
    "Estimate",
    "MeshAxis",
    "Placement",
    "PlacementError",
    "Workload",
    "estimate",
    "group_shape",
    "naive_placement",
    "plan",
    "slowest_estimate",
]
