"""Predict collective time on a group of devices placed on a topology (alpha-beta model).

Every algorithm costs ``latency x steps + bytes_moved / bandwidth``, with the tiers the group
crosses giving the latency and the bottleneck bandwidth:

- **ring**: all-reduce moves ``2(n-1)/n x S`` per rank in ``2(n-1)`` steps, of which ``2k`` cross
  the network when the group spans ``k`` scale-up domains (NCCL's count); reduce-scatter and
  all-gather move ``(n-1)/n x S`` in ``n-1`` steps; broadcast pipelines ``S`` through ``n-1``.
- **tree** (double binary tree, all-reduce): every rank sends and receives ``S`` up and down,
  ``2 x depth`` steps; NCCL's tree is a chain inside a domain. Across ``k`` domains a domain's
  NICs carry ``min(2, k/2) x S`` each way (``tree_network_volume``).
- **hierarchical** (all-reduce): reduce-scatter inside each domain, all-reduce of ``S/m`` across
  domains (one ring per rail), all-gather inside each domain.
- **switch** (in-network reduction, NVLS / SHARP): each rank sends ``S`` once and receives it
  once; under NCCL at what the NVSwitch data path sustains (``planner.nvls``). Across domains
  without network reduction it becomes NVLS-tree: in-switch reduction in each domain, a tree
  between domains over the NICs.
- **pairwise** (all-to-all): ``(m-1)/n x S`` inside the domain and ``(n-m)/n x S`` through the
  NICs at the same time; the slower tier decides.
- **p2p** (send/recv between two ranks).

A ring crossing domains is limited by the NICs the group can drive on each side
(``min(nics_per_node, ranks on the node)`` per node), divided by the fabric's oversubscription
(or dragonfly taper) once it leaves a leaf, rail group or dragonfly group. Bandwidths are the
topology's *achieved* figures (spec x efficiency); the library model (``libraries.py``) adds what
NCCL's tuning model says each algorithm and protocol lose, and for NCCL what its chunking and
pipeline fill cost below about 1 GiB (``planner.pipeline``: ring, tree and NVLS / NVLS-tree;
not hierarchical, all-to-all or send/recv). The fastest candidate wins, as NCCL picks;
``algorithm=`` forces one (like ``NCCL_ALGO``).

``nbytes`` means what nccl-tests calls size: the buffer for all-reduce and broadcast, the whole
gathered output for all-gather, the whole input for reduce-scatter, a rank's send buffer for
all-to-all, the message for send/recv. Bus bandwidth is nccl-tests': algbw x 2(n-1)/n for
all-reduce, x (n-1)/n for reduce-scatter, all-gather and all-to-all, x 1 otherwise.
"""

from __future__ import annotations

import difflib
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from overlapkit.planner import pipeline
from overlapkit.planner.libraries import (
    HIERARCHICAL,
    LIBRARIES,
    P2P,
    PAIRWISE,
    RING,
    SIMPLE,
    SWITCH,
    TREE,
    LibraryModel,
)
from overlapkit.planner.nvls import (
    NVLS_CHANNELS,
    nvlink_generation,
    nvls_allreduce_GBps,
    nvls_collective_GBps,
    nvls_tree_domain_GBps,
)
from overlapkit.planner.pipeline import ring_channels
from overlapkit.topology.model import (
    DomainKind,
    FabricKind,
    ScaleUpDomain,
    Topology,
    group_ranks,
)
from overlapkit.topology.units import parse_size

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv")
ALGORITHMS = (RING, TREE, HIERARCHICAL, SWITCH)
_AVAILABLE = {
    "all_reduce": (RING, TREE, HIERARCHICAL, SWITCH),
    "reduce_scatter": (RING, SWITCH),
    "all_gather": (RING, SWITCH),
    "broadcast": (RING,),
    "all_to_all": (PAIRWISE,),
    "send_recv": (P2P,),
}


class NamedGroups(Protocol):
    """What ``estimate(group="dp")`` needs of a placement (``ok.plan`` returns one)."""

    topology: Topology

    def groups(self, axes: str) -> Sequence[Sequence[int]]: ...


