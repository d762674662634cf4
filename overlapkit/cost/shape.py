"""How a group of ranks sits on a topology: the tiers its traffic crosses (``GroupShape``).

A group is described once by the scale-up domains it touches (``k``), the most ranks it has in
one domain (``m``) and the slowest tier of each kind: the domains' links, the network bandwidth
a ring crossing a domain boundary gets, and one rank's share of its node's NICs. A ring crossing
domains is limited by the NICs the group can drive on each side (``min(nics_per_node, ranks on
the node)`` per node), divided by the fabric's oversubscription (or dragonfly taper) once it
leaves a leaf, rail group or dragonfly group; ranks of concurrent groups on a node share its
NICs. The algorithms (``cost.algorithms``) cost a collective from this description alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from overlapkit.cost.nccl_chunking import ring_channels
from overlapkit.cost.nvls import (
    NVLS_CHANNELS,
    nvlink_generation,
    nvls_allreduce_GBps,
    nvls_collective_GBps,
    nvls_tree_domain_GBps,
)
from overlapkit.topology.model import (
    DomainKind,
    FabricKind,
    ScaleUpDomain,
    Topology,
    group_ranks,
)


@dataclass(frozen=True, slots=True)
class Tier:
    """One level a group's traffic crosses: achieved GB/s, us per step, link class."""

    GBps: float
    latency_us: float
    link_class: str


@dataclass(frozen=True, slots=True)
class GroupShape:
    """How a group of ranks sits on a topology."""

    size: int
    domains: int
    """k: scale-up domains the group touches."""
    per_domain: int
    """m: most ranks of the group in one domain."""
    intra: Tier | None
    """The slowest domain tier (None when no two ranks share a domain)."""
    inter_ring: Tier | None
    """Network bandwidth a ring crossing a domain boundary gets (all usable NICs)."""
    inter_rank: Tier | None
    """One rank's share of its node's NICs."""
    switch_reduces: bool
    """Every domain holding two or more of the group's ranks reduces in its switch."""
    fabric_reduces: bool
    nvls_GBps: float | None = None
    """NCCL NVLS all-reduce algbw in the slowest shared domain (None: no switch reduces)."""
    nvls_collective_GBps: float | None = None
    """NCCL NVLS reduce-scatter / all-gather link rate in the slowest shared domain."""
    nvls_tree_GBps: float | None = None
    """NCCL NVLS-tree's in-domain all-reduce algbw in the slowest shared domain."""
    ring_channels: int = 2
    """Channels (CTAs) a ring over the group runs in NCCL (``cost.nccl_chunking``)."""
    nvls_channels: int = 16
    """Channels NCCL's NVLS (one domain) or NVLS-tree (several) runs."""

    @property
    def ring_GBps(self) -> float:
        """Bottleneck bandwidth of a ring (or tree) over the whole group, GB/s."""
        return min(t.GBps for t in (self.intra, self.inter_ring) if t is not None)


def group_shape(
    topology: Topology, ranks: Sequence[int], *, node_load: Mapping[int, int] | None = None
) -> GroupShape:
    """Describe where ``ranks`` sit on ``topology``: domains, ranks per domain, tiers.

    ``node_load`` maps a node to how many ranks on it send across domains at the same time
    (this group's and concurrent groups'); they share the node's NICs. Defaults to this
    group's own ranks only.
    """
    by_domain: dict[int, list[int]] = {}
    for rank in ranks:
        by_domain.setdefault(topology.domain_index(rank), []).append(rank)
    shared = [
        (topology.domains[i], members) for i, members in by_domain.items() if len(members) > 1
    ]
    intra = None
    if shared:
        intra = Tier(
            GBps=min(d.achieved_GBps * _usable_link_fraction(d, members) for d, members in shared),
            latency_us=max(d.latency_us for d, _ in shared),
            link_class=min((d for d, _ in shared), key=lambda d: d.achieved_GBps).link_class,
        )
    switch_reduces = all(d.in_network_reduction for d, _ in shared)
    nvls = nvls_collective = nvls_tree = None
    nvls_channels = 16
    if shared and switch_reduces:
        nvls = min(nvls_allreduce_GBps(d, len(members)) for d, members in shared)
        nvls_collective = min(nvls_collective_GBps(d) for d, _ in shared)
        nvls_tree = min(nvls_tree_domain_GBps(d, len(members)) for d, members in shared)
        one_domain, several = NVLS_CHANNELS[nvlink_generation(shared[0][0])]
        nvls_channels = one_domain if len(by_domain) == 1 else several
    inter_ring = inter_rank = None
    fabric = topology.fabric
    if len(by_domain) == 1:
        channels = _intra_ring_channels(shared)
    else:
        spine = _spine_factor(topology, ranks)
        nic = fabric.achieved_GBps * spine
        usable = {
            d: _usable_nics(topology, members, node_load or {}) for d, members in by_domain.items()
        }
        inter_ring = Tier(nic * min(usable.values()), fabric.latency_us, "net")
        share = min(usable[d] / len(members) for d, members in by_domain.items())
        inter_rank = Tier(nic * share, fabric.latency_us, "net")
        # One ring per NIC, doubled (ncclTopoPostset); 8 x H100 over 8 NICs runs 16.
        channels = max(4, 2 * round(min(usable.values())))
    return GroupShape(
        size=len(ranks),
        domains=len(by_domain),
        per_domain=max(len(m) for m in by_domain.values()),
        intra=intra,
        inter_ring=inter_ring,
        inter_rank=inter_rank,
        switch_reduces=switch_reduces,
        fabric_reduces=fabric.in_network_reduction,
        nvls_GBps=nvls,
        nvls_collective_GBps=nvls_collective,
        nvls_tree_GBps=nvls_tree,
        ring_channels=channels,
        nvls_channels=nvls_channels,
    )


