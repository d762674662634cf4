"""Pipeline parallelism in the training loop: the stage split and its checks, and every layout on
4 gloo ranks against one process training the unsplit model on the same batches."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.tensor import DTensor

import overlapkit as ok
from overlapkit.profiling import analyze_run
from overlapkit.profiling.report import format_report
from overlapkit.train.models import GPT, GPTConfig, MLPConfig
from overlapkit.train.parallel.mesh import (
    PlanConfig,
    build_layout,
    data_shard,
    split_parallel,
)
from overlapkit.train.parallel.pipeline_parallel import apply_pipeline
from overlapkit.train.parallel.pipeline_stages import (
    bubble_share,
    local_stages,
    pipeline_record,
    split_stage,
    stage_blocks,
    stage_layers,
)
from overlapkit.train.parallel.recompute import apply_recompute
from overlapkit.train.parallel.run_layout import check_parallel
from overlapkit.train.run.checkpoint import TrainingState, step_dir
from overlapkit.train.run.data import BatchStream, SyntheticRegression
from overlapkit.train.run.loop import TrainConfig
from overlapkit.train.run.lr_schedule import warmup_cosine
from overlapkit.train.run.progress import RunSummary
from tests.cuda import requires_cuda
from tests.multiproc import run_on_ranks

CONFIG = dict(n_layer=4, n_head=2, n_embd=16, block_size=8)
V_CONFIG = CONFIG | {"n_layer": 8}
"""pp4 x v2: eight stages of one block."""
BATCH = 2  # sequences per micro-batch
MICRO = 4  # micro-batches per step (train.grad_accum)
STEPS = 2
MAX_NORM = 0.05  # small enough that every step clips
LR = 1e-2


DDP = {"_target_": "overlapkit.ddp"}


def _check(world_size: int = 4, grad_accum: int = MICRO, model=None, factory=DDP, **plan) -> None:
    config = PlanConfig.of(**plan)
    model = model if model is not None else GPTConfig(**CONFIG)
    train = TrainConfig(batch_size=BATCH, grad_accum=grad_accum)
    check_parallel(config, factory, train, world_size=world_size, model_config=model, seq_len=8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(pp=2, model=GPTConfig(**CONFIG | {"n_layer": 3})),
            r"2 x 1 = 2 stages must divide"
            r" model.config.n_layer \(3\) for parallel.plan.schedule=1F1B",
        ),
        (
            dict(pp=2, schedule="Interleaved1F1B", virtual_stages=4),
            r"2 x 4 = 8 stages must divide model.config.n_layer \(4\)",
        ),
        (
            dict(pp=2, grad_accum=1),
            r"train.grad_accum=1 micro-batches per step is fewer than the "
            r"2 stages parallel.plan.schedule=1F1B keeps in flight; set train.grad_accum >= 2",
        ),
        (
            dict(pp=2, schedule="interleaved1f1b", virtual_stages=2, grad_accum=3),
            r"train.grad_accum=3 micro-batches per step are not a multiple of parallel.plan.pp=2",
        ),
        (
            dict(pp=2, schedule="ZBVZeroBubble", virtual_stages=4, model=GPTConfig(**V_CONFIG)),
            r"schedule=ZBVZeroBubble places exactly 2 stages per rank in a V, got "
            r"parallel.plan.virtual_stages=4; set it to 2",
        ),
        (
            dict(pp=2, schedule="DualPipeV", virtual_stages=1),
            r"schedule=DualPipeV places exactly 2 stages per rank",
        ),
        (
            dict(pp=2, schedule="DualPipeV", virtual_stages=2, grad_accum=3),
            r"train.grad_accum=3 micro-batches per step is fewer than the 2 x 2 stages "
            r"parallel.plan.schedule=DualPipeV runs \(one each\); set train.grad_accum >= 4",
        ),
        (
            dict(pp=2, schedule="InterleavedZeroBubble", virtual_stages=2, grad_accum=5),
            r"train.grad_accum=5 micro-batches per step are not a multiple of the 2 rounds "
            r"\(max\(1, grad_accum // parallel.plan.pp\)\) "
            r"parallel.plan.schedule=InterleavedZeroBubble",
        ),
        (
            dict(pp=4, schedule="ZBVZeroBubble", virtual_stages=2),
            r"4 x 2 = 8 stages must divide model.config.n_layer \(4\)",
        ),
        (
            dict(
                pp=2,
                schedule="InterleavedZeroBubble",
                virtual_stages=2,
                factory={"_target_": "overlapkit.ddp", "find_unused_parameters": True},
            ),
            r"parallel.find_unused_parameters=true with "
            r"parallel.plan.schedule=InterleavedZeroBubble",
        ),
        (dict(pp=2, schedule="2F2B"), r"schedule='2F2B' is not a torch.distributed.pipelining"),
        (dict(virtual_stages=2), r"virtual_stages=2 needs pipeline parallelism"),
        (dict(pp=2, virtual_stages=2), r"schedule=1F1B runs one stage per rank"),
        (dict(pp=3), r"tp x parallel.plan.ep x parallel.plan.pp = 1 x 1 x 3 = 3 does not divide"),
        (dict(pp=2, model=MLPConfig()), r"pp=2 splits a GPT into stages .*MLPConfig"),
        (dict(pp=2, cp=2), r"pp=2 with parallel.plan.cp=2: the pipeline's stages pass whole"),
        (
            dict(pp=2, factory={"_target_": "overlapkit.fsdp", "zero": 2}),
            r"parallel.zero=2 \(ZeRO-2\) with parallel.plan.pp=2: .* use parallel=zero1",
        ),
        (
            dict(pp=2, factory={"_target_": "torch.nn.Identity"}),
            r"pp=2 needs parallel._target_ .* got torch.nn.Identity",
        ),
        (
            dict(pp=2, factory={"_target_": "overlapkit.GradBucketer", "optimizer": "optim"}),
            r"parallel.optimizer=optim .* with parallel.plan.pp=2: a clipped update needs every "
            r"stage's gradient norm",
        ),
        (
            dict(pp=2, factory={"_target_": "overlapkit.fsdp", "optimizer_step": "by_block"}),
            r"parallel.optimizer_step=by_block",
        ),
    ],
)
def test_bad_pipeline_layouts_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _check(**kwargs)


def test_good_pipeline_layouts_pass_the_checks():
    _check(pp=2)
    _check(pp=4)
    _check(pp=2, schedule="GPipe", grad_accum=1)  # GPipe takes any number of micro-batches
    _check(pp=2, schedule="Interleaved1F1B", virtual_stages=2, grad_accum=4)
    _check(pp=2, dp_shard=2, factory={"_target_": "overlapkit.fsdp"})
    _check(pp=2, tp=2, factory={"_target_": "overlapkit.GradBucketer"})
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        for target in ("overlapkit.ddp", "overlapkit.GradBucketer", "overlapkit.fsdp"):
            _check(pp=2, schedule=schedule, virtual_stages=2, factory={"_target_": target})
    _check(pp=2, schedule="InterleavedZeroBubble", virtual_stages=2, grad_accum=3)  # 1 round
    _check(pp=4, schedule="DualPipeV", virtual_stages=2, grad_accum=8, model=GPTConfig(**V_CONFIG))
    plan, _ = split_parallel({"_target_": "overlapkit.ddp", "plan": {"pp": 2}})
    sizes = plan.sizes
    assert (sizes.pp, plan.schedule, sizes.virtual_stages, plan.trivial) == (2, "1F1B", 1, False)
    assert sizes.placement_sizes()["pp"] == 2 and "schedule" not in sizes.placement_sizes()


def test_pipeline_ranks_hold_looped_stages_of_consecutive_blocks():
    assert [local_stages(r, 2, 2) for r in range(2)] == [(0, 2), (1, 3)]
    # V schedules: as torch's generate_stage_to_rank_mapping(style="v") places them.
    for pp in (2, 4):
        v = generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
        assert [local_stages(r, pp, 2, v_shape=True) for r in range(pp)] == [
            tuple(sorted(s for s, rank in v.items() if rank == r)) for r in range(pp)
        ]
    assert [stage_layers(8, 4, s) for s in range(4)] == [range(2 * s, 2 * s + 2) for s in range(4)]
    # The stages of one pipeline read one batch shard; dp replicas read their own.
    pp_dp = ok.plan(ok.load_topology("cpu-gloox2"), pp=2)
    assert [data_shard(pp_dp, r) for r in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert pp_dp.groups("pp") == ((0, 2), (1, 3))


def test_stages_share_the_models_modules_under_the_unsplit_names():
    model = GPT(GPTConfig(**CONFIG))
    first = split_stage(model, range(0, 2), first=True, last=False)
    last = split_stage(model, range(2, 4), first=False, last=True)
    # Together the stages hold every tensor under its unsplit name, each name once.
    assert first.state_dict().keys() | last.state_dict().keys() == model.state_dict().keys()
    assert not first.state_dict().keys() & last.state_dict().keys()
    assert [n for n, _ in first.named_children()] == ["wte", "wpe", "blocks"]
    assert first.blocks[1] is model.blocks[1] and isinstance(first.blocks[2], torch.nn.Identity)
    inputs, _ = _batch(0, 0, 0)
    with torch.no_grad():
        torch.testing.assert_close(last(first(inputs)), model(inputs), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"splits a GPT .*Sequential has 0, 1"):
        split_stage(
            torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), [0], first=True, last=True
        )


def _batch(shard: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    seed = 1000 * shard + 10 * step + micro
    tokens = torch.randint(0, 256, (BATCH, 9), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _reference(
    shards: int,
    device: torch.device,
    config: dict = CONFIG,
    micro_batches: int = MICRO,
    shared: bool = False,
) -> tuple[dict, list[float], list[list[float]]]:
    """One process, the unsplit model: each step the mean loss over every shard's micro-batches.

    Returns the parameters and AdamW's state after the steps (``name``, ``name.exp_avg``,
    ``name.exp_avg_sq``), each step's norm, and each shard's loss per step.
    """
    torch.manual_seed(0)
    model = GPT(GPTConfig(**config)).to(device)
    if shared:
        _share_inside_a_stage(model)
    optimizer = _optimizer(model.parameters())
    norms, losses = [], [[0.0] * STEPS for _ in range(shards)]
    for step in range(STEPS):
        optimizer.zero_grad()
        for shard in range(shards):
            for micro in range(micro_batches):
                inputs, targets = (t.to(device) for t in _batch(shard, step, micro))
                loss = GPT.loss(model(inputs), targets) / micro_batches
                (loss / shards).backward()
                losses[shard][step] += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
    return _with_state(model, optimizer), norms, losses


def _with_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``model``'s parameters and their AdamW moments by name, whole (DTensors gathered)."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = _full(param.detach()).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = _full(optimizer.state[param][key]).clone()
    return out


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class Case(NamedTuple):
    plan: PlanConfig
    factory: Callable
    recompute: tuple[str, int] | None = None
    """``(mode, layers)`` applied to each stage's blocks, as the loop applies it."""
    config: dict = CONFIG
    micro_batches: int = MICRO
    shared: bool = False
    """Block 1's ``attn.proj`` shares ``attn.q``'s weight (``_share_inside_a_stage``)."""


