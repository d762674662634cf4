"""autoplan.step_time, group_costs, gemm: the step-time model's parts on real cost-model groups."""

import dataclasses

import numpy as np
import pytest

from overlapkit.autoplan.framework import MEGATRON, OVERLAPKIT_TRAIN
from overlapkit.autoplan.gemm import wave_efficiency
from overlapkit.autoplan.group_costs import HSDP_ORDER, TRAFFIC_ORDER, AxisCosts
from overlapkit.autoplan.models import load_model, train_model_spec
from overlapkit.autoplan.step_time import StepOptions, parameter_tensors, predict_step
from overlapkit.cost.estimate import estimate
from overlapkit.layout import TrainingLayout
from overlapkit.planner import plan
from overlapkit.topology import bare_link, load_topology
from overlapkit.topology.accelerator import Accelerator
from overlapkit.topology.model import Library
from overlapkit.train.models import GPTConfig

GPU = Accelerator(name="test", memory_GB=80, peak_bf16_tflops=1000, sms=None)
MODEL = load_model("llama3-8b")


def _options(**kw):
    return StepOptions(seq_len=4096, accelerator=GPU, achievable=0.5, overlap_efficiency=0.9, **kw)


def _free_comm(world):
    """Links so fast that communication costs nothing measurable."""
    return bare_link(1e9, 0.0, world).with_accelerator(GPU)


def test_pipeline_step_is_m_plus_bubble_micro_batches():
    topo = _free_comm(8)
    costs = AxisCosts(topo)
    for v in (1, 2):
        layout = TrainingLayout(pp=8, dp=1, num_micro_batches=16, virtual_stages=v)
        step = predict_step(MODEL, layout, _options(), costs)
        per_micro_batch = step.compute_s / 16
        # Narayanan et al.: the bubble is (p - 1) / v micro-batches.
        assert step.bubble_s == pytest.approx(7 / v * per_micro_batch, rel=1e-6)


def test_full_recompute_adds_one_forward():
    costs = AxisCosts(_free_comm(1))
    none, full = (
        predict_step(MODEL, TrainingLayout(recompute=r), _options(), costs)
        for r in ("none", "full")
    )
    # Forward is a third of forward + backward, but for the output layer (not recomputed).
    assert 1.25 < full.compute_s / none.compute_s < 1.34
    assert full.hardware_flops > full.model_flops == none.model_flops == none.hardware_flops


def test_tensor_parallel_across_nodes_costs_more_than_inside_one():
    topo = load_topology("dgx-h100x2").with_accelerator(GPU)
    costs = AxisCosts(topo)
    inside = predict_step(MODEL, TrainingLayout(tp=8, dp=2), _options(), costs)
    across = predict_step(MODEL, TrainingLayout(tp=16, dp=1), _options(), costs)
    assert across.tp_s > inside.tp_s


def test_data_parallel_gradients_hide_behind_the_last_backward():
    topo = load_topology("dgx-h100x4").with_accelerator(GPU)
    costs = AxisCosts(topo)
    layout = TrainingLayout(tp=8, dp=4, num_micro_batches=4)
    hidden = predict_step(MODEL, layout, _options(), costs)
    exposed = predict_step(
        MODEL, layout, dataclasses.replace(_options(), overlap_efficiency=0.0), costs
    )
    # Without overlap the whole all-reduce is exposed; tp's is exposed either way.
    assert hidden.dp_s < exposed.dp_s
    assert exposed.dp_s == pytest.approx(exposed.comm_total_s - exposed.tp_s)


def test_representative_group_is_a_group_of_the_placement():
    topo = load_topology("dgx-h100x4")
    sizes = {"pp": 2, "dp": 2, "ep": 1, "cp": 1, "tp": 8}
    placement = plan(topo, tp=8, pp=2, dp=2)
    costs = AxisCosts(topo)
    for axis in ("tp", "dp", "pp"):
        group = tuple(costs.group(costs.shape(sizes, TRAFFIC_ORDER, (axis,))))
        assert group in set(placement.groups(axis))