@dataclass(frozen=True, slots=True)
class Estimate:
    """Predicted time of one collective; the fastest candidate (or the forced algorithm)."""

    collective: str
    nbytes: float
    group_size: int
    algorithm: str
    protocol: str
    time_s: float
    algbw_GBps: float
    """``nbytes / time_s`` in GB/s (0 when nothing moves)."""
    busbw_GBps: float
    """nccl-tests bus bandwidth in GB/s."""
    library: str
    topology: str
    candidates: tuple[tuple[str, str, float], ...]
    """(algorithm, protocol, time_s) of every candidate considered, fastest first."""

    def to_dict(self) -> dict:
        """The ``overlapkit estimate --json`` document (keys fixed by docs/json-contracts.md)."""
        return {
            "collective": self.collective,
            "bytes": self.nbytes,
            "group_size": self.group_size,
            "algorithm": self.algorithm,
            "protocol": self.protocol,
            "time_s": self.time_s,
            "algbw_GBps": self.algbw_GBps,
            "busbw_GBps": self.busbw_GBps,
            "library": self.library,
            "topology": self.topology,
            "candidates": [
                {"algorithm": a, "protocol": p, "time_s": t} for a, p, t in self.candidates
            ],
        }


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
    """Channels (CTAs) a ring over the group runs in NCCL (``planner.pipeline``)."""
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


def _step_us(tier: Tier | None, lib: LibraryModel, algorithm: str, protocol: str) -> float:
    if tier is None:
        return 0.0
    return tier.latency_us * lib.step_latency_scale(tier.link_class, algorithm, protocol)


def _seconds(latency_us: float, nbytes: float, GBps: float) -> float:
    return latency_us * 1e-6 + nbytes / (GBps * 1e9)


def _ring(c: str, S: float, g: GroupShape, lib: LibraryModel, proto: str) -> float:
    n, k = g.size, g.domains
    if c == "all_reduce":
        steps, inter, volume = (
            2 * (n - 1),
            (min(2 * k, 2 * (n - 1)) if k > 1 else 0),
            2 * (n - 1) / n * S,
        )
    else:
        steps, inter = n - 1, k - 1
        volume = S if c == "broadcast" else (n - 1) / n * S
    multi = k > 1
    latency = (
        lib.base_latency_us(RING, proto)
        + (steps - inter) * _step_us(g.intra, lib, RING, proto)
        + inter * _step_us(g.inter_ring, lib, RING, proto)
    )
    latency *= lib.latency_multiplier(RING, proto, collective=c, multi_domain=multi)
    bw = g.ring_GBps * lib.bandwidth_factor(
        RING, proto, collective=c, multi_domain=multi, ranks_per_domain=n / k
    )
    return _seconds(latency, volume, bw) + (
        _ring_chunking_s(c, S, g, proto, bw) if lib.chunked else 0
    )


def _ring_chunking_s(c: str, S: float, g: GroupShape, proto: str, bw: float) -> float:
    n = g.size
    if c == "broadcast":  # one chunk per loop, pipelined through n-1 hops
        return pipeline.ring_overhead_s(S, g.ring_channels, proto, 1, 1, bw, 1, n - 2)
    steps = 2 * (n - 1) if c == "all_reduce" else n - 1
    return pipeline.ring_overhead_s(S, g.ring_channels, proto, steps, n, bw)


def tree_network_volume(domains: int) -> float:
    """Bytes a domain's NICs carry each way in a double binary tree, in units of ``S``.

    Each tree carries half the data. With 2 domains each is the other's only peer (``S``); with 3,
    a domain is the two-child root of one tree and a leaf of the other (``1.5 S``); from 4 on,
    an inner node of one tree (two children and a parent) and a leaf of the other (``2 S``,
    NCCL's tree bus-to-algorithm ratio of 0.5 in tuning.cc).
    """
    return min(2.0, domains / 2)


def _tree(c: str, S: float, g: GroupShape, lib: LibraryModel, proto: str) -> float:
    m, k = g.per_domain, g.domains
    intra_depth = m - 1 if lib.tree_chains_within_domain else math.ceil(math.log2(m))
    inter_depth = math.ceil(math.log2(k))
    latency = lib.base_latency_us(TREE, proto) + 2 * (
        intra_depth * _step_us(g.intra, lib, TREE, proto)
        + inter_depth * _step_us(g.inter_ring, lib, TREE, proto)
    )
    factor = lib.size_correction(TREE, proto, S) * lib.bandwidth_factor(
        TREE, proto, collective=c, multi_domain=k > 1, ranks_per_domain=g.size / k
    )
    # Inside a domain every rank sends and receives S up and down; between domains the
    # domain's NICs carry the tree's share, at the same time.
    intra = 2 * S / g.intra.GBps if g.intra is not None else 0.0
    inter = tree_network_volume(k) * S / g.inter_ring.GBps if k > 1 else 0.0
    bandwidth_s = max(intra, inter) / (factor * 1e9)
    if lib.chunked and S > 0:
        bandwidth_s += pipeline.tree_overhead_s(
            S, g.ring_channels, proto, intra_depth + inter_depth, bandwidth_s / S, k, g.size / k
        )
    return latency * 1e-6 + bandwidth_s


