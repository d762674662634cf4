"""The auto-planner with the zero-bubble schedules: priced from F, I and W, searched where the
table plans them, refused by Megatron-LM, and carried by both hand-offs."""

from __future__ import annotations

import dataclasses

import pytest

from bench.harness.train_layout import compose_run, planned_layout
from overlapkit.autoplan.framework import MEGATRON, OVERLAPKIT_TRAIN, TORCHTITAN
from overlapkit.autoplan.handoff.run_config import train_overrides
from overlapkit.autoplan.handoff.torchtitan import torchtitan_run
from overlapkit.autoplan.micro_batch import StageMicroBatch
from overlapkit.autoplan.models import load_model
from overlapkit.autoplan.pipeline_schedule import bubble_s, gradient_window_s
from overlapkit.autoplan.search import price, searched_layouts
from overlapkit.autoplan.settings import SearchSettings
from overlapkit.autoplan.step_time import StepOptions, StepRates, micro_batch_compute
from overlapkit.layout import TrainingLayout
from overlapkit.layout import overlapkit_train as table
from overlapkit.topology import load_topology

ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
INTERLEAVED = TrainingLayout(pp=4, dp=4, num_micro_batches=8, virtual_stages=2)


def _priced(layout: TrainingLayout, framework=TORCHTITAN):
    return price(
        load_topology("dgx-h100x2"),
        load_model("llama3-8b"),
        layout,
        seq_len=8192,
        settings=SearchSettings(framework=framework),
    )


def test_the_step_carries_each_schedules_bubble_and_activations():
    base = _priced(INTERLEAVED)
    options = StepOptions(
        seq_len=8192,
        accelerator=load_topology("dgx-h100x2").accelerator,
        achievable=0.5,
        overlap_efficiency=0.9,
    )
    stage = StageMicroBatch.of(
        load_model("llama3-8b"),
        INTERLEAVED,
        framework=TORCHTITAN,
        precision=options.precision,
        seq_len=8192,
    )
    passes = micro_batch_compute(stage, options, StepRates.of(options)).passes()
    # A transformer's weight step is about its forward, below its input step: ZB-H1's regime.
    assert 0.5 * passes.forward_s < passes.weight_s <= passes.forward_s < passes.input_s
    bubbles = {}
    for name in ZERO_BUBBLE:
        candidate = _priced(dataclasses.replace(INTERLEAVED, schedule=name))
        bubbles[name] = candidate.step.bubble_s
        # The schedule changes the bubble, the activations in flight and the window the
        # data-parallel reduction starts in (the weight steps, less than a backward).
        step, before = candidate.step, base.step
        assert step.step_s - step.bubble_s - step.dp_s == pytest.approx(
            before.step_s - before.bubble_s - before.dp_s
        )
        assert step.dp_s >= before.dp_s  # here one bucket's worth, exposed under either
        assert gradient_window_s(candidate.layout, passes) == passes.weight_s
        assert candidate.memory.activations < base.memory.activations
    assert gradient_window_s(INTERLEAVED, passes) == passes.input_s + passes.weight_s
    # llama3-8b at 8k tokens: attention's backward makes I well above W, so the interleaved
    # zero-bubble schedule keeps (F + I - W) / (F + I + W), about half, of interleaved 1F1B's.
    assert max(bubbles.values()) < 0.6 * base.step.bubble_s
    assert bubbles["ZBVZeroBubble"] < bubbles["InterleavedZeroBubble"]
    # 1F1B's (pp - 1) / v micro-batches, as the planner priced it before the shapes.
    micro_batch_s = (base.step.step_s - base.step.bubble_s - base.step.dp_s) / 8
    assert base.step.bubble_s == pytest.approx(3 / 2 * micro_batch_s, rel=0.05)
    assert bubble_s(INTERLEAVED, passes) > 0


def test_the_search_proposes_what_the_table_plans():
    topology, model = load_topology("dgx-h100x2"), load_model("llama3-8b")
    request = dict(global_batch=32, seq_len=8192, fixed={"pp": 4, "tp": 4})
    planned = {s.name for s in table.SCHEDULES if s.planned} & set(ZERO_BUBBLE)
    assert planned == set(ZERO_BUBBLE)
    found = {
        framework.name: searched_layouts(
            topology, model, settings=SearchSettings(framework=framework), **request
        )
        for framework in (TORCHTITAN, MEGATRON)
    }
    assert {layout.schedule for layout in found["torchtitan"]} == {None, *ZERO_BUBBLE}
    assert {layout.schedule for layout in found["megatron"]} == {None}
    assert all(
        layout.virtual_stages == 2 and layout.num_micro_batches >= 2 * layout.pp
        for layout in found["torchtitan"]
        if layout.schedule in ("ZBVZeroBubble", "DualPipeV")
    )


def test_a_run_prices_itself_on_its_schedule():
    """overlapkit-train's layout of a run (``run_layout``) names its zero-bubble schedule."""
    for schedule, named in (("ZBVZeroBubble", "ZBVZeroBubble"), ("Interleaved1F1B", None)):
        config = compose_run(
            [
                "model=gpt_tiny",
                "model.config.n_layer=8",
                "train.grad_accum=8",
                "parallel=pp_dp",
                f"parallel.plan.schedule={schedule}",
                "parallel.plan.virtual_stages=2",
            ]
        )
        assert planned_layout(config, world_size=4).schedule == named


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_the_hand_offs_name_the_schedule(name):
    layout = dataclasses.replace(INTERLEAVED, schedule=name)
    assert "torch's " + name in MEGATRON.refusal(layout)
    overrides = train_overrides(
        dataclasses.replace(layout, pp=2, dp=2, num_micro_batches=4),
        topology="dgx-h100x2",
        nodes=1,
        ranks_per_node=4,
        model="gpt_tiny",
        framework=OVERLAPKIT_TRAIN,
    )
    assert f"parallel.plan.schedule={name}" in overrides
    assert "parallel.plan.virtual_stages=2" in overrides
    args = torchtitan_run(layout, load_model("llama3-8b"), seq_len=8192, global_batch=32).args
    assert args[args.index("--parallelism.pipeline_parallel_schedule") + 1] == name