def _share_inside_a_stage(model: GPT) -> None:
    """One weight used twice inside block 1, the second use downstream of the first: a split
    backward must not count the gradient that reaches the first use through the second twice
    (torch clamps the saved gradients, PR #181365)."""
    attn = model.blocks[1].attn
    attn.proj.weight = attn.q.weight


CASES = {
    "1F1B ok.ddp": (PlanConfig.of(pp=2), ok.ddp),
    "1F1B ok.GradBucketer": (
        PlanConfig.of(pp=2),
        functools.partial(ok.GradBucketer, bucket_mb=0.01),
    ),
    "1F1B ok.fsdp": (PlanConfig.of(pp=2), ok.fsdp),
    "1F1B HSDP": (PlanConfig.of(pp=2, dp_shard=2), ok.fsdp),
    "Interleaved1F1B v=2 ok.ddp": (
        PlanConfig.of(pp=2, schedule="Interleaved1F1B", virtual_stages=2),
        ok.ddp,
    ),
    "GPipe tp=2 ok.GradBucketer": (PlanConfig.of(pp=2, tp=2, schedule="GPipe"), ok.GradBucketer),
    "Interleaved1F1B v=2 ok.GradBucketer": (
        PlanConfig.of(pp=2, schedule="Interleaved1F1B", virtual_stages=2),
        ok.GradBucketer,
    ),
    "LoopedBFS v=2 ok.fsdp": (PlanConfig.of(pp=2, schedule="LoopedBFS", virtual_stages=2), ok.fsdp),
    "1F1B pp=4": (PlanConfig.of(pp=4), ok.ddp),
    "1F1B ZeRO-1 recompute=full:1": (
        PlanConfig.of(pp=2),
        functools.partial(ok.fsdp, zero=1, reshard_after_forward=None),
        ("full", 1),  # each stage's first block
    ),
}
WRAPPERS = {
    "ok.ddp": functools.partial(ok.ddp, bucket_mb=0.01),  # several buckets per stage
    "ok.GradBucketer": functools.partial(ok.GradBucketer, bucket_mb=0.01),
    "ok.fsdp": ok.fsdp,
}
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
CASES |= {
    f"{schedule} v=2 {wrapper}": Case(
        PlanConfig.of(pp=2, schedule=schedule, virtual_stages=2), factory, shared=True
    )
    for schedule in ZERO_BUBBLE
    for wrapper, factory in WRAPPERS.items()
}
"""Every zero-bubble schedule with every wrapper, pp2 x dp2: the weight steps' gradients reduced
over dp (the tied embedding summed locally under the V schedules), with a weight shared inside
the split stage 1."""
CASES |= {
    f"{schedule} pp=4 v=2 n_layer=8": Case(
        PlanConfig.of(pp=4, schedule=schedule, virtual_stages=2),
        WRAPPERS["ok.ddp"],
        config=V_CONFIG,
        micro_batches=8,  # DualPipeV: one per stage
    )
    for schedule in ("ZBVZeroBubble", "DualPipeV")
}
PROFILED = "1F1B ok.ddp"
"""Its second step is traced: the report's send/recv."""


