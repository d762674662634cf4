"""Placement and cost: where parallel groups go on a topology, and what their collectives cost;
the auto-planner that chooses the sizes (``plan(..., auto=True)``)."""

from overlapkit.planner.auto import plan
from overlapkit.planner.axes import MeshAxis
from overlapkit.planner.cost import COLLECTIVES, Estimate, estimate, group_shape, slowest_estimate
from overlapkit.planner.placement import Placement, PlacementError, naive_placement
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
