"""ok.plan: layouts, domain integrity, refusals, expert grid, predictions (no processes)."""

import math

import pytest

import overlapkit as ok
from overlapkit.cost import estimate
from overlapkit.planner import PlacementError, Workload, naive_placement, plan
from overlapkit.planner.explain import where
from overlapkit.planner.penalties import split_penalties
from overlapkit.topology import load_topology, merge_views


def _domains_of(topology, group):
    return {topology.domain_index(r) for r in group}


def _interleaved(nodes=2, per_node=4):
    """What torchrun could hand out: rank r on node r % nodes (CPU workers, detected)."""
    views = [
        {
            "rank": r,
            "hostname": "host",
            "group_rank": r % nodes,
            "local_rank": r // nodes,
            "local_world_size": per_node,
            "gpu": None,
            "nics": [],
        }
        for r in range(nodes * per_node)
    ]
    return merge_views(views)


def test_tp8_pp2_on_four_dgx_nodes_keeps_tp_in_a_node_and_dp_pp_on_rails():
    topology = load_topology("dgx-h100x4")
    placement = ok.plan(topology, tp=8, pp=2)
    assert placement.mesh_dim_names == ("pp", "dp", "ep", "cp", "tp")
    assert placement.dims == {"pp": 2, "dp": 2, "ep": 1, "cp": 1, "tp": 8}
    assert placement.groups("tp") == tuple(tuple(range(n, n + 8)) for n in (0, 8, 16, 24))
    assert set(placement.groups("dp")) == {(r, r + 8) for r in (*range(8), *range(16, 24))}
    assert set(placement.groups("pp")) == {(r, r + 16) for r in range(16)}
    for peers in (*placement.groups("dp"), *placement.groups("pp")):
        assert len({topology.devices[r].nic for r in peers}) == 1  # one rail
    text = placement.explain()
    assert "inside one nvlink domain (one node)" in where(placement, "tp")
    assert "rail-aligned" in where(placement, "dp") and "rail-aligned" in where(placement, "pp")
    assert "rank grid" in text and text.count("  node ") == 4


def test_dp_takes_what_is_left_and_size_one_axes_are_kept():
    placement = plan(load_topology("dgx-h100x2"), tp=4)
    assert placement.shape == (1, 4, 1, 1, 4)
    assert placement.groups("ep") == tuple((r,) for r in range(16))
    assert placement.mesh == [[[[list(range(b, b + 4))]] for b in range(0, 16, 4)]]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"tp": 0}, ValueError, "tp must be >= 1, got 0"),
        ({"tp": 2.0}, TypeError, "tp must be an int, got 2.0"),
        ({"ep": True}, TypeError, "ep must be an int, got True"),
        ({"dp": 0}, ValueError, r"dp must be -1 \(whatever is left\) or >= 1, got 0"),
        (
            {"tp": 8, "pp": 3},
            ValueError,
            "tp x ep x cp x pp = 8 x 1 x 1 x 3 = 24 does not divide the 32 ranks of topology "
            "'dgx-h100x4'",
        ),
        (
            {"tp": 8, "pp": 2, "dp": 3},
            ValueError,
            r"tp x ep x cp x pp = 8 x 1 x 1 x 2 x dp \(3\) = 48, but topology 'dgx-h100x4' has "
            "32 ranks; use dp=-1",
        ),
        ({"tp": 8, "dp_shard": 3}, ValueError, r"dp_shard \(3\) must divide dp \(4\)"),
        ({"order": ("pp", "tp")}, ValueError, "order .* must name each mesh axis once"),
        (
            # torch can only slice mesh["dp_replicate", "dp_shard"] in mesh order.
            {"tp": 8, "dp_shard": 2, "order": ("pp", "dp_shard", "dp_replicate", "ep", "cp", "tp")},
            ValueError,
            r"order \['pp', 'dp_shard', 'dp_replicate', 'ep', 'cp', 'tp'\] puts dp_shard outside "
            r"dp_replicate; .*HSDP.*\('pp', 'dp_replicate', 'dp_shard', 'ep', 'cp', 'tp'\)",
        ),
    ],
)
def test_bad_sizes_are_rejected_naming_them(kwargs, error, message):
    with pytest.raises(error, match=message):
        plan(load_topology("dgx-h100x4"), **kwargs)