def _train_case(rank: int, world_size: int, topology, case, device: torch.device, profiler) -> dict:
    """Two clipped AdamW steps of one layout; the parameters' gaps to one process and more."""
    plan, factory, recompute, config, micro, shared = Case(*case)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**config)).to(device)
    if shared:
        _share_inside_a_stage(model)
    for blocks in stage_blocks(model.blocks, plan) if recompute else ():
        assert apply_recompute(blocks, *recompute) == [0]
    layout = build_layout(plan, topology, device)
    par = apply_pipeline(
        model, factory, layout, loss_fn=GPT.loss, micro_batches=micro, device=device
    )
    optimizer = _optimizer(par.model.parameters())
    weight_steps = _time_weight_steps(par) if plan.schedule in ZERO_BUBBLE else {}
    shard, shards = layout.data_shard(rank, world_size)
    losses, norms = [], []
    with profiler or contextlib.nullcontext():
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=par.zero_grad_to_none)
            batches = [tuple(t.to(device) for t in _batch(shard, step, m)) for m in range(micro)]
            losses.append(par.forward_backward(batches).item())
            par.finish_backward()
            norms.append(par.optimizer_step(optimizer, MAX_NORM).item())
            if profiler is not None:
                profiler.step()
    expected, expected_norms, expected_losses = _reference(shards, device, config, micro, shared)
    gaps = {}
    for name, tensor in _with_state(par.model, optimizer).items():
        reference = expected[name.replace("lm_head.weight", "wte.weight")]
        gaps[name] = (tensor - reference).abs().max().item()
    dist.barrier()
    return {
        "gaps": gaps,
        "norms": norms,
        "expected_norms": expected_norms,
        "losses": losses,
        "expected_losses": expected_losses[shard],
        "description": par.description,
        "shards": shards,
        "reductions": _reductions(par, weight_steps),
    }


