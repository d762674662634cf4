"""What NCCL's chunking costs at small and medium sizes: steps, loops and the pipeline fill.

The alpha-beta formulas in ``cost`` charge a collective ``latency + bytes / bandwidth``,
with the topology's *achieved* bandwidth: what large messages reach. Below about 1 GiB NCCL moves
less per step than at full size and its pipeline never fills for long, so it runs slower than
that. This module adds that time, from how NCCL cuts the work (NVIDIA/nccl 5067397c, v2.30.7):

- **Channels.** Every channel (one CTA) carries ``1/channels`` of the buffer, in contiguous parts
  (``enqueue.cc`` ``scheduleCollTasksToPlan``: ``countLo/Mid/Hi``, then ``calcCollChunking`` per
  channel). A ring's channel count is twice the rings ``graph/search.cc`` ``ncclTopoCompute``
  finds, duplicated once more (``ncclTopoDupChannels``; ``connect.cc`` ``ncclTopoPostset``:
  ``nChannels * 2``): ``ring_channels``. NVLS runs ``nvlsChannels`` CTAs
  (``transport/nvls.cc``: 16 on Hopper, 24 or 32 on Blackwell; ``cost.nvls.NVLS_CHANNELS``).
- **Chunks and loops.** A ring all-reduce channel loops over ``n x chunk`` bytes, ``2(n-1)``
  steps of one chunk each (``device/all_reduce.h`` ``runRing``); reduce-scatter and all-gather
  ``n-1`` steps; broadcast pipelines single chunks through ``n-1`` hops. The chunk is
  ``buffSize / NCCL_STEPS x chunkSteps`` (``enqueue.cc`` ``calcCollChunking``; ``init.cc``
  ``DEFAULT_BUFFSIZE`` 4 MiB, ``NCCL_STEPS`` 8, ``collectives.h`` ``ALLREDUCE_CHUNKSTEPS`` 4):
  2 MiB for Simple, 576,000 data bytes for LL128 (614,400-byte steps, 120 of every 128 bytes
  data), 32 KiB for LL (64 KiB steps, half of it flags). When a channel holds less than one
  loop, the chunk shrinks to ``bytes / n`` (``runRing``: ``chunkCount = divUp(remCount,
  nranks)``). NVLS loops over ``heads x chunk``, chunk 128 KiB (``NCCL_NVLS_CHUNKSIZE``) cut to
  64, 32 and 16 KiB below ``64, 8, 2 x channels x heads x chunk`` bytes (``calcCollChunking``),
  and the last loop's chunk is rounded up to 16 KiB per head (``all_reduce.h``
  ``lastChunkSize``), so a small message leaves heads idle.
- **Cost of a step.** A step of ``c`` bytes costs ``(c + half_bytes) / r`` on one channel: the
  rate ``r`` and the half-performance length ``half_bytes`` of Hockney's pipeline model (the
  size at which a step reaches half its rate: the flag wait, fence and hand-off between the
  protocol's stages). ``r`` is set so that a full chunk moves at the topology's achieved rate,
  so large messages are charged exactly as before; a smaller chunk pays ``half_bytes`` more
  than its share.
- **Fill.** Before its steps overlap, a Simple pipeline runs ``fill_steps`` steps (ring) or
  loops (NVLS: scatter, switch reduction and gather are three stages working on successive
  loops, ``all_reduce.h`` ``RunWorkColl<..., NCCL_ALGO_NVLS, ...>``) on its own; a broadcast's
  fill is its ``n-2`` extra hops, a tree's its depth. Simple hands a peer whole slices (its
  ``tail`` pointer advances per slice, ``prims_simple.h``); LL and LL128 receivers poll a flag
  in every 8- or 128-byte line (``prims_ll.h``, ``prims_ll128.h``), so their data cuts through
  a hop as it arrives and they have no fill beyond the hop latency NCCL's tuning model charges.

- **Trees** stream a channel's part one chunk per step (``runTreeUpDown``: one buffer step for
  Simple, LL128's chunk halved for small sizes in ``calcCollChunking``) and fill through their
  depth (a chain of the domain's ranks, then ``log2`` of the domains).

NCCL's tuning model has no term for any of this (``graph/tuning.cc`` ``ncclTopoGetAlgoTime``:
``latency + bytes / bandwidth``; its ``treeCorrectionFactor`` table is the only size term, kept
in ``cost.libraries``). ``HALF_BYTES``, ``RING_FILL_STEPS``, ``NVLS_FILL_LOOPS`` and
``cost.libraries.LL128_EFFICIENCY`` are **fitted** to four published sweeps (rows marked
``fit`` in ``cost/data/published_busbw.tsv``); the other rows only check them.
"""