def test_plan_rejects_something_that_is_not_a_topology():
    with pytest.raises(TypeError, match="topology must be an overlapkit Topology .*, got str"):
        plan("dgx-h100x4", tp=8)


def test_tp3_on_8gpu_nodes_is_refused_with_the_nearest_valid_layouts_and_the_penalty():
    topology = load_topology("dgx-h100x3")
    with pytest.raises(PlacementError) as caught:
        plan(topology, tp=3)
    message = str(caught.value)
    assert "cannot place tp=3 dp=8 on 'dgx-h100x3'" in message
    assert "tp = 3 ranks does not divide the 8-rank scale-up domain" in message
    assert "ranks 6, 7, 8: 2 in domain 0, 1 in domain 1" in message
    assert "allow_split=True" in message and "predicted penalty +" in message
    suggestions = caught.value.suggestions
    assert [(s["tp"], s["dp"]) for s in suggestions[:2]] == [(4, 6), (2, 12)]
    for s in suggestions:
        placement = plan(topology, **s)  # every suggestion is itself placeable
        for group in placement.groups("tp"):
            assert len(_domains_of(topology, group)) == 1


def test_allow_split_places_it_and_the_penalty_is_the_split_groups_extra_time():
    topology = load_topology("dgx-h100x3")
    placement = plan(topology, tp=3, allow_split=True)
    assert [v.axis for v in placement.violations] == ["tp"]
    assert any(len(_domains_of(topology, g)) == 2 for g in placement.groups("tp"))
    (tp,) = [c for c in placement.collectives() if c.dim == "tp"]
    inside = estimate("all_reduce", nbytes=tp.nbytes, topology=topology, group=[0, 1, 2])
    straddling = estimate("all_reduce", nbytes=tp.nbytes, topology=topology, group=[6, 7, 8])
    assert straddling.time_s > inside.time_s
    assert split_penalties(placement) == [
        ("tp", pytest.approx(tp.count * (straddling.time_s - inside.time_s)))
    ]
    assert "split allowed: tp straddles scale-up domains; predicted penalty +" in (
        placement.explain()
    )


def test_traffic_order_is_changed_when_it_would_split_a_domain_and_the_reason_is_given():
    topology = load_topology("dgx-h100x3")
    placement = plan(topology, tp=2, cp=3, ep=4)
    # tp x cp = 6 does not divide 8, tp x ep = 8 does: ep goes inside cp.
    assert placement.mesh_dim_names == ("pp", "dp", "cp", "ep", "tp")
    for group in (*placement.groups("tp"), *placement.groups("ep")):
        assert len(_domains_of(topology, group)) == 1
    assert placement.notes and "tp x cp = 2 x 3 = 6 ranks does not divide" in placement.notes[0]
    assert "note: order changed from the traffic order" in placement.explain()


def test_a_user_order_that_pushes_tp_across_nodes_is_refused_then_allowed_with_its_cost():
    topology = load_topology("dgx-h100x2")
    wrong = ("pp", "ep", "cp", "tp", "dp")
    with pytest.raises(PlacementError, match=r"tp = 8 ranks fits in one 8-rank scale-up domain"):
        plan(topology, tp=8, order=wrong)
    placement = plan(topology, tp=8, order=wrong, allow_split=True)
    assert placement.layout == "user" and placement.groups("tp")[0] == tuple(range(0, 16, 2))
    planned = plan(topology, tp=8)
    delta = placement.comm_time_s() - planned.comm_time_s()
    assert f"order override: {delta * 1e3:+.4g} ms per step" in placement.explain()


def test_nvl72_rack_is_one_domain_so_tp_times_ep_up_to_72_stays_in_nvlink():
    topology = load_topology("gb200-nvl72x2")
    placement = plan(topology, tp=8, ep=9)
    for axis in ("tp", "ep"):
        for group in placement.groups(axis):
            assert len(_domains_of(topology, group)) == 1
    ep_group = placement.groups("ep")[0]
    assert len({topology.devices[r].node for r in ep_group}) == 9  # 9 trays, one NVLink domain
    assert where(placement, "ep") == "inside one nvlink domain (9 nodes of one domain)"
    assert all(len(_domains_of(topology, g)) == 2 for g in placement.groups("dp"))