def _time_weight_steps(par) -> dict[int, list[tuple[float, float]]]:
    """Each stage's steps that add to its weight gradients as they run: ``(start, end)`` in
    ``perf_counter`` ms, the clock of ``ok.comm_stats``'s launches. The weight steps (W; stage
    0 runs its whole backward there) and the full backwards (B: DualPipeV runs some)."""
    windows: dict[int, list[tuple[float, float]]] = {}
    for stage in par.forward_backward.__self__.stages:
        into = windows[stage.stage_index] = []
        weight, backward = stage.backward_weight_one_chunk, stage.backward_one_chunk

        def timed(run, *args, into=into, **kwargs):
            start = time.perf_counter() * 1e3
            run(*args, **kwargs)
            if kwargs.get("full_backward", True):
                into.append((start, time.perf_counter() * 1e3))

        stage.backward_weight_one_chunk = functools.partial(timed, weight)
        stage.backward_one_chunk = functools.partial(timed, backward)
    return windows


def _reductions(par, weight_steps: dict) -> dict[int, dict]:
    """Per stage under ``ok.ddp`` / ``ok.GradBucketer``: its last weight step (or full backward)
    of the last step and the launch times of that step's all-reduces (``ok.comm_stats``)."""
    out = {}
    for stage in par.forward_backward.__self__.stages if weight_steps else ():
        owner = stage.bucketer if stage.bucketer is not None else stage.submod
        if not isinstance(owner, ok.GradBucketer | torch.nn.parallel.DistributedDataParallel):
            continue
        records = ok.comm_stats(owner).records
        last = max(r.step for r in records)
        out[stage.stage_index] = {
            "weight_step": weight_steps[stage.stage_index][-1],
            "launches": sorted(r.launch_ms for r in records if r.step == last),
        }
    return out


