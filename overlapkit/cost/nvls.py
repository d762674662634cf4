"""What NCCL's in-switch reduction (NVLS, NVLink SHARP) achieves per GPU, in GB/s of algbw.

NVLS is bounded by the NVSwitch data path, not by the link rate alone (NCCL sources read at
NVIDIA/nccl 5067397c). Its all-reduce inside one
NVLink domain (NCCL ``src/device/all_reduce.h``, ``RunWorkColl<..., NCCL_ALGO_NVLS, ...>`` with
``oneNode``) runs in three steps per channel: every rank scatters its input into its own
multicast-bound buffer, each head rank pulls its 1/n shard through the switch with
``multimem.ld_reduce`` (the switch reads that shard from all n GPUs, the head's own included, and
returns the sum), then stores the sum with ``multimem.st`` (the switch writes it to all n GPUs).
The scatter and the final gather are copies within the GPU's own memory (``src/transport/nvls.cc``
binds the buffers as "Reduce UC -> MC" and "Broadcast MC -> UC"), so per GPU and direction the
links carry ``S`` (its shards read by the n heads) plus ``S/n`` (its own reduced shard):
``(n+1)/n x S``, and

    algbw = achieved NVLink x nvls_efficiency x n / (n+1) x rack_factor(n)

- ``nvls_efficiency``: NCCL ``src/graph/tuning.cc`` ``nvlsEfficiency`` (Hopper 0.85, Blackwell
  0.74) -- the fraction of the link the switch's reduction path sustains, per NVSwitch generation.
- ``rack_factor``: 1 up to the 8 GPUs of an HGX board (where the formula meets measured H100,
  H200, H800 and B200 nodes within 3 %); beyond that, in a rack-scale (multi-node NVLink, MNNVL)
  domain, busbw stops growing with n. NCCL has no constant for this; ``RACK_EXPONENT`` is
  **fitted** to one published measurement (GB200 NVL72, 72 GPUs, 4 GiB: 839.16 GB/s busbw,
  ``cost/data/published_busbw.tsv`` row ``gb200-nvl72-72-4g``).
- These are large-message rates. Below about 1 GiB NVLS pays for its chunking and pipeline
  fill (``cost.nccl_chunking.nvls_overhead_s``).
- Across domains (NVLS-tree: reduce in each domain's switch, a tree between domains over the
  NICs), NCCL gives the switch part fewer warps per channel (``all_reduce.h``: 3 reduce + 2
  broadcast warps when there is a network peer, 5 reduce warps inside one node), so each channel
  moves less: ``TREE_WARP_FACTOR`` is **fitted** to one published measurement (2 x 8 H100 over
  InfiniBand, 8 GiB: 440.58 GB/s busbw, row ``dgx-h100x2-16-8g``), where the channel count is
  the same in both cases. Blackwell runs more NVLS channels across nodes than inside one NVLink
  domain (``src/transport/nvls.cc``: ``NVLS_NCHANNELS_SM100`` 32 vs ``NVLS_NCHANNELS_SM100_NVL``
  24; Hopper ``NVLS_NCHANNELS_SM90`` 16 in both), which makes up for it; the in-domain part
  never exceeds what one domain's NVLS achieves.

NVLink generation comes from the per-link rate: NVLink 4 (Hopper, 3rd-generation NVSwitch, the
first with NVLS) carries 25 GB/s per link and direction, NVLink 5 (Blackwell) 50 GB/s.
"""

from __future__ import annotations

from overlapkit.topology.model import ScaleUpDomain

NVLS_EFFICIENCY = {4: 0.85, 5: 0.74}
"""NCCL tuning.cc ``nvlsEfficiency[]``: Hopper 0.85f, Blackwell 0.74f, by NVLink generation."""
BOARD_GPUS = 8
"""GPUs of one HGX board: up to here no rack factor (8-GPU H100, H200, H800, B200 nodes and 8 GB200
GPUs over two trays are predicted within 3 %)."""
RACK_EXPONENT = 0.0418
"""Fitted: rack_factor(n) = (8/n) ** RACK_EXPONENT for n > 8; 0.912 at n = 72 makes the
GB200 NVL72 72-GPU prediction equal 839.16 GB/s (CoreWeave nccl-tests README, NCCL 2.26.2),
``cost.nccl_chunking``'s fill and chunk terms included (0.0972 without them)."""
TREE_WARP_FACTOR = 0.8443
"""Fitted: an NVLS-tree channel's in-domain rate over a one-domain NVLS channel's; makes
2 x 8 H100 (NDR InfiniBand) equal 440.58 GB/s (coreweave/nccl-tests PR #92, 8 GiB),
``cost.nccl_chunking``'s terms included (0.8387 without them)."""
NVLS_CHANNELS = {4: (16, 16), 5: (24, 32)}
"""NVLS channels (one NVLink domain, several nodes) by NVLink generation: nvls.cc
``NVLS_NCHANNELS_SM90`` 16; ``NVLS_NCHANNELS_SM100_NVL`` 24, ``NVLS_NCHANNELS_SM100`` 32."""
_NVLINK5_MIN_LINK_GBPS = 40.0
"""Per-link rates from here up are NVLink 5 (50 GB/s per direction); below, NVLink 4 (25)."""


def nvlink_generation(domain: ScaleUpDomain) -> int:
    """4 or 5: the NVLink generation of a domain whose switch reduces, from its per-link rate."""
    per_link = domain.bandwidth_GBps / max(domain.links, 1)
    return 5 if per_link >= _NVLINK5_MIN_LINK_GBPS else 4


def rack_factor(ranks: int) -> float:
    """NVLS busbw's shortfall beyond one 8-GPU board (fitted, see ``RACK_EXPONENT``)."""
    return 1.0 if ranks <= BOARD_GPUS else (BOARD_GPUS / ranks) ** RACK_EXPONENT


def nvls_allreduce_GBps(domain: ScaleUpDomain, ranks: int) -> float:
    """NCCL NVLS all-reduce algbw of ``ranks`` GPUs of ``domain`` (GB/s per GPU).

    Args:
        domain (ScaleUpDomain): an NVLink domain whose switch reduces.
        ranks (int): GPUs of the group in this domain (>= 2).
    """
    efficiency = NVLS_EFFICIENCY[nvlink_generation(domain)]
    return domain.achieved_GBps * efficiency * ranks / (ranks + 1) * rack_factor(ranks)


def nvls_tree_domain_GBps(domain: ScaleUpDomain, ranks: int) -> float:
    """The in-domain part of NCCL's NVLS-tree all-reduce: algbw of ``ranks`` GPUs (GB/s per GPU).

    Fewer warps per channel (``TREE_WARP_FACTOR``) times the channel ratio across nodes,
    never above one domain's NVLS.
    """
    one_domain, several = NVLS_CHANNELS[nvlink_generation(domain)]
    return nvls_allreduce_GBps(domain, ranks) * min(1.0, TREE_WARP_FACTOR * several / one_domain)


def nvls_collective_GBps(domain: ScaleUpDomain) -> float:
    """NVLS reduce-scatter / all-gather: the link rate the switch path sustains (GB/s per GPU).

    Each GPU moves its ``(n-1)/n x S`` once through the switch (``multimem.ld_reduce`` for
    reduce-scatter, ``multimem.st`` for all-gather), at ``nvlsEfficiency`` of the link. Not
    checked against a measurement: below 1, the ring (at the full link rate) always wins.
    """
    return domain.achieved_GBps * NVLS_EFFICIENCY[nvlink_generation(domain)]