def test_hsdp_replica_group_skips_the_shard_axis_between_its_axes():
    topo = load_topology("dgx-h100x4")
    sizes = {"pp": 1, "dp_replicate": 4, "dp_shard": 8, "ep": 1, "cp": 1, "tp": 1}
    placement = plan(topo, dp=32, dp_shard=8)
    costs = AxisCosts(topo)
    replicas = tuple(costs.group(costs.shape(sizes, HSDP_ORDER, ("dp_replicate", "ep", "cp"))))
    shard = tuple(costs.group(costs.shape(sizes, HSDP_ORDER, ("dp_shard",))))
    assert replicas in set(placement.groups("dp_replicate"))
    assert shard in set(placement.groups("dp_shard"))
    # One replica per node: the replicas' all-reduce crosses the network, the shards' does not.
    assert len({topo.devices[r].node for r in replicas}) == 4
    assert len({topo.devices[r].node for r in shard}) == 1


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "all_to_all"])
def test_costs_equal_the_cost_model_at_every_size(collective):
    topo = load_topology("dgx-h100x4")
    sizes = {"pp": 1, "dp": 4, "ep": 1, "cp": 1, "tp": 8}
    costs = AxisCosts(topo)
    group = next(r for r in plan(topo, tp=8, dp=4).groups("dp") if 0 in r)
    # 1 MiB to 8 GiB at 7 sizes per doubling: protocol and algorithm switch-overs included.
    for nbytes in np.geomspace(2**20, 2**33, 92):
        exact = estimate(collective, nbytes=nbytes, topology=topo, group=list(group)).time_s
        assert costs.time_s(collective, nbytes, sizes, TRAFFIC_ORDER, ("dp",)) == pytest.approx(
            exact, rel=1e-12
        )


def test_fewer_nics_than_ranks_share_them_between_concurrent_groups():
    topo = load_topology("cpu-gloox2")  # one NIC per two-rank node
    sizes = {"pp": 1, "dp": 2, "ep": 1, "cp": 1, "tp": 2}
    costs = AxisCosts(topo)
    alone = estimate("all_reduce", nbytes=64e6, topology=topo, group=[0, 2]).time_s
    shared = costs.time_s("all_reduce", 64e6, sizes, TRAFFIC_ORDER, ("dp",))
    assert shared > 1.5 * alone


def test_wave_quantization_penalises_a_last_wave_that_is_mostly_empty():
    # 109 tiles on 108 SMs take two waves: about half of them idle.
    assert wave_efficiency(128, 256 * 109, 108) == pytest.approx(109 / 216)
    assert wave_efficiency(128 * 108, 256, 108) == pytest.approx(1.0)
    assert wave_efficiency(100, 100, None) == 1.0


def test_tp_dispatch_cost_is_paid_per_sharded_layer_pass_only_under_tp():
    costs = AxisCosts(_free_comm(2))
    options = dataclasses.replace(_options(), tp_layer_dispatch_s=1e-3)
    for layout in (TrainingLayout(tp=2, num_micro_batches=3), TrainingLayout(dp=2)):
        charged = predict_step(MODEL, layout, options, costs)
        free = predict_step(MODEL, layout, _options(), costs)
        expected = 3 * MODEL.layers * 2 * 1e-3 if layout.tp > 1 else 0.0
        assert charged.compute_s - free.compute_s == pytest.approx(expected)


def test_each_framework_makes_its_own_tp_collectives():
    # Every call costs 1 ms on links too fast to add anything: tp_s counts the calls.
    costs = AxisCosts(_free_comm(2))
    layout = TrainingLayout(tp=2)
    calls = {}
    for framework in (MEGATRON, OVERLAPKIT_TRAIN):
        options = _options(collective_overhead_s=1e-3, framework=framework)
        calls[framework.name] = predict_step(MODEL, layout, options, costs).tp_s / 1e-3
    # Both sequence-parallel: an all-gather and a reduce-scatter around attention and the MLP,
    # forward and backward; overlapkit-train also cuts the sequence before the first block
    # (its backward gathers) and gathers it after the last (overlapkit.inlayer).
    assert calls["megatron"] == pytest.approx(MODEL.layers * 8, rel=1e-6)
    assert calls["overlapkit-train"] == pytest.approx(MODEL.layers * 8 + 2, rel=1e-6)