def _layouts_match_one_process(rank: int, world_size: int, profile_dir: str) -> dict:
    topology = ok.load_topology("cpu-gloox2")
    out = {}
    for name, case in CASES.items():
        profiler = None
        if name == PROFILED:
            profiler = ok.profile(profile_dir, wait=0, warmup=1, active=1, record_shapes=True)
        out[name] = _train_case(rank, world_size, topology, case, torch.device("cpu"), profiler)
    return out


def _assert_matches_one_process(results: list[dict], cases, tolerance) -> None:
    for name in cases:
        gap = max(max(result[name]["gaps"].values()) for result in results)
        print(f"{name}: max |parameter - one process| after {STEPS} steps {gap:.2e}")
        assert gap < tolerance(name), name
        for result in results:
            case = result[name]
            assert case["norms"] == pytest.approx(case["expected_norms"], rel=1e-5), name
            assert case["norms"][0] > MAX_NORM  # clipping was active
            # The last stage's loss reached every rank of its pipeline (rank 0: a first stage).
            assert case["losses"] == pytest.approx(case["expected_losses"], rel=1e-5), name


@pytest.mark.slow
@pytest.mark.timeout(600)  # the first test to use one_process_layouts runs it
def test_every_pipeline_layout_trains_as_one_process_on_4_ranks(one_process_layouts):
    parts, profile_dir = one_process_layouts
    results = parts["pipeline"]
    names = {n for result in results for n in result[next(iter(CASES))]["gaps"]}
    # Every parameter, on some rank.
    moments = ("", ".exp_avg", ".exp_avg_sq")  # the parameters and AdamW's state of each
    every = {n + m for n in GPT(GPTConfig(**CONFIG)).state_dict() for m in moments}
    assert names == every  # the head's copy included
    # Measured: <= 1.0e-6; with tp 2.6e-5 (its row-parallel partial sums add in another order,
    # and AdamW's first steps turn a gradient's relative error into lr x that error).
    _assert_matches_one_process(results, CASES, lambda name: 1e-4 if "tp=" in name else 1e-5)
    # The report shows the stages' point-to-point traffic as its own kind: each stage sends and
    # receives one activation (or its gradient) per micro-batch, (BATCH, 8, n_embd) floats.
    report = analyze_run(profile_dir)
    assert sorted((r.rank, r.step) for r in report.steps) == [(r, 1) for r in range(4)]  # 2nd
    for row in report.steps:
        send_recv = row.kinds["send_recv"]
        assert (send_recv.count, send_recv.nbytes) == (2 * MICRO, 2 * MICRO * BATCH * 8 * 16 * 4)
        assert 0 < send_recv.exposed_ms <= send_recv.time_ms
    assert re.search(r"send_recv 8x 0.01 MiB \(\d+\.\d\d ms exposed\)", format_report(report))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero_bubble_stages_reduce_from_their_last_weight_step(one_process_layouts):
    results = one_process_layouts[0]["pipeline"]
    observed = [n for n in CASES if n.startswith(ZERO_BUBBLE) and "ok.fsdp" not in n]
    assert len(observed) == 8
    for name in observed:
        for result in results:
            reductions = result[name]["reductions"]
            assert len(reductions) == 2, name  # both stages of the rank
            for stage, seen in reductions.items():
                start, end = seen["weight_step"]
                launches = seen["launches"]
                # Several buckets, every one launched while the stage's last weight step (or,
                # under DualPipeV, full backward) runs, as its buckets complete: torch's own
                # weight step writes .grad by hand, so none would be and DDP's average would be
                # missing. The result is the equality with one process above.
                assert len(launches) >= 2, (name, stage)
                assert all(start < t < end for t in launches), (name, stage, seen)


