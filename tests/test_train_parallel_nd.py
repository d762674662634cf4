"""Planned n-D layouts of the training loop: ``parallel.plan`` checks, batch shards, and tp_dp,
hsdp and ep_dp gradients on 4 gloo ranks against one process running the unsharded model."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import overlapkit as ok
from overlapkit.group.process_group import group_timeout
from overlapkit.train.models import GPT, GPTConfig, MLPConfig, MoEConfig, MoEGPT
from overlapkit.train.parallel.mesh import (
    PlanConfig,
    build_layout,
    data_shard,
    split_parallel,
)
from overlapkit.train.parallel.run_layout import check_parallel
from overlapkit.train.parallel.wrappers import apply_parallel, clip_grad_norm
from overlapkit.train.run.loop import TrainConfig
from overlapkit.train.run.progress import RunSummary, scaling_efficiency
from tests.one_process_layouts import COLLECTIVE_TIMEOUT_S

GPT_SMALL = dict(n_layer=2, n_head=2, n_embd=16, block_size=8)
MOE_SMALL = dict(GPT_SMALL, n_expert=4, top_k=2)
BUCKETER = "overlapkit.GradBucketer"


@pytest.mark.parametrize(
    ("plan", "model", "target", "message"),
    [
        (dict(tp=3), GPTConfig(), BUCKETER, r"tp x parallel.plan.ep = 3 x 1 = 3 does not divide "),
        (
            dict(tp=2, dp=3),
            GPTConfig(),
            BUCKETER,
            r"x parallel.plan.dp \(3\) = 6, but the world size is 4",
        ),
        (dict(dp_shard=3), GPTConfig(), "overlapkit.fsdp", r"dp_shard \(3\) must divide .* 4"),
        (dict(tp=4), GPTConfig(n_head=2, n_embd=8), BUCKETER, r"tp \(4\) must divide .*n_head"),
        (dict(tp=2), MLPConfig(), BUCKETER, r"tp=2 needs a transformer"),
        (dict(ep=4), MoEConfig(n_expert=6), BUCKETER, r"ep \(4\) must divide .*n_expert \(6\)"),
        (dict(ep=2), GPTConfig(), BUCKETER, r"ep=2 needs a mixture-of-experts model"),
        (dict(ep=2, tp=2), MoEConfig(), BUCKETER, r"tp \(2\) with parallel.plan.ep \(2\)"),
        (dict(tp=2), GPTConfig(), "overlapkit.ddp", r"tp=2 needs parallel._target_ .*GradB"),
        (dict(ep=2), MoEConfig(), "overlapkit.fsdp", r"ep=2 needs parallel._target_"),
        (dict(dp_shard=2), GPTConfig(), BUCKETER, r"dp_shard=2 needs .*overlapkit.fsdp"),
    ],
)
def test_bad_plans_are_refused_naming_the_config_key(plan, model, target, message):
    with pytest.raises(ValueError, match=message):
        check_parallel(
            PlanConfig.of(**plan),
            {"_target_": target},
            TrainConfig(),
            world_size=4,
            model_config=model,
            seq_len=64,
        )


def test_plan_section_is_split_from_the_factory_and_checked():
    plan, factory = split_parallel({"_target_": BUCKETER, "bucket_mb": 1, "plan": {"tp": 2}})
    assert (plan.sizes.tp, plan.sizes.ep, plan.sizes.dp, plan.sizes.dp_shard) == (2, 1, None, None)
    assert factory == {"_target_": BUCKETER, "bucket_mb": 1}
    assert split_parallel({"_target_": BUCKETER})[0].trivial
    with pytest.raises(ValueError, match=r"parallel.plan.sp is not a planner size"):
        split_parallel({"plan": {"sp": 2}})
    assert split_parallel({"plan": {"pp": 2}})[0].sizes.pp == 2
    assert split_parallel({"plan": {"cp": 2}})[0].sizes.cp == 2
    with pytest.raises(ValueError, match=r"parallel.plan.tp must be >= 1, got 0"):
        PlanConfig.of(tp=0)


def test_ranks_of_one_tp_group_read_the_same_batch_shard():
    topology = ok.load_topology("cpu-gloox2")  # 2 nodes x 2 ranks
    tp = ok.plan(topology, tp=2)
    assert [data_shard(tp, r) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    ep = ok.plan(topology, ep=2)  # ep ranks are data parallel for the dense parameters
    assert sorted(data_shard(ep, r) for r in range(4)) == [(i, 4) for i in range(4)]
    hsdp = ok.plan(topology, dp_shard=2)
    assert sorted(data_shard(hsdp, r) for r in range(4)) == [(i, 4) for i in range(4)]


def test_scaling_efficiency_is_throughput_over_n_times_the_one_rank_baseline():
    assert scaling_efficiency(3000.0, 4, 1000.0) == pytest.approx(0.75)
    assert scaling_efficiency(2000.0, 2, 1000.0) == 1.0
    assert scaling_efficiency(None, 4, 1000.0) is None
    assert scaling_efficiency(3000.0, 4, None) is None
    with pytest.raises(ValueError, match="a baseline > 0"):
        scaling_efficiency(3000.0, 4, 0.0)
    summary = RunSummary(
        name="x",
        world_size=4,
        nodes=1,
        parallel="ok.ddp",
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
        baseline_items_per_s=1000.0,
        scaling_efficiency=0.75,
    )
    assert "scaling efficiency 75.0% = 3,000 / (4 x 1,000) tok/s" in summary.format()


def _batch(shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(10 + shard))
    return tokens[:, :-1], tokens[:, 1:]


def _full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if isinstance(grad, torch.distributed.tensor.DTensor) else grad


def _layouts_match_the_unsharded_model(rank: int, world_size: int) -> dict:
    topology = ok.load_topology("cpu-gloox2")
    cases = {
        "tp_dp": (GPT, GPTConfig, PlanConfig.of(tp=2), functools.partial(ok.GradBucketer)),
        "hsdp": (GPT, GPTConfig, PlanConfig.of(dp_shard=2), functools.partial(ok.fsdp)),
        "ep_dp": (MoEGPT, MoEConfig, PlanConfig.of(ep=2), functools.partial(ok.GradBucketer)),
        # Chunked dispatch (tests/test_chunked_ep.py checks every chunk count on 2 ranks).
        "ep_dp_chunked": (
            MoEGPT,
            MoEConfig,
            PlanConfig.of(ep=2, ep_chunks=2),
            functools.partial(ok.GradBucketer),
        ),
    }
    out = {}
    for name, (cls, config_cls, plan, factory) in cases.items():
        config = config_cls(**(MOE_SMALL if cls is MoEGPT else GPT_SMALL))
        torch.manual_seed(0)
        reference = cls(config)
        torch.manual_seed(0)
        model = cls(config)
        layout = build_layout(plan, topology, torch.device("cpu"))
        par = apply_parallel(model, factory, layout)
        shard, shards = layout.data_shard(rank, world_size)
        inputs, targets = _batch(shard)
        GPT.loss(par.model(inputs), targets).backward()
        par.finish_backward()

        # One process: the mean loss over every batch shard (what the replicas average).
        loss = sum(GPT.loss(reference(_batch(s)[0]), _batch(s)[1]) for s in range(shards))
        (loss / shards).backward()
        reference_params = dict(reference.named_parameters())
        for param_name, param in par.model.named_parameters():
            torch.testing.assert_close(
                _full(param.grad),
                reference_params[param_name].grad,
                rtol=1e-4,
                atol=1e-6,
                msg=lambda m, n=param_name, c=name: f"{c} {n}: {m}",
            )
        norm = clip_grad_norm(par.model.parameters(), max_norm=1e-3)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1e-3)
        for param_name, param in par.model.named_parameters():  # clipped alike
            torch.testing.assert_close(
                _full(param.grad), reference_params[param_name].grad, rtol=1e-4, atol=1e-7
            )
        if name.startswith("ep_dp"):  # and one AdamW step on the clipped gradients
            for params in (par.model.parameters(), reference.parameters()):
                torch.optim.AdamW(params, lr=1e-2).step()
            for param_name, param in par.model.named_parameters():
                torch.testing.assert_close(
                    _full(param.detach()),
                    reference_params[param_name].detach(),
                    rtol=1e-5,
                    atol=1e-5,
                    msg=lambda m, n=param_name, c=name: f"{c} {n} after AdamW: {m}",
                )
        kinds = {type(p).__name__ for p in par.model.parameters()}
        groups = [layout.mesh.get_group(axis) for axis in layout.mesh.mesh_dim_names]
        out[name] = {
            "timeouts": {group_timeout(g).total_seconds() for g in groups},
            "shards": shards,
            "norm": (norm, ref_norm.item()),
            "kinds": sorted(kinds),
            "description": par.description,
        }
        if name.startswith("ep_dp"):
            own_group = next(g for g in layout.placement.groups("ep") if rank in g)
            out[name]["dispatch"] = [
                (m.stats.ranks, m.stats.all_to_all_calls) for m in model.moe_layers()
            ]
            out[name]["own_ep_group"] = own_group
        dist.barrier()
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)  # the first test to use one_process_layouts runs it
def test_tp_hsdp_and_ep_gradients_equal_the_unsharded_model_on_4_ranks(one_process_layouts):
    results = one_process_layouts[0]["nd"]
    for result in results:
        assert result["tp_dp"]["shards"] == 2 and result["hsdp"]["shards"] == 4
        assert result["ep_dp"]["shards"] == 4
        for case in result.values():
            norm, ref_norm = case["norm"]
            assert norm == pytest.approx(ref_norm, rel=1e-5)
        # Mixed plain and DTensor parameters are what clip_grad_norm must handle.
        assert result["tp_dp"]["kinds"] == ["DTensor", "Parameter"]
        assert result["ep_dp"]["kinds"] == ["DTensor", "Parameter"]
        # Every mesh group has the default group's timeout (the harness's), not 30 min.
        timeouts = {t for case in result.values() for t in case["timeouts"]}
        assert timeouts == {COLLECTIVE_TIMEOUT_S}
        ep = result["ep_dp"]
        # Each MoE layer dispatched over the planner's ep group: forward and backward,
        # two all-to-alls each.
        assert ep["dispatch"] == [(ep["own_ep_group"], 4)] * 2
        chunked = result["ep_dp_chunked"]
        assert chunked["dispatch"] == [(chunked["own_ep_group"], 8)] * 2


# End to end: the real ``overlapkit-train`` on 4 gloo ranks (helpers of test_train_e2e), with
# the settings of its 2-rank recipe sweep, whose ddp job is tp_dp's reference.
FOUR = [
    "launcher.nproc_per_node=4",
    "train.steps=8",
    "train.grad_accum=2",
    "train.checkpoint_every=0",
]
FOUR_RANK_LAYOUTS = ["ddp", "hsdp", "tp_dp", "cp_dp"]
SLOWED, SLOW_RANK, SLOW_MS = "ddp", 2, 150.0
"""The job whose rank sleeps in every step's forward, for tests/test_stragglers_real.py."""


