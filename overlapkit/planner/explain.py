"""What ``Placement.explain()``, ``Placement.to_dict()`` and ``overlapkit plan`` show.

Per axis: group size, where the groups live (inside a domain, across domains, on which rails),
the collectives a step runs and the cost model's time; the penalty of a forced split or of an
order override; a small rank-grid picture for up to ``PICTURE_MAX_RANKS`` ranks.

Rendering only: the figures come from the placement (seen as a ``PlacementView``) and
``overlapkit.planner.penalties``.
"""

from __future__ import annotations

import itertools
from collections import Counter

from overlapkit.planner.grid import rail_aligned
from overlapkit.planner.penalties import split_penalties
from overlapkit.planner.placement_view import PlacementView
from overlapkit.topology.model import FabricKind
from overlapkit.topology.units import format_bytes, format_seconds, rank_ranges, text_table

PICTURE_MAX_RANKS = 64


def where(placement: PlacementView, axis: str) -> str:
    """Where the groups of ``axis`` live, for people."""
    topology = placement.topology
    groups = placement.groups(axis)
    if len(groups[0]) == 1:
        return "size 1: no communication"
    spans = []
    for group in groups:
        per_domain = Counter(topology.domain_index(r) for r in group)
        spans.append((len(per_domain), max(per_domain.values()), min(per_domain.values())))
    domains = max(k for k, _, _ in spans)
    if domains == 1:
        kind = topology.domain_of(groups[0][0]).kind
        nodes = max(len({topology.devices[r].node for r in g}) for g in groups)
        inside = "one node" if nodes == 1 else f"{nodes} nodes of one domain"
        return f"inside one {kind} domain ({inside})"
    uneven = any(most != least for _, most, least in spans) or len({k for k, _, _ in spans}) > 1
    per = max(m for _, m, _ in spans)
    text = f"across {domains} domains, {per} rank(s) in each"
    if uneven:
        text = f"straddles up to {domains} domains unevenly (up to {per} rank(s) in one)"
    if topology.fabric.kind is FabricKind.RAIL_OPTIMIZED:
        if all(rail_aligned(topology, g) for g in groups):
            return text + "; rail-aligned: peers share their NIC index, one hop on a rail switch"
        return text + "; not rail-aligned: peers on different rails meet at the spine (3 hops)"
    hops = max(topology.switch_hops(a, b) for g in groups for a, b in itertools.pairwise(g))
    return text + f"; {hops} switch hop(s) between neighbours"


def _summary(placement: PlacementView) -> list[str]:
    topology = placement.topology
    domain_sizes = sorted({len(d.ranks) for d in topology.domains})
    kinds = sorted({str(d.kind) for d in topology.domains})
    fabric = topology.fabric
    shape = " x ".join(f"{a}={n}" for a, n in placement.sizes.items())
    return [
        f"placement {shape} on {topology.name}: {placement.world_size} ranks, "
        f"{len(topology.domains)} {'/'.join(kinds)} domain(s) of "
        f"{'/'.join(map(str, domain_sizes))}, {fabric.kind} fabric with "
        f"{fabric.nics_per_node} NIC(s) per node",
        f"mesh_dim_names {placement.mesh_dim_names} (outermost first; size-1 axes kept)",
        {
            "traffic": "order: by traffic, heaviest innermost (tp, cp, ep, dp, pp)",
            "user": "order: given by the user (order=...)",
            "arange": "layout: naive arange over rank order (what init_device_mesh does)",
        }[placement.layout],
    ]