def test_summary_shows_the_planned_bubble_and_the_measured_send_recv():
    assert bubble_share(2, 1, 4) == pytest.approx(1 / 5)  # (p - 1) / (v m + p - 1)
    assert bubble_share(2, 2, 4) == pytest.approx(1 / 9)
    # A split backward at F = I = W (each 1 per micro-batch, 1/2 per chunk): ZB-V idles
    # (p - 1) F per chunk (Qi et al., section 6), 1/2 beside the step's 4 x 3 of compute.
    zbv = PlanConfig.of(pp=2, schedule="ZBVZeroBubble", virtual_stages=2)
    record = pipeline_record(zbv, 4)
    assert record["planned_bubble_share"] == pytest.approx(0.5 / (0.5 + 12))
    assert record["planned_bubble_basis"] == "torch's ZBVZeroBubble at F = I = W"
    assert pipeline_record(zbv, 2)["planned_bubble_share"] is None  # torch pads below 2p - 1
    unpriced = RunSummary(
        name="x",
        world_size=4,
        nodes=1,
        parallel="pipeline",
        unit="tok",
        start_step=0,
        final_step=1,
        steps_run=1,
        seconds=1.0,
        steps_per_s=1.0,
        items_per_s=1.0,
        median_step_ms=1.0,
        loss_first=5.0,
        loss_last=4.0,
        pipeline=pipeline_record(zbv, 2),
    )
    assert (
        "pipeline ZBVZeroBubble: 4 stages, 2 micro-batches; planned bubble torch's ZBVZeroBubble "
        "at F = I = W = not priced"
    ) in unpriced.format()
    summary = RunSummary(
        name="x",
        world_size=4,
        nodes=1,
        parallel="pipeline",
        unit="tok",
        start_step=0,
        final_step=5,
        steps_run=5,
        seconds=1.0,
        steps_per_s=5.0,
        items_per_s=3000.0,
        median_step_ms=200.0,
        loss_first=5.0,
        loss_last=4.0,
        pipeline={
            "schedule": "1F1B",
            "pp": 2,
            "virtual_stages": 1,
            "micro_batches": 4,
            "planned_bubble_share": 0.2,
            "send_recv_exposed_share": 0.27,
        },
    )
    assert (
        "pipeline 1F1B: 2 stages, 4 micro-batches; planned bubble (p-1)/(v m + p-1) = 20.0% of "
        "the step; measured: send/recv exposed 27.0% of step time (bubble + transfers)"
    ) in summary.format()