def _hierarchical(c: str, S: float, g: GroupShape, lib: LibraryModel, proto: str) -> float:
    m, k = g.per_domain, g.domains
    factor = lib.bandwidth_factor(RING, proto, collective=c, multi_domain=True, ranks_per_domain=m)
    base = lib.base_latency_us(RING, proto)
    # Reduce-scatter and all-gather inside each domain: (m-1) steps and (m-1)/m x S each.
    intra = _seconds(
        base + (m - 1) * _step_us(g.intra, lib, RING, proto), (m - 1) / m * S, g.intra.GBps * factor
    )
    inter_latency = (
        base + 2 * (k - 1) * _step_us(g.inter_rank, lib, RING, proto)
    ) * lib.latency_multiplier(RING, proto, collective=c, multi_domain=True)
    inter = _seconds(inter_latency, 2 * (k - 1) / k * S / m, g.inter_rank.GBps * factor)
    return 2 * intra + inter


def _switch(c: str, S: float, g: GroupShape, lib: LibraryModel, proto: str) -> float:
    n, k = g.size, g.domains
    latency = lib.base_latency_us(SWITCH, proto) + _step_us(g.intra, lib, SWITCH, proto)
    # Per-GPU rate inside the domains: NCCL's NVLS data path (planner.nvls), or every byte
    # once each way at the link rate for a library without one (ideal).
    nvls = lib.nvls_data_path
    if g.intra is None:
        in_domain = math.inf
    elif c == "all_reduce":
        in_domain = g.nvls_GBps if nvls else g.intra.GBps
    else:
        in_domain = g.nvls_collective_GBps if nvls else g.intra.GBps
    volume = S if c == "all_reduce" else (n - 1) / n * S
    if k == 1:
        time = _seconds(latency, volume, in_domain)
        if lib.chunked and c == "all_reduce" and g.intra is not None:
            time += pipeline.nvls_overhead_s(S, n, g.nvls_channels, in_domain)
        return time
    if g.fabric_reduces:
        # The switches of both tiers reduce: one pass through each (NVLS + SHARP); a domain's
        # NICs carry its S once each way. Not checked against a measurement.
        latency += _step_us(g.inter_ring, lib, SWITCH, proto)
        return _seconds(latency, volume, min(in_domain, g.inter_ring.GBps))
    # NVLS-tree: reduce in each domain's switch, a tree across domains over the network.
    latency += 2 * math.ceil(math.log2(k)) * _step_us(g.inter_ring, lib, RING, SIMPLE)
    if nvls and g.nvls_tree_GBps is not None:
        in_domain = g.nvls_tree_GBps
    algbw = min(in_domain, g.inter_ring.GBps / tree_network_volume(k))
    time = _seconds(latency, S, algbw)
    if lib.chunked:
        time += pipeline.nvls_overhead_s(S, g.per_domain, g.nvls_channels, algbw, k)
    return time


def _pairwise(c: str, S: float, g: GroupShape, lib: LibraryModel, proto: str) -> float:
    n, m = g.size, g.per_domain
    latency = (
        lib.base_latency_us(RING, proto)
        + _step_us(g.intra, lib, RING, proto)
        + _step_us(g.inter_rank, lib, RING, proto)
    )
    intra = (m - 1) / n * S / (g.intra.GBps * 1e9) if g.intra else 0.0
    inter = (n - m) / n * S / (g.inter_rank.GBps * 1e9) if g.inter_rank else 0.0
    return latency * 1e-6 + max(intra, inter)


def _p2p(c: str, S: float, g: GroupShape, lib: LibraryModel, proto: str) -> float:
    tier = g.intra if g.domains == 1 else g.inter_rank
    return _seconds(lib.base_latency_us(RING, proto) + tier.latency_us, S, tier.GBps)


