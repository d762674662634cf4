"""The collective cost model against hand-worked alpha-beta formulas and NCCL's tuning rules."""

import dataclasses
import math

import pytest

from overlapkit.cost import estimate, group_shape, nccl_chunking
from overlapkit.cost.algorithms import tree_network_volume
from overlapkit.cost.libraries import NCCL
from overlapkit.cost.nvls import (
    TREE_WARP_FACTOR,
    nvlink_generation,
    nvls_allreduce_GBps,
    nvls_tree_domain_GBps,
    rack_factor,
)
from overlapkit.topology import FabricKind, bare_link, load_topology

GB = 1e9
NDR_NIC = 50 * 0.94  # a 400 Gb/s NIC at the 47 GB/s NVIDIA quotes (presets cite it)


def test_design_worked_example_at_nvlink_rate():
    # 70e9 bf16 gradients = 140 GB; a ring all-reduce moves 2(N-1)/N x 140 GB ~ 280 GB per GPU.
    est = estimate("all_reduce", nbytes="140GB", topology=bare_link(1800, 0, 1024))
    assert est.algorithm == "ring"
    assert est.time_s == pytest.approx(2 * 1023 / 1024 * 140e9 / 1800e9, rel=1e-12)
    assert est.time_s == pytest.approx(0.1554, abs=5e-5)
    assert est.busbw_GBps == pytest.approx(1800)


def test_design_worked_example_at_scale_out_rate():
    est = estimate("all_reduce", nbytes=140e9, topology=bare_link(50, 0, 1024))
    assert est.time_s == pytest.approx(5.5945, abs=5e-4)
    assert est.algbw_GBps == pytest.approx(140e9 / est.time_s / GB)


def test_ring_latency_counts_two_steps_per_rank():
    est = estimate("all_reduce", nbytes=0, topology=bare_link(100, 5.0, 8), algorithm="ring")
    assert est.time_s == pytest.approx(2 * 7 * 5e-6)


def test_tree_wins_small_messages_and_ring_wins_large_ones_on_a_bare_link():
    link = bare_link(100, 10.0, 256)
    small = estimate("all_reduce", nbytes=1e3, topology=link)
    # Ring saves 2S/(nB) of bandwidth time but pays 2(n-1-log2 n) more steps: it wins past
    # about n^2 x latency x bandwidth = 6.5e10 bytes here.
    large = estimate("all_reduce", nbytes=1e12, topology=link)
    assert small.algorithm == "tree"
    assert small.time_s == pytest.approx(2 * 8 * 10e-6 + 2 * 1e3 / 100e9)
    assert large.algorithm == "ring"


@pytest.mark.parametrize(
    ("collective", "volume", "steps", "bus"),
    [
        ("reduce_scatter", 7 / 8, 7, 7 / 8),
        ("all_gather", 7 / 8, 7, 7 / 8),
        ("broadcast", 1.0, 7, 1.0),
        ("all_reduce", 14 / 8, 14, 14 / 8),
    ],
)
def test_ring_collectives_move_nccl_tests_volumes(collective, volume, steps, bus):
    S = 8e9
    est = estimate(collective, nbytes=S, topology=bare_link(200, 2.0, 8), algorithm="ring")
    assert est.time_s == pytest.approx(steps * 2e-6 + volume * S / 200e9)
    assert est.busbw_GBps == pytest.approx(est.algbw_GBps * bus)


def test_all_to_all_is_limited_by_the_slowest_tier():
    topo = load_topology("dgx-h100x2")
    S = 1e9
    est = estimate("all_to_all", nbytes=S, topology=topo)
    # 7/16 of S over NVLink (370.8 GB/s) and 8/16 over the rank's NIC (47 GB/s) at once.
    nic = 8 / 16 * S / (NDR_NIC * GB)
    assert est.algorithm == "pairwise"
    latency = (8.4 + 3.4 + 14) * 1e-6  # NCCL base + one NVLink step + one network step
    assert est.time_s == pytest.approx(latency + nic)
    assert est.busbw_GBps == pytest.approx(est.algbw_GBps * 15 / 16)


def test_send_recv_inside_and_across_domains():
    topo = load_topology("dgx-h100x2")
    inside = estimate("send_recv", nbytes=1e9, topology=topo, group=[0, 1])
    across = estimate("send_recv", nbytes=1e9, topology=topo, group=[0, 8])
    assert inside.time_s == pytest.approx(8.4e-6 + 3.4e-6 + 1e9 / (18 * 20.6 * GB))
    assert across.time_s == pytest.approx(8.4e-6 + 14e-6 + 1e9 / (NDR_NIC * GB))
    with pytest.raises(ValueError, match="exactly 2 ranks"):
        estimate("send_recv", nbytes=1, topology=topo, group=[0, 1, 2])