NCCL_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}
CUDA_CASES = {
    "1F1B ok.ddp": CASES["1F1B ok.ddp"],
    "Interleaved1F1B v=2 ok.fsdp": (
        PlanConfig.of(pp=2, schedule="Interleaved1F1B", virtual_stages=2),
        ok.fsdp,
    ),
}


def _nccl_layouts_match_one_process(rank: int, world_size: int, profile_dir: str) -> dict:
    if torch.cuda.device_count() >= world_size:
        device = torch.device("cuda", rank)
    else:  # one GPU: NCCL joins the two ranks through its socket transport, as two "hosts"
        os.environ["NCCL_HOSTID"] = f"host{rank}"
        device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    topology = ok.load_topology("cpu-gloo")  # 2 ranks; the mesh is built on `device`
    out = {}
    for name, case in CUDA_CASES.items():
        profiler = None
        if name == PROFILED:
            profiler = ok.profile(profile_dir, wait=0, warmup=1, active=1, record_shapes=True)
        out[name] = _train_case(rank, world_size, topology, case, device, profiler)
    return out


@requires_cuda
@pytest.mark.timeout(600)
def test_pipeline_over_nccl_trains_as_one_process_and_reports_its_send_recv(tmp_path):
    results = run_on_ranks(
        _nccl_layouts_match_one_process,
        2,
        str(tmp_path),
        collective_timeout_s=120,
        total_timeout_s=560,
        env=NCCL_ENV,
        backend="nccl",
    )
    # CUDA kernels may sum in another order than the CPU's; same tolerance as tp on gloo.
    _assert_matches_one_process(results, CUDA_CASES, lambda name: 1e-4)
    # NCCL's SendRecv kernels of single sends and receives, named by their metadata (1F1B fuses
    # some into batch_isend_irecv, whose metadata name is not checked here).
    for row in analyze_run(tmp_path).steps:
        assert row.kinds["send_recv"].count >= 1, row.kinds


def _training_state(flatten: bool) -> TrainingState:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    scheduler = warmup_cosine(optimizer, total_steps=3, warmup_steps=0)
    stream = BatchStream(SyntheticRegression(width=4), rank=0, batch_size=1)
    return TrainingState(model, optimizer, scheduler, stream, rank=0, flatten_optimizer=flatten)


@pytest.mark.parametrize("saved_flat", [True, False])
def test_a_checkpoint_resumes_into_a_run_of_its_optimizer_form_only(tmp_path, saved_flat):
    path = step_dir(tmp_path, 1)
    torch.distributed.checkpoint.save(_training_state(saved_flat).state_dict(1), checkpoint_id=path)
    assert _training_state(saved_flat).load(path) == 1
    pipelined = "a pipeline-parallel run's" if saved_flat else "a run without pipeline"
    with pytest.raises(ValueError, match=rf"saved per parameter .*\({pipelined}.*start a new run"):
        _training_state(not saved_flat).load(path)
