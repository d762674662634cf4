"""What a placement that breaks the planner's rules costs: predicted seconds per step.

``split_penalties`` prices a forced domain split (``allow_split=True``) against the most compact
group of the same size; ``ok.plan``'s refusal quotes it, ``Placement.explain()`` and
``overlapkit plan --json`` (``split_penalty_s``) show it.
"""

from __future__ import annotations

from overlapkit.cost.estimate import estimate
from overlapkit.planner.grid import physical_order
from overlapkit.planner.placement_view import PlacementView


def dim_of(axis: str) -> str:
    """The parallel dimension an axis belongs to (``dp_shard`` -> ``dp``)."""
    return "dp" if axis.startswith("dp") else axis


def split_penalties(
    placement: PlacementView, algorithm: str | None = None
) -> list[tuple[str, float]]:
    """Per dimension with a domain-integrity break: predicted extra seconds per step.

    The reference is the same collectives on the most compact group of the same size (the
    first ranks in physical order), which sits inside one domain when it fits.
    """
    dims = list(dict.fromkeys(dim_of(v.axis) for v in placement.violations))
    compact = physical_order(placement.topology)
    out = []
    for dim in dims:
        extra = 0.0
        for c in placement.collectives(algorithm):
            if c.dim != dim:
                continue
            reference = estimate(
                c.collective,
                nbytes=c.nbytes,
                topology=placement.topology,
                group=compact[: c.estimate.group_size],
            )
            extra += c.count * (c.time_s - reference.time_s)
        out.append((dim, extra))
    return out
