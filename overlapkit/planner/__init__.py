"""Placement and cost: where parallel groups go on a topology, and what their collectives cost."""

from overlapkit.planner.cost import COLLECTIVES, Estimate, estimate, group_shape

__all__ = ["COLLECTIVES", "Estimate", "estimate", "group_shape"]