from __future__ import annotations

import functools
import math

LL, LL128, SIMPLE, NVLS = "ll", "ll128", "simple", "nvls"
KiB = 1024

SIMPLE_STEP_BYTES = (1 << 22) // 8
"""``init.cc`` ``DEFAULT_BUFFSIZE`` (4 MiB) over ``NCCL_STEPS`` (8)."""
LL128_STEP_BYTES = 120 * 640 * 8 * 8 // 8
"""``DEFAULT_LL128_BUFFSIZE`` (120 elements x 640 threads x 8 steps x 8 bytes) over 8 steps."""
LL_STEP_BYTES = 8 * 512 * 8 * 16 // 8
"""``DEFAULT_LL_BUFFSIZE`` (8 lines x 512 threads x 8 steps x 16-byte lines) over 8 steps."""
CHUNK_BYTES = {
    SIMPLE: SIMPLE_STEP_BYTES * 4,
    LL128: LL128_STEP_BYTES * 15 // 16,
    LL: LL_STEP_BYTES // 2,
}
"""Data bytes of a full chunk per protocol (``calcCollChunking``; Simple ring collectives take
``ALLREDUCE_CHUNKSTEPS`` = ``REDUCESCATTER_CHUNKSTEPS`` = ``ALLGATHER_CHUNKSTEPS`` = 4 steps,
``BROADCAST_CHUNKSTEPS`` 1; LL128 keeps ``NCCL_LL128_DATAELEMS`` 15 of 16 words; LL half)."""
NVLS_CHUNK_BYTES = 128 * KiB
"""``transport/nvls.cc`` ``NCCL_NVLS_CHUNKSIZE`` default."""
NVLS_ALIGN_BYTES = 16 * KiB
"""``all_reduce.h``: the last NVLS loop's chunk is ``alignUp(divUp(rem, nHeads), 16384 /
sizeof(T))`` elements, 16 KiB per head."""

HALF_BYTES = {SIMPLE: 80 * KiB, LL128: 0, LL: 1024, NVLS: 6 * KiB}
"""Fitted half-performance length of one step, bytes (Hockney's n-half). Simple and LL are
fitted with ``RING_FILL_STEPS`` and ``cost.libraries.LL128_EFFICIENCY`` to the 8 x A100 and
4 x GB200 ring sweeps, NVLS (per head and loop) with ``NVLS_FILL_LOOPS`` to the 8 x H200 and
72 x GB200 NVL72 sweeps: the values that make the worst of those rows smallest (a grid search;
rows marked ``fit`` in ``published_busbw.tsv``). LL128's fit is 0: its receivers poll a flag
in every 128-byte line rather than a step's tail pointer (``prims_ll128.h``), and what it falls
short of is a rate (``LL128_EFFICIENCY``)."""
RING_FILL_STEPS = 1
"""Fitted (see ``HALF_BYTES``): steps a ring channel runs before its steps overlap."""
NVLS_FILL_LOOPS = 3
"""Fitted (see ``HALF_BYTES``): loops an NVLS channel runs before its scatter, switch-reduce
and gather stages overlap. At 1 MiB on 8 H100 (16 KiB chunks) they cost about 30 us, close to
NCCL's NVLS latency (``tuning.cc`` hwLat NVLS 23 us in 2.20, 25 in 2.30), which the NCCL model
therefore no longer adds on top."""