def _hockney_step_s(chunk, half, full, channel_Bps):
    """A step of ``chunk`` bytes at the rate that moves a ``full`` chunk at ``channel_Bps``."""
    return (chunk + half) * full / ((full + half) * channel_Bps)


def test_in_switch_reduction_beats_ring_inside_an_nvswitch_node():
    topo = load_topology("dgx-h100")
    S = 2**30
    est = estimate("all_reduce", nbytes=S, topology=topo)
    achieved = 18 * 20.6
    assert est.algorithm == "switch"
    # NVLS moves (n+1)/n x S through each GPU's links, at tuning.cc nvlsEfficiency (Hopper 0.85)
    # of NVLink. At 1 GiB its chunks are full (128 KiB): it pays only the 3-loop fill, 8 heads x
    # 128 KiB on each of 16 channels per loop.
    nvls = achieved * 0.85 * 8 / 9 * GB
    assert est.time_s == pytest.approx((S + 3 * 16 * 8 * 2**17) / nvls)
    ring = estimate("all_reduce", nbytes=S, topology=topo, algorithm="ring")
    # 24 channels of S/24: two full loops of 8 x 2 MiB and a short third one; one step of fill.
    channel_Bps = achieved * GB / 24
    last = (S / 24 - 2 * 8 * 2**21) / 8
    half = nccl_chunking.HALF_BYTES["simple"]
    extra = 14 * (
        _hockney_step_s(last, half, 2**21, channel_Bps) - last / channel_Bps
    ) + nccl_chunking.RING_FILL_STEPS * _hockney_step_s(2**21, half, 2**21, channel_Bps)
    assert ring.time_s == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 14 / 8 * S / (achieved * GB) + extra)


def test_a100_nodes_cannot_reduce_in_the_switch():
    with pytest.raises(ValueError, match="switch needs scale-up domains whose switch reduces"):
        estimate("all_reduce", nbytes=1e9, topology=load_topology("dgx-a100"), algorithm="switch")


def test_ring_across_nodes_is_bounded_by_nvlink_or_the_nodes_nics():
    topo = load_topology("dgx-a100x4")  # 8 x 23.5 GB/s NICs = 188 GB/s < 240 GB/s NVLink
    est = estimate("all_reduce", nbytes=140e9, topology=topo, algorithm="ring")
    assert est.busbw_GBps == pytest.approx(188, rel=1e-3)
    shape = group_shape(topo, topo.first(32))
    assert (shape.domains, shape.per_domain) == (4, 8)
    assert shape.inter_ring.GBps == pytest.approx(188)
    assert shape.inter_rank.GBps == pytest.approx(23.5)


def test_one_rank_per_node_drives_one_nic():
    topo = load_topology("dgx-h100x4")
    shape = group_shape(topo, [0, 8, 16, 24])  # a DP group along rail 0
    assert shape.intra is None and shape.inter_ring.GBps == pytest.approx(NDR_NIC)


def test_hierarchical_is_intra_reduce_scatter_inter_all_reduce_intra_all_gather():
    topo = load_topology("dgx-a100x4")
    S = 1e9
    est = estimate("all_reduce", nbytes=S, topology=topo, algorithm="hierarchical")
    intra = 8.4e-6 + 7 * 3.4e-6 + 7 / 8 * S / (240 * GB)
    inter = (8.4e-6 + 2 * 3 * 14e-6) * 1.4 + 2 * 3 / 4 * (S / 8) / (23.5 * GB)
    assert est.time_s == pytest.approx(2 * intra + inter)
    with pytest.raises(ValueError, match="hierarchical needs a group spanning 2\\+"):
        estimate("all_reduce", nbytes=S, topology=topo, group_size=8, algorithm="hierarchical")


def test_nccl_does_not_pick_hierarchical_by_itself_but_ideal_does():
    nccl = estimate("all_reduce", nbytes=1e6, topology=load_topology("dgx-a100x4"))
    assert "hierarchical" not in {a for a, _, _ in nccl.candidates}
    link = bare_link(100, 5.0, 16)
    two_level = dataclasses.replace(load_topology("dgx-a100x2"), library=link.library)
    ideal = estimate("all_reduce", nbytes=1e6, topology=two_level)
    assert "hierarchical" in {a for a, _, _ in ideal.candidates}