def test_nvl72_refuses_tp8_ep8_and_proposes_ep9():
    with pytest.raises(
        PlacementError, match="tp x ep = 8 x 8 = 64 ranks does not divide the 72"
    ) as caught:
        plan(load_topology("gb200-nvl72x8"), tp=8, ep=8)
    assert caught.value.suggestions[0] == {"tp": 8, "ep": 9, "cp": 1, "pp": 1, "dp": 8}


def test_expert_grid_reduces_dense_gradients_over_dp_x_ep_and_expert_gradients_over_dp():
    topology = load_topology("dgx-h100x4")
    workload = Workload(params=1e9, layers=8, hidden=1024, microbatches=1)
    placement = plan(topology, tp=2, ep=4, workload=workload)
    grads = {c.what: c for c in placement.collectives() if c.dim == "dp"}
    dense, expert = grads["dense gradients"], grads["expert gradients"]
    assert dense.axes == ("dp", "ep") and dense.estimate.group_size == 16
    assert expert.axes == ("dp",) and expert.estimate.group_size == 4
    f = workload.expert_fraction
    assert dense.nbytes == pytest.approx(1e9 * (1 - f) / 2 * 2)
    assert expert.nbytes == pytest.approx(1e9 * f / (2 * 4) * 2)
    (a2a,) = [c for c in placement.collectives() if c.dim == "ep"]
    assert a2a.collective == "all_to_all" and a2a.count == 4 * 8
    assert a2a.nbytes == 1 * 4096 * 1024 * workload.topk * 2


def test_collectives_match_the_megatron_counts_and_the_cost_model_on_explicit_groups():
    topology = load_topology("dgx-h100x4")
    workload = Workload(params=70e9, layers=80, hidden=8192, seq_len=4096, microbatches=4)
    placement = plan(topology, tp=8, pp=2, workload=workload)
    by_dim = {c.dim: c for c in placement.collectives()}
    assert set(by_dim) == {"tp", "dp", "pp"}
    activations = 4096 * 8192 * 2
    tp, dp, pp = by_dim["tp"], by_dim["dp"], by_dim["pp"]
    assert (tp.nbytes, tp.count) == (activations, 4 * 40 * 4)
    assert tp.time_s == estimate("all_reduce", nbytes=activations, topology=topology,
                                 group=range(8)).time_s  # fmt: skip
    assert (dp.nbytes, dp.count) == (70e9 / 16 * 2, 1)
    assert dp.time_s == estimate("all_reduce", nbytes=dp.nbytes, topology=topology,
                                 group=[0, 8]).time_s  # fmt: skip
    assert (pp.nbytes, pp.count) == (activations, 2 * 4)
    assert pp.time_s == estimate("send_recv", nbytes=activations, topology=topology,
                                 group=[0, 16]).time_s  # fmt: skip
    assert placement.comm_time_s() == pytest.approx(sum(c.total_s for c in by_dim.values()))


def test_context_parallel_moves_kv_and_splits_the_sequence_for_tp():
    workload = Workload(params=7e9, layers=32, hidden=4096, seq_len=8192, microbatches=1)
    placement = plan(load_topology("dgx-h100x2"), tp=4, cp=2, workload=workload)
    costs = {(c.dim, c.collective): c for c in placement.collectives()}
    kv = 2 * 8192 * 4096 / 4 * 2
    assert costs[("cp", "all_gather")].nbytes == kv and costs[("cp", "all_gather")].count == 64
    assert costs[("cp", "reduce_scatter")].count == 32
    assert costs[("tp", "all_reduce")].nbytes == 8192 / 2 * 4096 * 2


def test_hsdp_split_names_dp_replicate_and_dp_shard_and_shards_inside_the_node():
    topology = load_topology("dgx-h100x4")
    placement = plan(topology, tp=2, dp_shard=4, workload=Workload(microbatches=1))
    assert placement.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
    assert placement.dims["dp"] == 16 and placement.sizes["dp_replicate"] == 4
    for group in placement.groups("dp_shard"):
        assert len(_domains_of(topology, group)) == 1
    assert len(placement.groups("dp")[0]) == 16
    kinds = [(c.collective, c.axes) for c in placement.collectives() if c.dim == "dp"]
    assert kinds == [
        ("reduce_scatter", ("dp_shard",)),
        ("all_gather", ("dp_shard",)),
        ("all_reduce", ("dp_replicate",)),
    ]


