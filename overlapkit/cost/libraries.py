"""What collective libraries lose to protocol and synchronisation, per algorithm and protocol.

A topology's tiers carry *link* figures (specified bandwidth x an achieved-fraction
``efficiency``, and a per-step latency). This module adds the *library* figures on top, the way
NCCL's own tuning model does (``src/graph/tuning.cc``, NVIDIA/nccl at b6475625, read for this):

- NCCL predicts ``time = latency + bytes / algbw`` for every (algorithm, protocol) pair and runs
  the fastest. Latency is a base cost per call (``baseLat``) plus a per-step hardware latency
  (``hwLat``) that depends on the link class (NVLink, PCI, network), the algorithm and the
  protocol. Bus bandwidth is scaled per algorithm and protocol: LL sends 8-byte lines carrying
  4 bytes of data and polls flags (ring x1/4, tree x1/3.8); LL128 keeps 120 of every 128 bytes
  (x0.92, x0.7 with one rank per node); tree is x0.92 and has a medium-size correction table;
  a multi-node Simple ring's latency grows x1.4 ("plateau effect of ring"). NVLS (in-switch
  reduction) is modelled from its data path and ``nvlsEfficiency`` in ``cost.nvls``.
- gloo runs one ring algorithm; its figures come from ``overlapkit calibrate`` (measured), so it
  adds nothing on top of the topology.
- "ideal" is a bare link at line rate: the arithmetic of docs/cost-model.md.

NCCL's tuning model is ``latency + bytes / bandwidth``: it has no term for how much less than a
full chunk a medium message moves per step, nor for the pipeline fill. ``cost.nccl_chunking`` adds
them for a ``chunked`` library (NCCL); gloo and "ideal" add nothing.

Left out of the NCCL model: per-channel bandwidth caps (``perChMax*Bws``, ``llMaxBws``), the
CPU-vendor network overhead and CollNet's GPU/NIC ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RING, TREE, HIERARCHICAL, SWITCH = "ring", "tree", "hierarchical", "switch"
PAIRWISE, P2P = "pairwise", "p2p"
LL, LL128, SIMPLE = "ll", "ll128", "simple"
_PROTOCOL_INDEX = {LL: 0, LL128: 1, SIMPLE: 2}

# tuning.cc baseLat (us): { LL, LL128, Simple } per algorithm.
_NCCL_BASE_LATENCY_US = {TREE: (6.8, 14.0, 0.0), RING: (6.6, 14.0, 8.4), SWITCH: (0.0, 0.0, 0.0)}
# tuning.cc hwLat (us per step) by link class, algorithm and protocol { LL, LL128, Simple }.
# NVLS ("switch") has only Simple; its network entry is NVLS's 18 us (NVLS-tree uses 14 us).
# Its NVLink entry (23 us) is the time its pipeline takes to fill at the smallest sizes NVLS
# runs, which cost.pipeline charges by size (NVLS_FILL_LOOPS): 0 here.
_NCCL_STEP_LATENCY_US = {
    "nvlink": {TREE: (0.6, 1.25, 28.0), RING: (0.6, 1.9, 3.4), SWITCH: (0.0, 0.0, 0.0)},
    "pci": {TREE: (1.0, 1.9, 28.0), RING: (1.0, 2.5, 5.7), SWITCH: (0.0, 0.0, 0.0)},
    "net": {TREE: (5.0, 8.5, 28.0), RING: (2.7, 4.0, 14.0), SWITCH: (0.0, 0.0, 18.0)},
}
# tuning.cc treeCorrectionFactor: trees fall short of the model at medium sizes; indexed by
# log2(bytes / 64) for 64 B .. 256 MiB, one row per protocol { LL, LL128, Simple }.
_NCCL_TREE_CORRECTION = (
    (
        1.0,
        1.0,
        1.0,
        1.0,
        0.9,
        0.8,
        0.7,
        0.7,
        0.7,
        0.7,
        0.6,
        0.5,
        0.4,
        0.4,
        0.5,
        0.6,
        0.7,
        0.8,
        0.9,
        1.0,
        1.0,
        1.0,
        1.0,
    ),
    (
        1.0,
        1.0,
        1.0,
        1.0,
        1.0,
        0.9,
        0.8,
        0.8,
        0.8,
        0.7,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.8,
        0.9,
        0.9,
        0.9,
        0.9,
        1.0,
        1.0,
    ),
    (
        0.9,
        0.9,
        0.9,
        0.9,
        0.9,
        0.9,
        0.9,
        0.8,
        0.7,
        0.6,
        0.6,
        0.5,
        0.5,
        0.5,
        0.5,
        0.6,
        0.7,
        0.8,
        0.7,
        0.7,
        0.8,
        0.9,
        0.9,
    ),
)
_NCCL_RING_PLATEAU = 1.4  # multi-node Simple ring all-reduce latency, compute capability >= 8.0
# step_latency_scale's answers: hwLat over the link's Ring/Simple hwLat (the topology's latency).
_NCCL_STEP_SCALE = {
    (link, algorithm, protocol): table.get(algorithm, table[RING])[index]
    / table[RING][_PROTOCOL_INDEX[SIMPLE]]
    for link, table in _NCCL_STEP_LATENCY_US.items()
    for algorithm in (RING, TREE, HIERARCHICAL, SWITCH, PAIRWISE, P2P)
    for protocol, index in _PROTOCOL_INDEX.items()
}
LL128_EFFICIENCY = 0.6
"""Fitted: the share of tuning.cc's LL128 bandwidth (0.92 of the link) LL128 reaches at the
sizes it runs at, fitted with ``cost.nccl_chunking.HALF_BYTES`` to the 8 x A100 and 4 x GB200
ring sweeps (where it runs 2-16 MiB): 0.55 of the link. With 0.92, LL128 would beat Simple up
to 128 MiB on A100, where the sweep has Simple's shape from 32 MiB on."""


