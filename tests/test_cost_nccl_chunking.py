"""NCCL's chunking, loops and pipeline fill (cost.nccl_chunking) against its source and formulas."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from overlapkit.cost import estimate, group_shape, nccl_chunking
from overlapkit.cost.estimate import estimate_shape
from overlapkit.cost.libraries import GLOO, IDEAL
from overlapkit.topology import bare_link, load_topology

GB = 1e9
KiB, MiB = 2**10, 2**20
NCCL_PRESETS = ("dgx-a100", "dgx-h100", "hgx-b200", "gb200-nvl72", "dgx-h100x2", "dgx-a100x4")


def test_chunk_sizes_are_nccls_buffer_steps():
    # init.cc: 4 MiB Simple buffer, LL128 120 x 640 x 8 x 8 B, LL 8 x 512 x 8 x 16 B; 8 steps.
    assert (
        nccl_chunking.CHUNK_BYTES[nccl_chunking.SIMPLE] == 4 * 512 * KiB
    )  # ALLREDUCE_CHUNKSTEPS = 4
    assert nccl_chunking.CHUNK_BYTES[nccl_chunking.LL128] == 614400 * 15 // 16 == 576000
    assert nccl_chunking.CHUNK_BYTES[nccl_chunking.LL] == 64 * KiB // 2


@pytest.mark.parametrize(
    ("preset", "channels"),
    # 8 x A100: 6 rings of 40 GB/s, duplicated twice (nccl-tests#100's log: "Channel 23/24").
    [("dgx-a100", 24), ("dgx-h100", 24), ("hgx-b200", 32), ("gb200-nvl72", 32)],
)
def test_ring_channels_follow_nccls_ring_search(preset, channels):
    topo = load_topology(preset)
    assert group_shape(topo, topo.first(8)).ring_channels == channels


def test_an_h800s_eight_nvlinks_run_fewer_rings():
    # 8 x 20.6 = 164.8 GB/s: 4 rings of 40 (more than 2 of 60 or 3 of 50), duplicated twice.
    assert nccl_chunking.ring_channels(8 * 20.6, 8) == 16


def test_groups_across_nodes_run_two_channels_per_nic():
    topo = load_topology("dgx-h100x2")
    assert group_shape(topo, topo.first(16)).ring_channels == 16
    assert group_shape(topo, topo.first(16)).nvls_channels == 16  # NVLS_NCHANNELS_SM90


@pytest.mark.parametrize(
    ("nbytes", "chunk"),
    # 16 channels x 8 heads on 8 H100: 128 KiB from 64 x 128 x 128 KiB = 1 GiB, 64 KiB from
    # 8 x 128 x 64 KiB = 64 MiB, 32 KiB from 2 x 128 x 32 KiB = 8 MiB, 16 KiB below.
    [
        (2**30, 128 * KiB),
        (2**30 - 1, 64 * KiB),
        (64 * MiB, 64 * KiB),
        (64 * MiB - 1, 32 * KiB),
        (8 * MiB, 32 * KiB),
        (8 * MiB - 1, 16 * KiB),
        (1, 16 * KiB),
    ],
)
def test_nvls_chunks_shrink_at_nccls_thresholds(nbytes, chunk):
    assert nccl_chunking.nvls_chunk_bytes(nbytes, 16, 8) == chunk


def test_nvls_tree_chunks_are_64_kib_from_four_nodes_on():
    assert nccl_chunking.nvls_tree_chunk_bytes(2**33, 16, 8, 2) == 128 * KiB
    assert nccl_chunking.nvls_tree_chunk_bytes(2**33, 16, 8, 4) == 64 * KiB
    assert nccl_chunking.nvls_tree_chunk_bytes(2**20, 16, 8, 2) == 32 * KiB


def test_full_loops_pay_only_the_fill():
    # 24 channels, 8 ranks: 3 loops of 8 x 2 MiB per channel; only the one fill step is extra.
    channel_Bps = 240 * GB / 24
    S = 24 * 3 * 8 * 2 * MiB
    extra = nccl_chunking.ring_overhead_s(
        nbytes=S, channels=24, protocol="simple", steps_per_loop=14, chunks_per_loop=8, bus_GBps=240
    )
    assert extra == pytest.approx(nccl_chunking.RING_FILL_STEPS * 2 * MiB / channel_Bps)


def test_a_short_loop_pays_the_half_performance_length_on_every_step():
    # One loop of chunks c = S / (24 x 8): each of the 14 steps costs (c + h) / r instead of c / b,
    # with r = b (full + h) / full.
    S, half, full = 64 * MiB, nccl_chunking.HALF_BYTES["simple"], 2 * MiB
    channel_Bps = 240 * GB / 24
    c = S / 24 / 8
    raw_Bps = channel_Bps * (full + half) / full
    expected = (
        14 * ((c + half) / raw_Bps - c / channel_Bps)
        + nccl_chunking.RING_FILL_STEPS * (c + half) / raw_Bps
    )
    extra = nccl_chunking.ring_overhead_s(
        nbytes=S, channels=24, protocol="simple", steps_per_loop=14, chunks_per_loop=8, bus_GBps=240
    )
    assert extra == pytest.approx(expected)


def test_a_broadcast_fills_its_pipeline_through_every_hop():
    topo = load_topology("dgx-a100")
    S = 8 * MiB
    est = estimate("broadcast", nbytes=S, topology=topo, algorithm="ring")
    simple = {p: t for a, p, t in est.candidates}["simple"]
    # One 512 KiB chunk per step (BROADCAST_CHUNKSTEPS = 1): 8 MiB / 24 channels is 0.67 chunk,
    # which crosses 6 more hops after the first before the last rank has it.
    channel_Bps = 240 * GB / 24
    c = S / 24
    half, full = nccl_chunking.HALF_BYTES["simple"], 512 * KiB
    raw_Bps = channel_Bps * (full + half) / full
    extra = (c + half) / raw_Bps - c / channel_Bps + 6 * (c + half) / raw_Bps
    assert simple == pytest.approx(8.4e-6 + 7 * 3.4e-6 + S / (240 * GB) + extra)


def test_a_small_nvls_all_reduce_leaves_heads_idle():
    # 1 MiB on 8 H100: 64 KiB per channel, 8 KiB per head, rounded up to a 16 KiB granule: the
    # loop takes as long as 8 x 16 KiB, and 3 fill loops of the same.
    algbw = 18 * 20.6 * 0.85 * 8 / 9
    half, full = nccl_chunking.HALF_BYTES["nvls"], 128 * KiB
    raw_Bps = algbw * GB / 16 * (full + half) / full
    loop_s = 8 * (16 * KiB + half) / raw_Bps
    expected = (1 + nccl_chunking.NVLS_FILL_LOOPS) * loop_s - 64 * KiB / (algbw * GB / 16)
    extra = nccl_chunking.nvls_overhead_s(nbytes=MiB, heads=8, channels=16, algbw_GBps=algbw)
    assert extra == pytest.approx(expected)
    est = estimate("all_reduce", nbytes=MiB, topology=load_topology("dgx-h100"), algorithm="switch")
    assert est.time_s == pytest.approx(MiB / (algbw * GB) + expected)


def test_nvls_fill_at_1_mib_is_about_nccls_nvls_latency():
    # tuning.cc charges NVLS 23 us (2.20) / 25 us (2.30) of latency; the fill it stands for is
    # 3 loops of 8 heads x 16 KiB at 17.5 GB/s per channel, 29.5 us.
    fill = nccl_chunking.nvls_overhead_s(nbytes=MiB, heads=8, channels=16, algbw_GBps=280.2)
    fill -= nccl_chunking.nvls_overhead_s(
        nbytes=MiB, heads=8, channels=16, algbw_GBps=280.2, fill_loops=0
    )
    assert fill == pytest.approx(29.5e-6, rel=0.01)


def test_large_messages_amortise_the_pipeline():
    topo = load_topology("dgx-h100")
    for algorithm in ("switch", "ring"):
        est = estimate("all_reduce", nbytes=2**33, topology=topo, algorithm=algorithm)
        shape = group_shape(topo, topo.first(8))
        bus = shape.nvls_GBps if algorithm == "switch" else shape.ring_GBps
        volume = 2**33 if algorithm == "switch" else 14 / 8 * 2**33
        assert est.time_s == pytest.approx(volume / (bus * GB), rel=0.01)


def test_nccl_switches_from_ll_to_ll128_to_simple_as_a100_sizes_grow():
    topo = load_topology("dgx-a100")
    protocols = {
        s: estimate("all_reduce", nbytes=s, topology=topo).protocol
        for s in (MiB, 4 * MiB, 16 * MiB, 32 * MiB, 2**30)
    }
    assert protocols == {
        MiB: "ll",
        4 * MiB: "ll128",
        16 * MiB: "ll128",
        32 * MiB: "simple",
        2**30: "simple",
    }


def test_one_a100_node_runs_the_ring_from_1_mib_on():
    # NCCL's tree is a chain of 8 inside a node: at 1-16 MiB its LL and LL128 rates (tuning.cc:
    # 1/3.8 and 7/9 of the link) lose to the ring's, from 32 MiB its Simple chunks also have to
    # cross 7 hops before the chain streams.
    topo = load_topology("dgx-a100")
    for exponent in range(20, 31, 2):
        assert estimate("all_reduce", nbytes=2**exponent, topology=topo).algorithm == "ring"


def test_gloo_and_an_ideal_link_add_no_pipeline_terms():
    # gloo's figures are calibrated on the machine; "ideal" is a bare link at line rate.
    assert not GLOO.chunked and not IDEAL.chunked
    est = estimate("all_reduce", nbytes=64 * MiB, topology=bare_link(100, 5.0, 8))
    assert est.time_s == pytest.approx(14 * 5e-6 + 14 / 8 * 64 * MiB / (100 * GB))


@given(
    nbytes=st.integers(0, 2**36),
    ranks=st.integers(2, 72),
    channels=st.sampled_from([2, 4, 8, 16, 24, 32]),
    protocol=st.sampled_from(["ll", "ll128", "simple"]),
)
def test_the_pipeline_never_makes_a_collective_faster(nbytes, ranks, channels, protocol):
    ring = nccl_chunking.ring_overhead_s(
        nbytes=nbytes,
        channels=channels,
        protocol=protocol,
        steps_per_loop=2 * (ranks - 1),
        chunks_per_loop=ranks,
        bus_GBps=100.0,
    )
    nvls = nccl_chunking.nvls_overhead_s(
        nbytes=nbytes, heads=ranks, channels=channels, algbw_GBps=100
    )
    assert ring >= 0 and nvls >= 0
    if protocol == "simple":  # LL128 has no half-performance length and no fill
        assert (ring == 0) == (nbytes == 0)


@given(
    preset=st.sampled_from(NCCL_PRESETS),
    collective=st.sampled_from(["all_reduce", "reduce_scatter", "all_gather", "broadcast"]),
    exponent=st.floats(10, 36),
)
def test_no_size_beats_the_large_message_bus_bandwidth(preset, collective, exponent):
    topo = load_topology(preset)
    large = estimate(collective, nbytes=2**36, topology=topo).busbw_GBps
    assert estimate(collective, nbytes=2**exponent, topology=topo).busbw_GBps <= large * (1 + 1e-9)


def test_ring_overhead_is_zero_for_nothing_to_move():
    assert (
        nccl_chunking.ring_overhead_s(
            nbytes=0,
            channels=24,
            protocol="simple",
            steps_per_loop=14,
            chunks_per_loop=8,
            bus_GBps=1,
        )
        == 0.0
    )
    assert math.isfinite(
        estimate("all_reduce", nbytes=0, topology=load_topology("dgx-h100")).time_s
    )


def test_estimate_on_a_prebuilt_shape_equals_estimate():
    topo = load_topology("dgx-h100x2")
    shape = group_shape(topo, topo.first(16))
    for nbytes in (MiB, 64 * MiB, 2**33):
        assert estimate_shape("all_reduce", nbytes=nbytes, shape=shape, topology=topo) == (
            estimate("all_reduce", nbytes=nbytes, topology=topo)
        )
    with pytest.raises(ValueError, match="algorithm 'pairwise' does not run all_reduce"):
        estimate_shape("all_reduce", nbytes=1, shape=shape, topology=topo, algorithm="pairwise")