def test_overlapkit_train_computes_and_reduces_the_replicated_head_on_every_tp_rank():
    topo = load_topology("dgx-h100x2").with_accelerator(GPU)
    costs = AxisCosts(topo)
    for tp, more in ((1, False), (2, True)):
        layout = TrainingLayout(tp=tp, dp=16 // tp)
        split, whole = (
            predict_step(MODEL, layout, _options(framework=f), costs)
            for f in (MEGATRON, OVERLAPKIT_TRAIN)
        )
        assert (whole.compute_s > split.compute_s) == more
        assert (whole.comm_total_s - whole.tp_s > split.comm_total_s - split.tp_s) == more


def test_optimizer_host_cost_counts_plain_and_dtensor_parameters():
    spec = train_model_spec(GPTConfig(n_embd=128, block_size=64), name="gpt_tiny")
    costs = AxisCosts(_free_comm(4))
    options = _options(optimizer_tensor_s=1e-3, optimizer_dtensor_s=1e-2, optimizer_param_s=0.0)
    # gpt_tiny holds 68 parameter tensors: 48 in the blocks' linear layers, of which 40 are split
    # under tp (DTensors) and the 8 row-parallel biases stay plain (sequence parallelism).
    expected = {
        TrainingLayout(dp=4): 68e-3,
        TrainingLayout(dp=4, sharding="fsdp"): 68e-2,
        TrainingLayout(dp=4, sharding="hsdp", dp_shard=2): 68e-2,
        TrainingLayout(dp=2, tp=2): 28e-3 + 40e-2,
    }
    for layout, seconds in expected.items():
        step = predict_step(
            spec, layout, dataclasses.replace(options, framework=OVERLAPKIT_TRAIN), costs
        )
        assert step.optimizer_s == pytest.approx(seconds)
    assert parameter_tensors(spec, TrainingLayout(tp=2), MEGATRON, layers=4, stage=0) == (68, 0)
    assert _options().optimizer_tensor_s == _options().optimizer_dtensor_s == 0.0


def test_a_single_gradient_bucket_hides_behind_nothing():
    spec = train_model_spec(GPTConfig(n_embd=128, block_size=64), name="gpt_tiny")
    costs = AxisCosts(load_topology("cpu-gloox2").with_accelerator(GPU))
    ideal = dataclasses.replace(_options(), overlap_efficiency=1.0)
    # gpt_tiny's 0.8 M parameters are one bucket (Megatron's 40 M): ready when backward ends.
    one = predict_step(spec, TrainingLayout(dp=4), ideal, costs)
    assert one.dp_s == pytest.approx(one.comm_total_s) and one.dp_s > 0
    # Under FSDP the first gather and the last reduce-scatter are exposed however long the
    # compute is.
    fsdp = predict_step(spec, TrainingLayout(dp=4, sharding="fsdp"), ideal, costs)
    assert fsdp.fsdp_s > 0


TINY = train_model_spec(GPTConfig(n_embd=128, block_size=64), name="gpt_tiny")  # 4 blocks


def _calls(
    layout: TrainingLayout, framework, part: str = "comm_total_s", library: str = "ideal"
) -> float:
    """Collective calls of one step where each costs 1 ms on links too fast to add anything."""
    costs = AxisCosts(dataclasses.replace(_free_comm(4), library=Library(library)))
    options = _options(collective_overhead_s=1e-3, framework=framework)
    return getattr(predict_step(TINY, layout, options, costs), part) / 1e-3


def test_overlapkit_train_gathers_kv_before_attention_and_scatters_their_gradients_exposed():
    # Per layer and micro-batch on gloo (cplib::flex_cp_allgather): an all-gather of K and one
    # of V, a reduce-scatter of each one's gradient (full recomputation gathers both again;
    # selective saves the gathered K/V). On CUDA torch's context_parallel gathers K and V in one
    # buffer, again in backward, and scatters their gradients in one.
    for recompute, gloo_calls, nccl_calls in (
        ("none", 4, 3),
        ("selective", 4, 3),
        ("full", 6, 4),
    ):
        layout = TrainingLayout(cp=2, dp=2, num_micro_batches=3, recompute=recompute)
        gloo = _calls(layout, OVERLAPKIT_TRAIN, "cp_s", library="gloo")
        assert gloo == pytest.approx(3 * 4 * gloo_calls), recompute
        nccl = _calls(layout, OVERLAPKIT_TRAIN, "cp_s", library="nccl")
        assert nccl == pytest.approx(3 * 4 * nccl_calls, rel=0.02), recompute  # + its latencies
    # Megatron's ring hides them behind the attention (the free links leave only the calls).
    ring = TrainingLayout(cp=2, dp=2, num_micro_batches=3)
    assert _calls(ring, MEGATRON, "cp_s") < _calls(ring, OVERLAPKIT_TRAIN, "cp_s")


def test_overlapkit_train_sums_the_tied_embedding_once_per_step_between_first_and_last_stage():
    layout = TrainingLayout(pp=2, dp=2, num_micro_batches=4)
    untied = dataclasses.replace(OVERLAPKIT_TRAIN, tied_embedding_all_reduce=False)
    extra = _calls(layout, OVERLAPKIT_TRAIN, "pp_s") - _calls(layout, untied, "pp_s")
    assert extra == pytest.approx(1.0)
    assert _calls(layout, MEGATRON, "pp_s") == _calls(layout, untied, "pp_s")


def test_overlapkit_train_zero_and_fsdp_make_fsdp2s_counted_collectives():
    # docs/fsdp.md's table per step, 5 FSDP groups (4 blocks and the root), m micro-batches:
    # ZeRO-1 one all-gather and one reduce-scatter per group, ZeRO-2 m reduce-scatters, ZeRO-3
    # (FSDP2 under the loop's no_sync) 2m all-gathers and one reduce-scatter.
    m, groups = 3, 5
    for sharding, calls in (
        ("zero1", 2 * groups),
        ("zero2", groups + m * groups),
        ("fsdp", 2 * m * groups + groups),
    ):
        layout = TrainingLayout(dp=4, num_micro_batches=m, sharding=sharding)
        assert _calls(layout, OVERLAPKIT_TRAIN) == pytest.approx(calls), sharding
    # Megatron's distributed optimizer: one bucket each way; its FSDP scatters every backward.
    zero1 = TrainingLayout(dp=4, num_micro_batches=m, sharding="zero1")
    assert _calls(zero1, MEGATRON) == pytest.approx(2)
    fsdp = TrainingLayout(dp=4, num_micro_batches=m, sharding="fsdp")
    assert _calls(fsdp, MEGATRON) == pytest.approx(3 * m * groups)


def test_overlapkit_train_reduces_fsdp_after_the_pipeline_schedule_exposed():
    # Under pp the stage's reduce-scatter follows the schedule: on the critical path whole.
    costs = AxisCosts(load_topology("cpu-gloox2").with_accelerator(GPU))
    options = dataclasses.replace(_options(framework=OVERLAPKIT_TRAIN), overlap_efficiency=1.0)
    for sharding in ("fsdp", "zero1"):
        layout = TrainingLayout(pp=2, dp=2, num_micro_batches=2, sharding=sharding)
        after = predict_step(TINY, layout, options, costs)
        inside = predict_step(
            TINY,
            layout,
            dataclasses.replace(
                options,
                framework=dataclasses.replace(OVERLAPKIT_TRAIN, fsdp_reduce_after_pipeline=False),
            ),
            costs,
        )
        assert after.dp_s > inside.dp_s, sharding


def test_overlapkit_train_selective_reruns_the_attention_forward_even_with_flash():
    costs = AxisCosts(_free_comm(1))
    for framework, extra in ((MEGATRON, False), (OVERLAPKIT_TRAIN, True)):
        none, selective = (
            predict_step(TINY, TrainingLayout(recompute=r), _options(framework=framework), costs)
            for r in ("none", "selective")
        )
        # Megatron's policy under flash rebuilds only the activation outputs (memory traffic,
        # none on this accelerator without a bandwidth); overlapkit-train's reruns SDPA.
        assert (selective.compute_s > none.compute_s) == extra, framework.name
