"""The algorithms' alpha-beta formulas: ``latency x steps + bytes_moved / bandwidth``.

The tiers a group crosses (``cost.shape.GroupShape``) give the latency and the bottleneck
bandwidth:

- **ring**: all-reduce moves ``2(n-1)/n x S`` per rank in ``2(n-1)`` steps, of which ``2k`` cross
  the network when the group spans ``k`` scale-up domains (NCCL's count); reduce-scatter and
  all-gather move ``(n-1)/n x S`` in ``n-1`` steps; broadcast pipelines ``S`` through ``n-1``.
- **tree** (double binary tree, all-reduce): every rank sends and receives ``S`` up and down,
  ``2 x depth`` steps; NCCL's tree is a chain inside a domain. Across ``k`` domains a domain's
  NICs carry ``min(2, k/2) x S`` each way (``tree_network_volume``).
- **hierarchical** (all-reduce): reduce-scatter inside each domain, all-reduce of ``S/m`` across
  domains (one ring per rail), all-gather inside each domain.
- **switch** (in-network reduction, NVLS / SHARP): each rank sends ``S`` once and receives it
  once; under NCCL at what the NVSwitch data path sustains (``cost.nvls``). Across domains
  without network reduction it becomes NVLS-tree: in-switch reduction in each domain, a tree
  between domains over the NICs.
- **pairwise** (all-to-all): ``(m-1)/n x S`` inside the domain and ``(n-m)/n x S`` through the
  NICs at the same time; the slower tier decides.
- **p2p** (send/recv between two ranks).

Bandwidths are the topology's *achieved* figures (spec x efficiency); the library model
(``cost.libraries``) adds what NCCL's tuning model says each algorithm and protocol lose, and for
NCCL what its chunking and pipeline fill cost below about 1 GiB (``cost.nccl_chunking``: ring, tree
and NVLS / NVLS-tree; not hierarchical, all-to-all or send/recv).
"""

from __future__ import annotations

import math

from overlapkit.cost import nccl_chunking
from overlapkit.cost.libraries import (
    HIERARCHICAL,
    P2P,
    PAIRWISE,
    RING,
    SIMPLE,
    SWITCH,
    TREE,
    LibraryModel,
)
from overlapkit.cost.shape import GroupShape, Tier

AVAILABLE = {
    "all_reduce": (RING, TREE, HIERARCHICAL, SWITCH),
    "reduce_scatter": (RING, SWITCH),
    "all_gather": (RING, SWITCH),
    "broadcast": (RING,),
    "all_to_all": (PAIRWISE,),
    "send_recv": (P2P,),
}
"""The algorithms the model has for each collective."""


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
        return nccl_chunking.ring_overhead_s(S, g.ring_channels, proto, 1, 1, bw, 1, n - 2)
    steps = 2 * (n - 1) if c == "all_reduce" else n - 1
    return nccl_chunking.ring_overhead_s(S, g.ring_channels, proto, steps, n, bw)


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
        bandwidth_s += nccl_chunking.tree_overhead_s(
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
    # Per-GPU rate inside the domains: NCCL's NVLS data path (cost.nvls), or every byte
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
            time += nccl_chunking.nvls_overhead_s(S, n, g.nvls_channels, in_domain)
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
        time += nccl_chunking.nvls_overhead_s(S, g.per_domain, g.nvls_channels, algbw, k)
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


FORMULAS = {
    RING: _ring,
    TREE: _tree,
    HIERARCHICAL: _hierarchical,
    SWITCH: _switch,
    PAIRWISE: _pairwise,
    P2P: _p2p,
}


def why_not(algorithm: str, collective: str, g: GroupShape) -> str | None:
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