_FORMULAS = {
    RING: _ring,
    TREE: _tree,
    HIERARCHICAL: _hierarchical,
    SWITCH: _switch,
    PAIRWISE: _pairwise,
    P2P: _p2p,
}


def _why_not(algorithm: str, collective: str, g: GroupShape) -> str | None:
    """None when ``algorithm`` can run this collective on this group, else the reason."""
    if algorithm == HIERARCHICAL and not (g.domains > 1 and g.per_domain > 1):
        return (
            f"hierarchical needs a group spanning 2+ scale-up domains with 2+ ranks in a "
            f"domain; this group has {g.size} rank(s) in {g.domains} domain(s)"
        )
    if algorithm == SWITCH:
        if g.intra is not None and not g.switch_reduces:
            return "switch needs scale-up domains whose switch reduces (in_network_reduction)"
        if (
            g.domains > 1
            and not g.fabric_reduces
            and (g.intra is None or collective != "all_reduce")
        ):
            return (
                "switch across domains needs a fabric that reduces in the network (SHARP), "
                "or (all-reduce only) domain switches that reduce"
            )
    if algorithm == P2P and g.size != 2:
        return f"send_recv needs a group of exactly 2 ranks, got {g.size}"
    return None


def available_algorithms(collective: str) -> tuple[str, ...]:
    """The algorithms the cost model has for ``collective``."""
    return _AVAILABLE[normalize_collective(collective)]