def test_nccl_picks_low_latency_protocols_for_small_messages():
    topo = load_topology("dgx-h100x4")
    assert estimate("all_reduce", nbytes=1e4, topology=topo).protocol == "ll"
    assert estimate("all_reduce", nbytes=1e10, topology=topo).protocol == "simple"


def test_nccl_tree_medium_size_correction_follows_tuning_cc():
    assert NCCL.size_correction("tree", "simple", 64 * 2**12) == 0.5
    assert NCCL.size_correction("tree", "simple", 2**40) == 1.0
    assert NCCL.size_correction("ring", "simple", 64 * 2**12) == 1.0


def test_oversubscribed_fat_tree_halves_bandwidth_once_traffic_leaves_a_leaf():
    topo = load_topology("dgx-h100x4", fabric="fat-tree")
    fabric = dataclasses.replace(topo.fabric, oversubscription=2.0, nodes_per_leaf=2)
    topo = dataclasses.replace(topo, fabric=fabric)
    within = group_shape(topo, [0, 8])
    across = group_shape(topo, [0, 16])
    assert within.inter_ring.GBps == pytest.approx(NDR_NIC)
    assert across.inter_ring.GBps == pytest.approx(NDR_NIC / 2)


def test_rail_optimized_cross_rail_peers_pay_the_spine():
    topo = load_topology("dgx-h100x2")
    topo = dataclasses.replace(topo, fabric=dataclasses.replace(topo.fabric, oversubscription=2.0))
    assert group_shape(topo, [0, 8]).inter_ring.GBps == pytest.approx(NDR_NIC)  # both rail 0
    assert group_shape(topo, [0, 9]).inter_ring.GBps == pytest.approx(NDR_NIC / 2)  # rails 0, 1


def test_dragonfly_global_links_taper_inter_group_traffic():
    topo = load_topology("dgx-h100x4", fabric="dragonfly")
    fabric = dataclasses.replace(
        topo.fabric, kind=FabricKind.DRAGONFLY, nodes_per_group=2, global_taper=0.25
    )
    topo = dataclasses.replace(topo, fabric=fabric)
    assert group_shape(topo, [0, 8]).inter_ring.GBps == pytest.approx(NDR_NIC)
    assert group_shape(topo, [0, 16]).inter_ring.GBps == pytest.approx(NDR_NIC / 4)


def test_torus_groups_use_two_links_per_dimension_they_span():
    topo = load_topology("tpu-v5p-cube")
    line = group_shape(topo, topo.first(4))  # varies along one axis
    plane = group_shape(topo, topo.first(16))
    cube = group_shape(topo, topo.first(64))
    assert line.intra.GBps == pytest.approx(200)
    assert plane.intra.GBps == pytest.approx(400)
    assert cube.intra.GBps == pytest.approx(600)


def test_gloo_runs_ring_only_unless_forced():
    topo = load_topology("cpu-gloo")
    est = estimate("all_reduce", nbytes=1e6, topology=topo)
    assert [a for a, _, _ in est.candidates] == ["ring"]
    assert estimate("all_reduce", nbytes=1e6, topology=topo, algorithm="tree").algorithm == "tree"


def test_group_of_one_costs_nothing():
    est = estimate("all_reduce", nbytes=1e9, topology=load_topology("dgx-h100"), group_size=1)
    assert est.time_s == 0.0 and est.busbw_GBps == 0.0


def test_busbw_of_a_full_node_ring_equals_the_achieved_link_rate_for_large_sizes():
    est = estimate("all_reduce", nbytes=1e12, topology=load_topology("dgx-a100"))
    assert est.algorithm == "ring"
    assert est.busbw_GBps == pytest.approx(240, rel=1e-3)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"nbytes": -5}, ValueError, "nbytes must be >= 0"),
        ({"nbytes": 1, "group_size": 16}, ValueError, "group_size 16 must be between 1 and the 8"),
        ({"nbytes": 1, "group": "dp"}, TypeError, "named groups come from a placement plan"),
        ({"nbytes": 1, "group": [0, 0]}, ValueError, "names a rank twice"),
        ({"nbytes": 1, "group": [0, 9]}, ValueError, "rank 9 is not a device"),
        ({"nbytes": 1, "group": [0], "group_size": 1}, ValueError, "either group"),
        ({"nbytes": 1, "algorithm": "butterfly"}, ValueError, "algorithm 'butterfly' does not run"),
    ],
)
def test_bad_requests_are_rejected_with_the_offending_value(kwargs, error, message):
    with pytest.raises(error, match=message):
        estimate("all_reduce", topology=load_topology("dgx-h100"), **kwargs)