def _intra_ring_channels(shared: list[tuple[ScaleUpDomain, list[int]]]) -> int:
    """NCCL's ring channels inside the slowest shared NVLink domain (2 where there is none)."""
    nvlink = [(d, m) for d, m in shared if d.kind is DomainKind.NVLINK]
    if not nvlink:
        return 2
    domain, members = min(nvlink, key=lambda dm: dm[0].achieved_GBps)
    return ring_channels(
        domain.achieved_GBps * _usable_link_fraction(domain, members), domain.links
    )


def _usable_nics(topology: Topology, members: list[int], node_load: Mapping[int, int]) -> float:
    # A rank drives one NIC at a time (its rail), so a node offers min(NICs, its ranks); ranks
    # of concurrent groups on the node take their share of its NICs.
    nics = max(topology.fabric.nics_per_node, 1)
    per_node = Counter(topology.devices[r].node for r in members)
    return sum(
        min(count, nics * count / max(count, node_load.get(node, count)))
        for node, count in per_node.items()
    )


def _usable_link_fraction(domain: ScaleUpDomain, members: list[int]) -> float:
    """Torus domains: a group uses 2 links per dimension it spans; switched domains all."""
    if domain.kind is not DomainKind.ICI or domain.torus is None or not domain.links:
        return 1.0
    position = {rank: i for i, rank in enumerate(domain.ranks)}
    coordinates = [_unravel(position[r], domain.torus) for r in members]
    spanned = sum(len({c[axis] for c in coordinates}) > 1 for axis in range(len(domain.torus)))
    return min(domain.links, 2 * spanned) / domain.links


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for extent in reversed(shape):
        index, coordinate = divmod(index, extent)
        out.append(coordinate)
    return tuple(reversed(out))


def _spine_factor(topology: Topology, ranks: Sequence[int]) -> float:
    """Bandwidth factor once traffic leaves a leaf / rail group / dragonfly group."""
    fabric = topology.fabric
    nodes = {topology.devices[r].node for r in ranks}
    if fabric.kind is FabricKind.DRAGONFLY:
        block = fabric.nodes_per_group
        return fabric.global_taper if block and len({n // block for n in nodes}) > 1 else 1.0
    block = fabric.nodes_per_leaf
    leaves = len({n // block for n in nodes}) if block else 1
    crosses = leaves > 1
    if fabric.kind is FabricKind.RAIL_OPTIMIZED:
        # Peers on different rails meet only above the rail switches.
        one_per_node = all(
            c == 1 for c in Counter(topology.devices[r].node for r in ranks).values()
        )
        crosses = crosses or (one_per_node and len({topology.devices[r].nic for r in ranks}) > 1)
    return 1.0 / fabric.oversubscription if crosses else 1.0


def group_shapes(
    topology: Topology, groups: Sequence[Sequence[int]], *, concurrent: bool = True
) -> list[GroupShape]:
    """The distinct ``group_shape`` of ``groups`` (groups that sit alike give one shape).

    Args:
        concurrent (bool): the groups run at the same time, so ranks of groups that cross
            domains share their nodes' NICs (``group_shape``'s ``node_load``). Defaults to True.

    Raises:
        ValueError: no group, or a rank outside the topology.
    """
    ranks_of = [group_ranks(topology, [int(r) for r in group]) for group in groups]
    if not ranks_of:
        raise ValueError("groups is empty: there is no group to estimate")
    load = _network_load(topology, ranks_of) if concurrent else None
    return list(dict.fromkeys(group_shape(topology, ranks, node_load=load) for ranks in ranks_of))


def _network_load(topology: Topology, groups: Sequence[Sequence[int]]) -> Counter:
    """Per node, the ranks in some group that crosses a domain boundary (each counted once)."""
    crossing = {
        r for group in groups if len({topology.domain_index(r) for r in group}) > 1 for r in group
    }
    return Counter(topology.devices[r].node for r in crossing)