def run_four_rank_sweep(directory: Path) -> tuple[dict[str, Path], str]:
    """``overlapkit-train -m`` over ``FOUR_RANK_LAYOUTS`` on 4 ranks in ``directory``, profiled,
    with rank ``SLOW_RANK`` of the ``SLOWED`` job sleeping ``SLOW_MS`` ms in every step (a sleep
    and the profiler change no number); each layout's run directory and the output."""
    from bench.harness.slow_rank import SLOW_ENV
    from tests.faults import FAULTS_IN_ENV, WORKER_INIT
    from tests.test_train_e2e import _finish, _start

    sweep = directory / "sweep"
    runs = {p: sweep / str(i) for i, p in enumerate(FOUR_RANK_LAYOUTS)}
    args = [
        "-m",
        f"parallel={','.join(FOUR_RANK_LAYOUTS)}",
        *FOUR,
        "train.baseline_items_per_s=1000",
        # Full recomputation under every layout (FSDP2's unshard, tensor-parallel hooks, the
        # cp all-gather rerun in backward); its gradients are bitwise those without it, so the
        # trajectories are still those of the recipe sweep, which does not recompute.
        "train.recompute=full",
        "profiler=on",
        f"launcher.worker_init=[{WORKER_INIT}]",
        f"hydra.sweep.dir={sweep}",
    ]
    env = {SLOW_ENV: f"{SLOW_RANK}:{SLOW_MS:g}", FAULTS_IN_ENV: str(runs[SLOWED])}
    return runs, _finish(_start(args, directory, env=env), timeout_s=560)