def test_unknown_collective_suggests_the_nearest_and_aliases_work():
    with pytest.raises(ValueError, match="did you mean 'all_gather'"):
        estimate("all_gathr", nbytes=1, topology=bare_link(1, 0, 2))
    assert estimate("allreduce", nbytes=1, topology=bare_link(1, 0, 2)).collective == "all_reduce"
    assert estimate("All-Gather", nbytes=1, topology=bare_link(1, 0, 2)).collective == "all_gather"


def test_estimate_document_has_the_design_keys():
    doc = estimate("all_reduce", nbytes=1e6, topology=load_topology("dgx-h100")).to_dict()
    assert {
        "collective",
        "bytes",
        "group_size",
        "algorithm",
        "time_s",
        "algbw_GBps",
        "busbw_GBps",
    } <= doc.keys()
    assert math.isclose(doc["time_s"], min(c["time_s"] for c in doc["candidates"]))


def test_nvlink_generation_follows_the_per_link_rate():
    assert nvlink_generation(load_topology("dgx-h100").domains[0]) == 4
    assert nvlink_generation(load_topology("hgx-b200").domains[0]) == 5
    assert nvlink_generation(load_topology("gb200-nvl72").domains[0]) == 5


def test_nvls_moves_n_plus_one_shards_per_gpu_and_flattens_beyond_one_board():
    b200 = load_topology("hgx-b200").domains[0]
    assert nvls_allreduce_GBps(b200, 8) == pytest.approx(18 * 40.1 * 0.74 * 8 / 9)
    assert nvls_allreduce_GBps(b200, 4) == pytest.approx(18 * 40.1 * 0.74 * 4 / 5)
    assert rack_factor(8) == 1.0 and rack_factor(72) == pytest.approx(0.912, abs=1e-3)
    # busbw = algbw x 2(n-1)/n: roughly flat from 8 to 72 GPUs, as measured (811 / 835 GB/s at
    # 8 GiB, +3 %); the 72-GPU fill is 3 loops of 72 heads, still 4 % of the time at 4 GiB,
    # which the fitted rack factor makes up for, so 8 GiB comes out 6 % above 8 GPUs.
    nvl72 = load_topology("gb200-nvl72")
    busbw = {
        n: estimate("all_reduce", nbytes=2**33, topology=nvl72, group_size=n).busbw_GBps
        for n in (8, 72)
    }
    assert busbw[72] == pytest.approx(busbw[8], rel=0.07)


def test_nvls_tree_is_bound_by_the_nodes_nics_or_the_slower_in_node_switch_path():
    S = 2**33
    b200x2 = estimate("all_reduce", nbytes=S, topology=load_topology("hgx-b200x2"))
    # 8 NICs x 47 GB/s each way carry the 2-node tree's S: algbw 376 GB/s, less the 3-loop fill
    # of 8 heads x 128 KiB on each of 32 channels (1.2 % at 8 GiB); 2 x 14 us up and down.
    assert b200x2.algorithm == "switch"
    nics = 8 * NDR_NIC * GB
    assert b200x2.time_s == pytest.approx(28e-6 + (S + 3 * 32 * 8 * 2**17) / nics)
    h100x2 = estimate("all_reduce", nbytes=S, topology=load_topology("dgx-h100x2"))
    assert h100x2.algbw_GBps == pytest.approx(18 * 20.6 * 0.85 * 8 / 9 * TREE_WARP_FACTOR, rel=0.01)


def test_blackwell_nvls_tree_makes_up_its_slower_channels_with_more_of_them():
    # nvls.cc: 32 NVLS channels across nodes against 24 in one NVLink domain on SM100; Hopper
    # runs 16 in both, so only Hopper's in-domain part drops to TREE_WARP_FACTOR.
    b200, h100 = load_topology("hgx-b200").domains[0], load_topology("dgx-h100").domains[0]
    assert nvls_tree_domain_GBps(b200, 8) == pytest.approx(nvls_allreduce_GBps(b200, 8))
    assert nvls_tree_domain_GBps(h100, 8) == pytest.approx(
        nvls_allreduce_GBps(h100, 8) * TREE_WARP_FACTOR
    )


@pytest.mark.parametrize(("domains", "volume"), [(2, 1.0), (3, 1.5), (4, 2.0), (20, 2.0)])
def test_a_double_binary_tree_loads_a_domains_nics_with_up_to_twice_the_data(domains, volume):
    assert tree_network_volume(domains) == volume