def test_interleaved_ranks_are_placed_by_node_not_by_rank_number():
    topology = _interleaved()
    assert topology.nodes() == ((0, 2, 4, 6), (1, 3, 5, 7))
    placement = plan(topology, tp=4)
    assert placement.groups("tp") == ((0, 2, 4, 6), (1, 3, 5, 7))
    naive = naive_placement(placement)
    assert naive.groups("tp") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert naive.comm_time_s() > placement.comm_time_s()


def test_groups_rejects_unknown_axes_and_accepts_several():
    placement = plan(load_topology("dgx-h100x2"), tp=2, cp=2)
    with pytest.raises(ValueError, match="unknown mesh axis 'sp'; valid: pp, dp, ep, cp, tp"):
        placement.groups("sp")
    together = placement.groups(("cp", "tp"))
    assert together[0] == (0, 1, 2, 3) and len(together) == 4


def test_estimate_of_a_named_group_is_the_slowest_group_of_that_axis():
    topology = load_topology("dgx-h100x3")
    placement = plan(topology, tp=3, allow_split=True)
    named = ok.estimate("all_reduce", nbytes="64MiB", placement=placement, group="tp")
    explicit = [
        estimate("all_reduce", nbytes="64MiB", topology=topology, group=g)
        for g in placement.groups("tp")
    ]
    assert named.time_s == max(e.time_s for e in explicit)
    assert named.time_s > min(e.time_s for e in explicit)
    with pytest.raises(ValueError, match="is not the placement's"):
        ok.estimate("all_reduce", nbytes=1, topology=load_topology("dgx-h100"), placement=placement,
                    group="tp")  # fmt: skip


def test_groups_of_one_axis_share_a_nic_when_they_cross_together():
    # cpu-gloo nodes have one NIC: two tp pairs crossing at once get half of it each.
    topology = load_topology("cpu-gloox2")
    wrong = plan(topology, tp=2, order=("pp", "ep", "cp", "tp", "dp"), allow_split=True)
    together = ok.estimate("all_reduce", nbytes=1e8, placement=wrong, group="tp")
    alone = estimate("all_reduce", nbytes=1e8, topology=topology, group=[0, 2])
    link = topology.fabric.achieved_GBps * 1e9
    assert alone.time_s == pytest.approx(2 * 10e-6 + 1e8 / link)
    assert together.time_s == pytest.approx(2 * 10e-6 + 1e8 / (link / 2))


def test_workload_shape_follows_the_documented_rule_and_rejects_bad_fields():
    w = Workload(params=7e9)
    assert w.layers == round((7e9 / (12 * 128**2)) ** (1 / 3)) == 33
    assert w.hidden == 128 * math.ceil(math.sqrt(7e9 / (12 * 33)) / 128) == 4224
    assert Workload(params=7e9, hidden=4096).layers == round(7e9 / (12 * 4096**2))
    with pytest.raises(ValueError, match="Workload.seq_len must be an int >= 1, got 0"):
        Workload(seq_len=0)
    with pytest.raises(ValueError, match="dtype 'int3' is not known"):
        Workload(dtype="int3")
    with pytest.raises(ValueError, match=r"expert_fraction must be in \[0, 1\), got 1.5"):
        Workload(expert_fraction=1.5)


def test_placement_document_has_the_design_keys():
    doc = plan(load_topology("dgx-h100x2"), tp=8).to_dict()
    assert {"world_size", "dims", "mesh_dim_names", "mesh", "groups", "collectives"} <= doc.keys()
    assert doc["dims"]["tp"] == 8 and doc["mesh_dim_names"] == ["pp", "dp", "ep", "cp", "tp"]
    assert doc["groups"]["tp"] == [list(range(8)), list(range(8, 16))]
    for entry in doc["collectives"]:
        assert {"dim", "collective", "bytes", "time_s"} <= entry.keys()


def test_pipeline_pairs_count_each_rank_once_when_sharing_a_nic():
    # 4 nodes of 2 CPU ranks, one NIC each: both pipelines cross every link at once, so each
    # send gets half a NIC, even though an inner stage belongs to two (prev, next) pairs.
    topology = load_topology("cpu-gloox4")
    placement = plan(topology, tp=2, pp=4, workload=Workload(params=1e9, microbatches=1))
    (pp,) = [c for c in placement.collectives() if c.dim == "pp"]
    nic = topology.fabric.achieved_GBps * 1e9
    assert pp.time_s == pytest.approx(topology.fabric.latency_us * 1e-6 + pp.nbytes / (nic / 2))