def _decreasing(losses: dict[int, float]) -> bool:
    return losses[7] + losses[8] < losses[1] + losses[2] - 0.2


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test to use recipe_sweep or four_rank_sweep runs it
def test_hsdp_tp_dp_and_cp_dp_on_4_ranks_follow_ddps_loss_trajectory(four_rank_sweep, recipe_sweep):
    from tests.test_train_e2e import RECIPE_SWEEP, _losses, _summary

    runs, output = four_rank_sweep
    # tp_dp and cp_dp have 2 batch shards (tp and cp pairs read the same batches): their
    # reference is ddp on 2, job 0 of the recipe sweep (the same steps, micro-batches and model;
    # it is also profiled, which changes no number).
    assert set(RECIPE_SWEEP[1:]) <= set(FOUR) and RECIPE_SWEEP[0].startswith("parallel=ddp,")
    losses = {p: _losses(d) for p, d in runs.items()} | {"ddp2": _losses(recipe_sweep[0] / "0")}
    summaries = {p: _summary(d) for p, d in runs.items()}
    assert summaries["hsdp"]["mesh"]["sizes"] | {} == {
        "pp": 1,
        "dp_replicate": 2,
        "dp_shard": 2,
        "ep": 1,
        "cp": 1,
        "tp": 1,
    }
    assert summaries["tp_dp"]["mesh"]["groups"] == {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}
    assert summaries["cp_dp"]["mesh"]["groups"] == {"dp": [[0, 2], [1, 3]], "cp": [[0, 1], [2, 3]]}
    assert "ok.fsdp (HSDP)" in summaries["hsdp"]["parallel"]
    assert "context parallel cp=2 (K/V all-gather)" in summaries["cp_dp"]["parallel"]
    for summary in summaries.values():
        assert "recompute=full (2 blocks)" in summary["parallel"]
    for parallel, summary in summaries.items():
        assert (summary["world_size"], summary["steps_run"]) == (4, 8)
        # Profiled (steps 3-5, the profiler's default schedule) on every rank.
        traces = [
            p.name.split(".")[0] for p in Path(summary["profile_dir"]).glob("*.pt.trace.json")
        ]
        assert sorted(traces) == [f"rank{r}" for r in range(4)], traces
        assert summary["profiled_steps"] == 4 * 3
        assert _decreasing(losses[parallel]), (parallel, losses[parallel])
        # Scaling efficiency against the given 1-rank throughput: T(4) / (4 x 1000 tok/s).
        expected = summary["items_per_s"] / (4 * 1000)
        assert summary["scaling_efficiency"] == pytest.approx(expected)
        # Live: every layout's waits (FSDP2's, the cp all-gathers, the dp all-reduces beside
        # tensor parallelism) seen on every rank, every step.
        live = summary["live"]["per_rank"]
        assert [r["steps"] for r in live] == [8] * 4, (parallel, live)
        assert all(r["exposed_ms_per_step"] > 0 for r in live), (parallel, live)
    assert output.count("scaling efficiency") == len(FOUR_RANK_LAYOUTS)
    # Same initial weights, batches and averaged gradients: the same trajectory up to rounding
    # (measured: each pair by at most 4.8e-7, the same before the sweep was profiled).
    pairs = (("hsdp", "ddp"), ("tp_dp", "ddp2"), ("cp_dp", "ddp2"))
    for run, reference in pairs:
        gap = max(abs(losses[run][s] - losses[reference][s]) for s in losses[reference])
        print(f"{run} vs {reference}: max |loss difference| {gap:.2e}")
    for run, reference in pairs:
        assert losses[run] == pytest.approx(losses[reference], abs=1e-4), run
    # Not vacuous: on 4 data shards (ddp on 4 ranks) the trajectory is another one.
    assert losses["tp_dp"][8] != pytest.approx(losses["ddp"][8], abs=1e-3)
    assert losses["cp_dp"][8] != pytest.approx(losses["ddp"][8], abs=1e-3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ep_dp_dispatches_over_the_planners_ep_groups_and_resumes_bitwise(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.test_train_e2e import _losses, _summary, _train

    # An axis order that puts ep outside dp: the planner's ep groups are then not the
    # consecutive ranks a naive arange mesh would pair.
    order = ["pp", "ep", "dp", "cp", "tp"]
    common = [
        "parallel=ep_dp",
        "launcher.nproc_per_node=4",
        "train.steps=8",
        "train.grad_accum=2",
        "train.checkpoint_every=4",
        f"+parallel.plan.order=[{','.join(order)}]",
    ]
    sweep = tmp_path / "sweep"
    # Job 0 runs steps 1..8; job 1 stops after step 4 and is resumed below.
    _train(
        ["-m", *common, "train.stop_after=null,4", f"hydra.sweep.dir={sweep}"],
        tmp_path,
        timeout_s=400,
    )
    whole, resumed = sweep / "0", sweep / "1"
    assert _summary(resumed)["final_step"] == 4  # train.stop_after
    summary = _summary(whole)
    assert summary["name"] == "moe_tiny-ep_dp"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # this host's 4 CPU ranks, as detected
    planned = ok.plan(ok.detect_topology(), ep=2, order=order).groups("ep")
    assert planned == ((0, 2), (1, 3))
    assert summary["mesh"]["groups"]["ep"] == [list(g) for g in planned]
    records = summary["ep_dispatch"]
    assert [r["rank"] for r in records] == [0, 1, 2, 3]
    for record in records:
        own = next(list(g) for g in planned if record["rank"] in g)
        # Every MoE layer of every rank: 8 steps x 2 micro-batches x (2 forward + 2 backward).
        assert record["layers"] == [{"group": own, "all_to_all_calls": 64}] * 2
    assert _decreasing(_losses(whole))

    # The same command in the same directory resumes from its newest checkpoint, step 4
    # (expert shards are DTensors in the DCP checkpoint): the same data position, parameters
    # and Adam moments at step 8, bitwise. (ok.ddp's resume is checked bitwise by
    # tests/test_elastic_restart.py.)
    output = _train([*common, f"hydra.run.dir={resumed}"], tmp_path)
    assert "resumed from step 4" in output
    summary = _summary(resumed)
    assert (summary["start_step"], summary["steps_run"], summary["final_step"]) == (4, 4, 8)
    states = []
    for run_dir in (whole, resumed):
        target = run_dir / "step8.pt"
        dcp_to_torch_save(run_dir / "checkpoints" / "step_00000008", target)
        states.append(torch.load(target, weights_only=False))
    a, b = states
    assert a["progress"] == b["progress"] == {"step": 8, "data": {"position": 16}}
    assert a["model"]["blocks.0.mlp.experts.w1"].shape[0] == 4  # all experts, gathered
    assert a["model"].keys() == b["model"].keys()
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    for name, moments in a["optim"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, b["optim"]["state"][name][key]), (name, key)
    assert _losses(whole) == _losses(resumed)