def explain(
    placement: PlacementView, *, algorithm: str | None = None, planned: PlacementView | None = None
) -> str:
    """The readable explanation (see module doc).

    Args:
        placement (PlacementView): what to explain.
        algorithm (str | None): force a collective algorithm (like ``NCCL_ALGO``).
        planned (PlacementView | None): with ``layout == "user"`` (an ``order=`` override), the
            planner's own layout of the same sizes, to price the override against; None when
            the traffic order cannot place them without a split.
    """
    lines = _summary(placement) + [f"note: {n}" for n in placement.notes]
    rows = [
        [axis, str(size), str(placement.world_size // size), where(placement, axis)]
        for axis, size in reversed(placement.sizes.items())
    ]
    lines += ["", *text_table(["axis", "size", "groups", "where the groups live"], rows)]
    lines += ["", *collectives_table(placement, algorithm=algorithm)]
    for dim, extra in split_penalties(placement, algorithm):
        lines.append(
            f"split allowed: {dim} straddles scale-up domains; predicted penalty "
            f"{extra * 1e3:+.4g} ms per step against {dim} groups inside one domain"
        )
    if placement.layout == "user":
        if planned is None:
            lines.append("the traffic order cannot place these sizes without a split")
        elif not same_layout(planned, placement):
            delta = placement.comm_time_s(algorithm) - planned.comm_time_s(algorithm)
            lines.append(
                f"order override: {delta * 1e3:+.4g} ms per step against the planner's order "
                f"({', '.join(planned.mesh_dim_names)})"
            )
    if placement.world_size <= PICTURE_MAX_RANKS:
        lines += ["", *rank_grid_picture(placement)]
    return "\n".join(lines)


def collectives_table(placement: PlacementView, *, algorithm: str | None = None) -> list[str]:
    """Predicted collectives per step, per rank, with nothing overlapped."""
    costs = placement.collectives(algorithm)
    lines = [
        f"predicted communication per step (per rank, nothing overlapped; "
        f"{placement.topology.library} cost model) for {placement.workload.describe()}"
    ]
    if not costs:
        return [*lines, "  no collectives: every axis has size 1"]
    rows = [
        [
            c.dim,
            c.collective,
            str(c.estimate.group_size),
            format_bytes(c.nbytes),
            str(c.count),
            c.estimate.algorithm,
            format_seconds(c.time_s),
            format_seconds(c.total_s),
            c.what,
        ]
        for c in costs
    ]
    lines += text_table(
        ["dim", "collective", "group", "bytes", "calls", "algorithm", "each", "per step", "what"],
        rows,
    )
    lines.append(f"  total per step: {format_seconds(sum(c.total_s for c in costs))}")
    return lines


def rank_grid_picture(placement: PlacementView) -> list[str]:
    """One row per node: each device's rank and its coordinates on the axes larger than 1."""
    topology = placement.topology
    axes = [(i, a) for i, (a, n) in enumerate(placement.sizes.items()) if n > 1]
    coordinates = {}
    for index, rank in enumerate(placement.ranks):
        coordinate = []
        for size in reversed(placement.shape):
            index, value = divmod(index, size)
            coordinate.append(value)
        coordinate.reverse()
        coordinates[rank] = ".".join(str(coordinate[i]) for i, _ in axes)
    cells = {r: f"{r}:{c}" if c else str(r) for r, c in coordinates.items()}
    width = max(len(c) for c in cells.values())
    names = ".".join(a for _, a in axes) or "-"
    lines = [f"rank grid (one row per node; cell = rank:{names} coordinates)"]
    for node, ranks in enumerate(topology.nodes()):
        ranks = sorted(ranks, key=lambda r: topology.devices[r].local_index)
        domain = topology.domain_index(ranks[0])
        row = " ".join(cells[r].ljust(width) for r in ranks).rstrip()
        lines.append(f"  node {node:<3} domain {domain:<3} {row}")
    return lines


def compare_table(
    placement: PlacementView, naive: PlacementView, *, algorithm: str | None = None
) -> list[str]:
    """Per dimension: predicted seconds per step of the plan beside the naive arange layout."""
    totals: dict[str, list[float]] = {}
    for column, p in enumerate((placement, naive)):
        for c in p.collectives(algorithm):
            totals.setdefault(c.dim, [0.0, 0.0])[column] += c.total_s
    rows = [
        [dim, format_seconds(a), format_seconds(b), f"{b / a:.3g}x" if a > 0 else "-"]
        for dim, (a, b) in totals.items()
    ]
    plan_total = sum(a for a, _ in totals.values())
    naive_total = sum(b for _, b in totals.values())
    rows.append(
        [
            "total",
            format_seconds(plan_total),
            format_seconds(naive_total),
            f"{naive_total / plan_total:.3g}x" if plan_total > 0 else "-",
        ]
    )
    same = same_layout(placement, naive)
    lines = [
        "compare: planned layout vs naive arange (init_device_mesh), predicted per step"
        + (" (the two layouts are identical here)" if same else "")
    ]
    lines += text_table(["dim", "planned", "arange", "arange/planned"], rows)
    for axis in naive.sizes:
        if naive.sizes[axis] > 1:
            lines.append(f"  arange {axis}: {where(naive, axis)}")
    return lines


def same_layout(a: PlacementView, b: PlacementView) -> bool:
    """Whether every axis has the same groups in both placements."""
    return a.sizes.keys() == b.sizes.keys() and all(
        set(a.groups(axis)) == set(b.groups(axis)) for axis in a.sizes
    )


def placement_dict(placement: PlacementView, *, algorithm: str | None = None) -> dict:
    """``overlapkit plan --json`` (the keys of docs/json-contracts.md, plus extra ones)."""
    costs = placement.collectives(algorithm)
    groups = {axis: [list(g) for g in placement.groups(axis)] for axis in placement.sizes}
    if "dp" not in groups:
        groups["dp"] = [list(g) for g in placement.groups("dp")]
    return {
        "world_size": placement.world_size,
        "topology": placement.topology.name,
        "layout": placement.layout,
        "dims": placement.dims,
        "mesh_dim_names": list(placement.mesh_dim_names),
        "shape": list(placement.shape),
        "mesh": placement.mesh,
        "groups": groups,
        "where": {axis: where(placement, axis) for axis in placement.sizes},
        "collectives": [c.to_dict() for c in costs],
        "comm_s_per_step": sum(c.total_s for c in costs),
        "workload": placement.workload.to_dict(),
        "notes": list(placement.notes),
        "violations": [
            {"axis": v.axis, "block": list(v.block), "block_ranks": rank_ranges(sorted(v.block))}
            for v in placement.violations
        ],
        "split_penalty_s": dict(split_penalties(placement, algorithm)),
    }