@dataclass(frozen=True, slots=True)
class LibraryModel:
    """Per-algorithm and per-protocol factors of one collective library.

    The base model (gloo, ideal) adds nothing: one protocol, no base latency, factor 1.
    """

    name: str
    auto_algorithms: frozenset[str]
    """Algorithms the library picks from on its own (others can still be forced)."""
    tree_chains_within_domain: bool = False
    """NCCL's tree is a chain inside a node and a double binary tree across nodes."""
    nvls_data_path: bool = False
    """In-switch reduction runs at what NCCL's NVLS data path sustains (``cost.nvls``);
    without it, every byte passes once each way at the link rate (ideal)."""
    chunked: bool = False
    """Below about 1 GiB the library pays for its chunking and pipeline fill
    (``cost.nccl_chunking``, NCCL's); without it, a collective costs latency plus bytes over
    bandwidth at every size."""

    def protocols(self, algorithm: str, *, intra_class: str | None) -> tuple[str, ...]:
        """Protocols to consider for ``algorithm``; ``intra_class`` is the intra tier's class."""
        return (SIMPLE,)

    def base_latency_us(self, algorithm: str, protocol: str) -> float:
        """Fixed cost of one call of ``algorithm`` with ``protocol``, in us."""
        return 0.0

    def step_latency_scale(self, link_class: str, algorithm: str, protocol: str) -> float:
        """Multiplier on a tier's Ring/Simple step latency for this algorithm and protocol."""
        return 1.0

    def bandwidth_factor(
        self,
        algorithm: str,
        protocol: str,
        *,
        collective: str,
        multi_domain: bool,
        ranks_per_domain: float,
    ) -> float:
        """Fraction of the tiers' achieved bus bandwidth this algorithm and protocol reach."""
        return 1.0

    def size_correction(self, algorithm: str, protocol: str, nbytes: float) -> float:
        """Size-dependent bandwidth factor (NCCL's tree correction)."""
        return 1.0

    def latency_multiplier(
        self, algorithm: str, protocol: str, *, collective: str, multi_domain: bool
    ) -> float:
        return 1.0


@dataclass(frozen=True, slots=True)
class NcclModel(LibraryModel):
    """NCCL's tuning model (tuning.cc), for the algorithms overlapkit models."""

    def protocols(self, algorithm: str, *, intra_class: str | None) -> tuple[str, ...]:
        if algorithm in (SWITCH, HIERARCHICAL, PAIRWISE, P2P):
            return (SIMPLE,)
        # LL128 is enabled by default only over NVLink (tuning.cc: typeIntra <= PATH_NVB).
        if intra_class in (None, "nvlink"):
            return (LL, LL128, SIMPLE)
        return (LL, SIMPLE)

    def base_latency_us(self, algorithm: str, protocol: str) -> float:
        table = _NCCL_BASE_LATENCY_US.get(algorithm, _NCCL_BASE_LATENCY_US[RING])
        return table[_PROTOCOL_INDEX[protocol]]

    def step_latency_scale(self, link_class: str, algorithm: str, protocol: str) -> float:
        return _NCCL_STEP_SCALE[link_class, algorithm, protocol]

    def bandwidth_factor(
        self,
        algorithm: str,
        protocol: str,
        *,
        collective: str,
        multi_domain: bool,
        ranks_per_domain: float,
    ) -> float:
        if algorithm == TREE:
            factor = 0.92
            if protocol == LL:
                factor /= 3.8
            elif protocol == LL128:
                factor *= (120.0 / 128.0 if multi_domain else 7.0 / 9.0) * LL128_EFFICIENCY
            return factor
        if protocol == LL:
            return 1 / 4 if multi_domain or collective == "all_reduce" else 1 / 3
        if protocol == LL128:
            return (0.7 if ranks_per_domain < 2 else 0.92) * LL128_EFFICIENCY
        return 1.0

    def size_correction(self, algorithm: str, protocol: str, nbytes: float) -> float:
        if algorithm != TREE:
            return 1.0
        index = max(int(math.log2(max(nbytes, 64) / 64)), 0)
        row = _NCCL_TREE_CORRECTION[_PROTOCOL_INDEX[protocol]]
        return row[index] if index < len(row) else 1.0

    def latency_multiplier(
        self, algorithm: str, protocol: str, *, collective: str, multi_domain: bool
    ) -> float:
        plateau = (
            algorithm == RING and protocol == SIMPLE and multi_domain and collective == "all_reduce"
        )
        return _NCCL_RING_PLATEAU if plateau else 1.0


NCCL = NcclModel(
    name="nccl",
    auto_algorithms=frozenset({RING, TREE, SWITCH}),
    tree_chains_within_domain=True,
    nvls_data_path=True,
    chunked=True,
)
# ProcessGroupGloo's all-reduce calls gloo's ring algorithm.
GLOO = LibraryModel(name="gloo", auto_algorithms=frozenset({RING}))
IDEAL = LibraryModel(name="ideal", auto_algorithms=frozenset({RING, TREE, HIERARCHICAL, SWITCH}))
LIBRARIES = {model.name: model for model in (NCCL, GLOO, IDEAL)}
