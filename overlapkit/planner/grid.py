"""The rank grid: parallel axes laid over a topology's devices, and the checks a layout must pass.

Pure functions over numpy arrays; no process group.

Terms. An *axis* is a mesh axis (``pp``, ``dp``, ``ep``, ``cp``, ``tp``; ``dp_replicate`` and
``dp_shard`` when data parallelism is split for HSDP). An *order* lists axes outermost first, as
``DeviceMesh.mesh_dim_names`` does. A topology's *physical order* lists its ranks domain by
domain, node by node inside a domain, and by rail (NIC index), then local index inside a node.
The grid is the physical order reshaped to the axis sizes, so the innermost axis runs over
neighbouring devices and position ``p`` of every domain sits on the same rail. A *block* of the
``k`` innermost axes is a set of ranks that share their coordinates on every other axis.

Domain integrity: every block either lies inside one scale-up domain or is a union of whole
domains. For equal domains of ``D`` ranks this is the familiar rule that each cumulative product
of axis sizes, innermost first, divides ``D`` or is a multiple of it: ``tp=3`` on 8-GPU nodes
fails (a tp group would straddle two nodes, or 2 GPUs per node would be stranded).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from overlapkit.topology.model import Topology


def physical_order(topology: Topology) -> tuple[int, ...]:
    """Ranks by (domain, node, rail, local index): neighbours on the fastest links come first."""
    devices = topology.devices
    return tuple(
        sorted(
            range(topology.world_size),
            key=lambda r: (
                topology.domain_index(r),
                devices[r].node,
                devices[r].nic,
                devices[r].local_index,
            ),
        )
    )


def rank_grid(ranks: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """``ranks`` (a permutation, innermost axis fastest) as an array of ``shape``."""
    return np.asarray(ranks, dtype=np.int64).reshape(tuple(shape))


def axis_groups(grid: np.ndarray, order: Sequence[str], axes: Sequence[str]) -> np.ndarray:
    """The groups spanned by ``axes``: an array (number of groups, product of their sizes).

    Each row lists a group's ranks with the axes in ``order``'s relative order, the last one
    fastest, so a 1-axis group is listed along its axis (mesh coordinate 0, 1, ...).
    """
    positions = sorted(order.index(a) for a in axes)
    rest = [i for i in range(grid.ndim) if i not in positions]
    moved = np.transpose(grid, rest + positions)
    size = int(np.prod([grid.shape[i] for i in positions], dtype=np.int64))
    return moved.reshape(-1, size)


@dataclass(frozen=True, slots=True)
class BlockViolation:
    """An axis whose groups straddle scale-up domains where they should not."""

    axis: str
    inner_axes: tuple[str, ...]
    """The axes of the block, innermost last (``axis`` is the outermost of them)."""
    block_size: int
    block: tuple[int, ...]
    """One offending block's ranks."""
    domain_counts: tuple[tuple[int, int, int], ...]
    """For that block: (domain index, its ranks in the block, the domain's size)."""
    reason: str
    """Why, for people: ``does not divide the 8-rank scale-up domain``."""


def block_violations(
    topology: Topology, grid: np.ndarray, order: Sequence[str]
) -> list[BlockViolation]:
    """Every axis of size > 1 whose blocks break domain integrity (see module doc)."""
    domain_of = np.asarray([topology.domain_index(r) for r in range(topology.world_size)])
    domain_size = np.asarray([len(d.ranks) for d in topology.domains])
    out = []
    for k in range(1, len(order) + 1):
        axis = order[-k]
        if grid.shape[len(order) - k] == 1:
            continue
        blocks = axis_groups(grid, order, order[-k:])
        bad = _first_bad_block(blocks, domain_of, domain_size)
        if bad is None:
            continue
        out.append(_violation(topology, axis, tuple(order[-k:]), bad, _block_reason))
    return out


def span_violations(
    topology: Topology, grid: np.ndarray, order: Sequence[str], fits: Sequence[str]
) -> list[BlockViolation]:
    """Axes in ``fits`` (their groups fit in a domain) whose groups span two or more domains."""
    out = []
    for axis in fits:
        for group in axis_groups(grid, order, [axis]):
            if len({topology.domain_index(int(r)) for r in group}) > 1:
                out.append(_violation(topology, axis, (axis,), group, _span_reason))
                break
    return out


def _violation(topology: Topology, axis: str, inner_axes, block, reason) -> BlockViolation:
    counts = Counter(topology.domain_index(int(r)) for r in block)
    domain_counts = tuple((d, n, len(topology.domains[d].ranks)) for d, n in sorted(counts.items()))
    return BlockViolation(
        axis=axis,
        inner_axes=inner_axes,
        block_size=len(block),
        block=tuple(int(r) for r in block),
        domain_counts=domain_counts,
        reason=reason(len(block), domain_counts),
    )


def _domain_text(domain_counts: tuple[tuple[int, int, int], ...]) -> str:
    return " / ".join(map(str, sorted({size for _, _, size in domain_counts})))


def _block_reason(block_size: int, domain_counts: tuple[tuple[int, int, int], ...]) -> str:
    smallest = min(size for _, _, size in domain_counts)
    relation = "does not divide" if block_size < smallest else "is not a multiple of"
    return (
        f"{relation} the {_domain_text(domain_counts)}-rank scale-up domain, so its groups "
        "straddle domains and strand the rest of their bandwidth"
    )


def _span_reason(block_size: int, domain_counts: tuple[tuple[int, int, int], ...]) -> str:
    return (
        f"fits in one {_domain_text(domain_counts)}-rank scale-up domain, but the order puts it "
        f"outside another axis so its groups span {len(domain_counts)} domains"
    )


def _first_bad_block(
    blocks: np.ndarray, domain_of: np.ndarray, domain_size: np.ndarray
) -> np.ndarray | None:
    domains = domain_of[blocks]
    single = (domains == domains[:, :1]).all(axis=1)
    for row in np.flatnonzero(~single):
        touched, counts = np.unique(domains[row], return_counts=True)
        if not np.array_equal(counts, domain_size[touched]):
            return blocks[row]
    return None


def rail_aligned(topology: Topology, group: Sequence[int]) -> bool:
    """True when every domain the group touches holds the same rails (NIC indices) of it.

    Then the group's cross-domain traffic splits into one ring per rail, each between NICs on
    the same rail switch: one hop on a rail-optimized fabric.
    """
    rails: dict[int, Counter] = {}
    for rank in group:
        rails.setdefault(topology.domain_index(rank), Counter())[topology.devices[rank].nic] += 1
    first, *others = rails.values()
    return all(other == first for other in others)