def normalize_collective(name: str) -> str:
    """``"all-reduce"``, ``"allreduce"`` or ``"all_reduce"`` -> ``"all_reduce"``."""
    key = str(name).strip().lower().replace("-", "_")
    aliases = {c.replace("_", ""): c for c in COLLECTIVES} | {"sendrecv": "send_recv"}
    key = aliases.get(key.replace("_", ""), key)
    if key not in COLLECTIVES:
        close = difflib.get_close_matches(key, COLLECTIVES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown collective {name!r}{hint}; valid: {', '.join(COLLECTIVES)}")
    return key


def estimate(
    collective: str,
    *,
    nbytes: float | int | str,
    topology: Topology | None = None,
    group: Sequence[int] | str | None = None,
    group_size: int | None = None,
    algorithm: str | None = None,
    placement: NamedGroups | None = None,
) -> Estimate:
    """Predict the time of one collective on a group of ``topology``'s devices.

    Args:
        collective (str): ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``all_to_all``,
            ``broadcast`` or ``send_recv``.
        nbytes (float | int | str): size in bytes as nccl-tests counts it (see module doc);
            strings like ``"140GB"`` or ``"1.5GiB"`` are accepted.
        topology (Topology): where the devices are (``ok.load_topology`` /
            ``ok.detect_topology``). Defaults to ``placement``'s.
        group (Sequence[int] | str): the group's ranks, or an axis name of ``placement``
            (``"dp"``, ``"tp"``): then every group of that axis is estimated and the slowest
            returned, as a step waits for it. Defaults to the first ``group_size`` ranks.
        group_size (int): use the topology's first ``group_size`` devices. Defaults to all.
        algorithm (str): force ``ring``, ``tree``, ``hierarchical`` or ``switch`` (like
            ``NCCL_ALGO``). Defaults to the fastest the topology's library would pick.
        placement (Placement): an ``ok.plan(...)`` result whose groups a named ``group`` means.

    Returns:
        Estimate: ``time_s`` (seconds), ``algorithm``, ``algbw_GBps`` and ``busbw_GBps`` (GB/s).

    Raises:
        ValueError: unknown collective or algorithm, negative size, a group larger than the
            topology, an algorithm that cannot run on this group.
    """
    c = normalize_collective(collective)
    S = parse_size(nbytes, what="nbytes")
    if placement is not None:
        if topology is None:
            topology = placement.topology
        elif topology != placement.topology:
            raise ValueError(
                f"topology {topology.name!r} is not the placement's ({placement.topology.name!r}); "
                "pass one of them"
            )
    if topology is None:
        raise TypeError("estimate() needs topology= (or placement=)")
    if isinstance(group, str):
        if placement is None:
            raise TypeError(
                f"group={group!r}: named groups come from a placement plan; pass "
                "placement=ok.plan(topology, ...), the group's ranks (a list of ints) or "
                "group_size=N"
            )
        if group_size is not None:
            raise ValueError("pass either group (ranks) or group_size, not both")
        return slowest_estimate(
            c, nbytes=S, topology=topology, groups=placement.groups(group), algorithm=algorithm
        )
    if group is not None and group_size is not None:
        raise ValueError("pass either group (ranks) or group_size, not both")
    if group is not None:
        ranks = group_ranks(topology, group)
    else:
        ranks = topology.first(topology.world_size if group_size is None else group_size)
    _check_algorithm(c, algorithm)
    return _estimate_shape(c, S, group_shape(topology, ranks), topology, algorithm)


def estimate_shape(
    collective: str,
    *,
    nbytes: float,
    shape: GroupShape,
    topology: Topology,
    algorithm: str | None = None,
) -> Estimate:
    """``estimate`` for a group already described by ``group_shape``: arithmetic only.

    For callers that cost one group at many sizes (the planner): ``group_shape`` walks the
    group's ranks once; each size then costs only the candidates' formulas.

    Args:
        collective (str): as for ``estimate``.
        nbytes (float): size in bytes as nccl-tests counts it.
        shape (GroupShape): ``group_shape(topology, ranks)``.
        topology (Topology): the topology ``shape`` was built on (its library decides).
        algorithm (str): force one, as for ``estimate``.
    """
    c = normalize_collective(collective)
    _check_algorithm(c, algorithm)
    return _estimate_shape(c, float(nbytes), shape, topology, algorithm)


def _check_algorithm(c: str, algorithm: str | None) -> None:
    if algorithm is not None and algorithm not in _AVAILABLE[c]:
        raise ValueError(
            f"algorithm {algorithm!r} does not run {c}; available for {c}: "
            f"{', '.join(_AVAILABLE[c])}"
        )


def _estimate_shape(
    c: str, S: float, shape: GroupShape, topology: Topology, algorithm: str | None
) -> Estimate:
    lib = LIBRARIES[str(topology.library)]
    if shape.size == 1:
        return Estimate(c, S, 1, "none", "none", 0.0, 0.0, 0.0, lib.name, topology.name, ())
    if algorithm is not None:
        reason = _why_not(algorithm, c, shape)
        if reason is not None:
            raise ValueError(f"--algorithm {algorithm} cannot run here: {reason}")
        algorithms = [algorithm]
    else:
        algorithms = [
            a
            for a in _AVAILABLE[c]
            if (a in lib.auto_algorithms or a in (PAIRWISE, P2P)) and _why_not(a, c, shape) is None
        ]
        if not algorithms:
            reasons = "; ".join(filter(None, (_why_not(a, c, shape) for a in _AVAILABLE[c])))
            raise ValueError(f"{c} cannot run on this group: {reasons}")
    intra_class = shape.intra.link_class if shape.intra else None
    candidates = sorted(
        (
            (a, p, _FORMULAS[a](c, S, shape, lib, p))
            for a in algorithms
            for p in lib.protocols(a, intra_class=intra_class)
        ),
        key=lambda candidate: candidate[2],
    )
    best_algorithm, best_protocol, time_s = candidates[0]
    n = shape.size
    bus_factor = {
        "all_reduce": 2 * (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_gather": (n - 1) / n,
        "all_to_all": (n - 1) / n,
    }.get(c, 1.0)
    algbw = S / time_s / 1e9 if time_s > 0 else 0.0
    return Estimate(
        c,
        S,
        n,
        best_algorithm,
        best_protocol,
        time_s,
        algbw,
        algbw * bus_factor,
        lib.name,
        topology.name,
        tuple(candidates),
    )


def slowest_estimate(
    collective: str,
    *,
    nbytes: float | int | str,
    topology: Topology,
    groups: Sequence[Sequence[int]],
    algorithm: str | None = None,
    concurrent: bool = True,
) -> Estimate:
    """``estimate`` for the slowest of ``groups`` (groups that sit alike are estimated once).

    Args:
        concurrent (bool): the groups run at the same time (the groups of one mesh axis do), so
            ranks of groups that cross domains share their nodes' NICs. Defaults to True.
    """
    c = normalize_collective(collective)
    S = parse_size(nbytes, what="nbytes")
    _check_algorithm(c, algorithm)
    shapes = group_shapes(topology, groups, concurrent=concurrent)
    return max(
        (_estimate_shape(c, S, shape, topology, algorithm) for shape in shapes),
        key=lambda e: e.time_s,
    )


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