# graph/search.cc speedArrayIntra / sm90SpeedArrayIntra / sm100SpeedArrayIntra (GB/s per ring).
_RING_SPEEDS = {
    80: (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
    90: (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
    100: (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0),
}
# graph/topo.h per-link NVLink bandwidth NCCL assumes (GB/s): SM80 20.0, SM90 20.6, SM100 40.1.
_SM100_MIN_LINK_GBPS = 30.0
_SM90_MIN_LINK_GBPS = 20.3
_MAX_SEARCH_CHANNELS = 32  # MAXCHANNELS / 2


@functools.lru_cache(maxsize=256)
def ring_channels(per_gpu_GBps: float, links: int) -> int:
    """NCCL's ring channel count inside an NVLink domain (``comm->nChannels``).

    ``ncclTopoCompute`` tries ring speeds from the generation's array down to about half the
    first that fits and keeps the most bandwidth (``nChannels x speed``, at most 32 rings);
    ``ncclTopoDupChannels`` doubles rings of >= 25 GB/s (Hopper and later: >= 50 GB/s, or 4
    rings or fewer); ``ncclTopoPostset`` doubles again. 8 x A100: 6 x 40 -> 24; 8 x H100:
    6 x 60 -> 24; 8 x B200: 8 x 90 -> 32.

    Args:
        per_gpu_GBps (float): the domain's achieved bandwidth per GPU and direction, GB/s.
        links (int): NVLinks per GPU (the per-link rate tells the GPU generation).
    """
    per_link = per_gpu_GBps / max(links, 1)
    sm = 100 if per_link >= _SM100_MIN_LINK_GBPS else 90 if per_link >= _SM90_MIN_LINK_GBPS else 80
    speeds = [s for s in _RING_SPEEDS[sm] if s <= per_gpu_GBps] or [_RING_SPEEDS[sm][-1]]
    best_rings, best_speed = 1, speeds[0]
    for speed in speeds:
        if speed / speeds[0] < 0.49:
            break
        rings = min(_MAX_SEARCH_CHANNELS, max(1, int(per_gpu_GBps // speed)))
        if rings * speed > best_rings * best_speed:
            best_rings, best_speed = rings, speed
    duplicates = best_speed >= 25.0 and (sm == 80 or best_speed >= 50.0 or best_rings <= 4)
    rings = min(2 * best_rings, _MAX_SEARCH_CHANNELS) if duplicates else best_rings
    return 2 * rings


def nvls_chunk_bytes(nbytes: float, channels: int, heads: int) -> int:
    """The NVLS chunk ``calcCollChunking`` picks for an all-reduce of ``nbytes``."""
    chunk = NVLS_CHUNK_BYTES
    concurrent = channels * heads
    for factor, smaller in ((64, 64 * KiB), (8, 32 * KiB), (2, 16 * KiB)):
        if nbytes < factor * concurrent * chunk and chunk > smaller:
            chunk = smaller
    return chunk


def ring_overhead_s(
    nbytes: float,
    channels: int,
    protocol: str,
    steps_per_loop: int,
    chunks_per_loop: int,
    bus_GBps: float,
    chunk_steps: int = 4,
    fill_steps: int | None = None,
) -> float:
    """Seconds a ring collective takes beyond ``latency + volume / bus_GBps``.

    A channel's full loops cost exactly their bytes at the achieved rate; its last (or only)
    loop of chunks ``c < full`` pays ``half x (full - c) / ((full + half) x b)`` per step more,
    and the fill ``(first + half) x full / ((full + half) x b)`` per step, where ``b`` is the
    channel's achieved rate.

    Args:
        nbytes (float): the buffer the channels share (nccl-tests' size), bytes.
        channels (int): ring channels.
        protocol (str): ``ll``, ``ll128`` or ``simple``.
        steps_per_loop (int): steps on a channel's critical path per loop (all-reduce
            ``2(n-1)``, reduce-scatter and all-gather ``n-1``, broadcast 1).
        chunks_per_loop (int): chunks one loop covers (``n``; broadcast 1).
        bus_GBps (float): the protocol's bus bandwidth over all channels, GB/s.
        chunk_steps (int): Simple buffer steps per chunk (4; broadcast 1).
        fill_steps (int): Simple steps before a channel's steps overlap. Defaults to
            ``RING_FILL_STEPS`` (a broadcast passes its ``n - 2`` extra hops).
    """
    if nbytes <= 0:
        return 0.0
    if fill_steps is None:
        fill_steps = RING_FILL_STEPS
    full = CHUNK_BYTES[protocol] * (chunk_steps / 4 if protocol == SIMPLE else 1)
    per_channel = nbytes / channels
    loop = chunks_per_loop * full
    loops = max(1, math.ceil(per_channel / loop))
    last = (per_channel - (loops - 1) * loop) / chunks_per_loop
    first = full if loops > 1 else last
    half = HALF_BYTES[protocol]
    fill = fill_steps * (first + half) * full if protocol == SIMPLE else 0.0
    scale = channels / (bus_GBps * 1e9 * (full + half))
    return scale * (steps_per_loop * half * (full - last) + fill)


def nvls_tree_chunk_bytes(nbytes: float, channels: int, heads: int, domains: int) -> int:
    """The NVLS-tree chunk ``calcCollChunking`` picks for an all-reduce of ``nbytes``.

    It starts from ``min(nvlsChunkSize, nvlsTreeMaxChunkSize)``: 64 KiB from 4 nodes on
    (``nvls.cc`` ``ncclNvlsTuning``) or with 16 or more GPUs per node on Blackwell
    (``ncclNvlsTreeSm100Tuning``), else 128 KiB; then halves it below ``32, 16, 4, 1 x
    channels x heads x chunk`` bytes, down to 32 KiB.
    """
    chunk = 64 * KiB if domains >= 4 or heads >= 16 else NVLS_CHUNK_BYTES
    concurrent = channels * heads
    for factor, smaller in ((32, 256 * KiB), (16, 128 * KiB), (4, 64 * KiB), (1, 32 * KiB)):
        if nbytes < factor * concurrent * chunk and chunk > smaller:
            chunk = smaller
    return chunk


def nvls_overhead_s(
    nbytes: float,
    heads: int,
    channels: int,
    algbw_GBps: float,
    domains: int = 1,
    fill_loops: int | None = None,
) -> float:
    """Seconds an NVLS (or NVLS-tree) all-reduce takes beyond ``latency + nbytes / algbw_GBps``.

    Every loop moves ``heads x chunk`` per channel; a loop of chunks smaller than 128 KiB pays
    ``HALF_BYTES['nvls']`` per head more than its share, the last loop waits for its busiest
    head (16 KiB granules), and ``fill_loops`` loops run before the stages overlap.

    Args:
        nbytes (float): the all-reduce buffer, bytes.
        heads (int): ranks of the group in one NVLink domain (NVLS heads).
        channels (int): NVLS channels.
        algbw_GBps (float): the algorithm bandwidth over all channels, GB/s.
        domains (int): NVLink domains the group spans (more than 1: NVLS-tree's chunks).
        fill_loops (int): loops before the stages overlap. Defaults to ``NVLS_FILL_LOOPS``.
    """
    if nbytes <= 0:
        return 0.0
    if fill_loops is None:
        fill_loops = NVLS_FILL_LOOPS
    if domains > 1:
        chunk = nvls_tree_chunk_bytes(nbytes, channels, heads, domains)
    else:
        chunk = nvls_chunk_bytes(nbytes, channels, heads)
    per_channel = nbytes / channels
    loop = heads * chunk
    loops = math.floor(per_channel / loop)
    rest = per_channel - loops * loop
    half = HALF_BYTES[NVLS]
    full = NVLS_CHUNK_BYTES
    extra = loops * heads * half * (full - chunk)
    first = chunk
    if rest > 0:
        last = min(chunk, math.ceil(rest / heads / NVLS_ALIGN_BYTES) * NVLS_ALIGN_BYTES)
        extra += heads * (last + half) * full - rest * (full + half)
        first = chunk if loops else last
    extra += fill_loops * heads * (first + half) * full
    return extra * channels / (algbw_GBps * 1e9 * (full + half))


def tree_chunk_bytes(protocol: str, nbytes: float, channels: int, nodes: int, ppn: float) -> float:
    """The tree chunk ``calcCollChunking`` picks: one buffer step (Simple 512 KiB), LL128's
    halved while a channel holds fewer than ``nstepsLL128 x 64 / ppn`` (then ``x 16``) chunks."""
    if protocol == SIMPLE:
        return SIMPLE_STEP_BYTES
    chunk = CHUNK_BYTES[protocol]
    if protocol == LL128:
        steps = 1 + math.floor(math.log2(max(nodes, 1))) + 0.1 * ppn
        for per_channel, smallest in ((steps * 64 / ppn, 131072), (steps * 16 / ppn, 32768)):
            while nbytes / (channels * chunk) < per_channel and chunk > smallest:
                chunk /= 2
    return chunk


def tree_overhead_s(
    nbytes: float,
    channels: int,
    protocol: str,
    depth: int,
    seconds_per_byte: float,
    nodes: int,
    ppn: float,
) -> float:
    """Seconds a (double binary, chained) tree all-reduce takes beyond its bandwidth term.

    A channel streams its part up and down the tree one chunk per step (``runTreeUpDown``);
    each step pays ``HALF_BYTES`` and the first chunk crosses ``depth`` hops before steps
    overlap.

    Args:
        seconds_per_byte (float): the tree's bandwidth term over the buffer, s per byte.
    """
    if nbytes <= 0:
        return 0.0
    full = SIMPLE_STEP_BYTES if protocol == SIMPLE else CHUNK_BYTES[protocol]
    chunk = tree_chunk_bytes(protocol, nbytes, channels, nodes, ppn)
    per_channel = nbytes / channels
    chunks = max(1, math.ceil(per_channel / chunk))
    last = per_channel - (chunks - 1) * chunk
    first = chunk if chunks > 1 else last
    half = HALF_BYTES[protocol]
    short = half * ((chunks - 1) * (full - chunk) + full - last)
    fill = depth * (first + half) * full if protocol == SIMPLE else 0.0
    return seconds_per_byte * channels * (short + fill) / (full + half)
