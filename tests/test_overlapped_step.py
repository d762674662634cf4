"""GradBucketer(optimizer=): per-bucket updates equal the synchronous path bitwise, overlap the
next forward (proved by event order), and refuse what needs every gradient first.

One spawned 2-rank group runs every scenario (``_all_scenarios``); the tests read its results.
"""

from __future__ import annotations

import importlib
import itertools
import os
import re
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlapkit as ok
from overlapkit.ddp.finite import NonFiniteGradients
from overlapkit.ddp.reducer import tail_launch_order
from overlapkit.optim.per_bucket import OverlapConflict
from tests.dcp_switch import switch_through_dcp
from tests.multiproc import RankFailure, run_on_ranks
from tests.reference import assert_bitwise, make_batches, make_mlp, shard
from tests.test_dead_rank import ENV, FAULT_STEP, TIMEOUT_S, _train_until_failure
from tests.train_steps import TRAIN_SMALL, compose_config, train_steps

STEPS = 6
CHECKPOINT_AFTER = 3
ONE_PARAM_PER_BUCKET_MB = 1e-6
LAYER_PER_BUCKET_MB = 0.0005  # the 32-wide MLP: each Linear's weight and bias share a bucket
OPTIMIZERS = {
    "sgd_momentum_wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    # CPU defaults to the per-tensor loop; the multi-tensor kernels must give the same bits.
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
}
# (first half, second half) of a run, checkpointed with DCP in between.
COMBOS = [("sync", "sync"), ("overlap", "overlap"), ("overlap", "sync"), ("sync", "overlap")]


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))


class _Run:
    """A model, its optimizer, LR scheduler and bucketer in one mode ("sync" or "overlap")."""

    def __init__(self, opt_name: str, mode: str, bucket_mb: float):
        self.model = make_mlp()
        self.opt = OPTIMIZERS[opt_name](self.model.parameters())
        self.sched = _schedule(self.opt)
        self.mode = mode
        extra = {"optimizer": self.opt} if mode == "overlap" else {}
        self.bucketer = ok.GradBucketer(self.model, bucket_mb=bucket_mb, **extra)

    def train_step(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.mode == "overlap":
            self.bucketer.step()
        else:
            self.bucketer.wait()
            self.opt.step()
            self.opt.zero_grad()
        self.sched.step()


def _train_with_checkpoint(rank, world_size, opt_name, combo, root):
    """6 steps, an eval forward under no_grad after each, a DCP checkpoint after step 3."""
    x_eval = make_batches(1, 1, seed=7)[0][0]
    run = _Run(opt_name, combo[0], ONE_PARAM_PER_BUCKET_MB)
    evals = []
    for step, batch in enumerate(make_batches(STEPS, world_size)):
        if step == CHECKPOINT_AFTER:
            path = os.path.join(root, f"{opt_name}-{'-'.join(combo)}")
            run = switch_through_dcp(
                run, lambda: _Run(opt_name, combo[1], ONE_PARAM_PER_BUCKET_MB), path
            )
        x, y = shard(batch, rank, world_size)
        run.train_step(nn.functional.mse_loss(run.model(x), y))
        with torch.no_grad():
            evals.append(run.model(x_eval).clone())
    run.bucketer.synchronize()
    params = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    return {"params": params, "optim": run.opt.state_dict()["state"], "evals": evals}


class _TwoHeads(nn.Module):
    """A trunk and two heads; ``b`` is used on rank 1 only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(16, 8)
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x, use_b):
        h = torch.relu(self.trunk(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


def _accumulation_and_unused(rank, world_size, mode):
    """Adam, two micro-batches (the first in no_sync), head ``b`` unused on rank 0, ``a.bias``
    reduced but left out of the optimizer (its gradient accumulates in its bucket)."""
    model = _TwoHeads()
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if n != "a.bias"], lr=1e-2)
    extra = {"optimizer": opt} if mode == "overlap" else {}
    bucketer = ok.GradBucketer(model, bucket_mb=ONE_PARAM_PER_BUCKET_MB, **extra)
    for batch in make_batches(4, world_size):
        x, y = shard(batch, rank, world_size)
        with bucketer.no_sync():
            nn.functional.mse_loss(model(x[:4], rank == 1), y[:4]).backward()
        nn.functional.mse_loss(model(x[4:], rank == 1), y[4:]).backward()
        if mode == "overlap":
            bucketer.step()
        else:
            bucketer.wait()
            opt.step()
            opt.zero_grad()
    bucketer.synchronize()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _event_order(rank, world_size):
    """Prove that the next forward's first module runs before the last bucket is reduced.

    Rank 1 holds back its launch of the last-launched bucket at ``step`` until rank 0's first
    module of step ``step + 1`` has started (a store key). If that module waited for the last
    bucket, rank 0 would wait for a collective rank 1 never issues: the test fails on the
    timeout instead of passing. Rank 0 records the order of the module's start and of the
    bucket's completion callback.
    """
    store = dist.distributed_c10d._get_default_store()
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    bucketer = ok.GradBucketer(model, bucket_mb=LAYER_PER_BUCKET_MB, optimizer=opt)
    gated_step, seq, events, now = 2, itertools.count(), [], {"step": -1}
    real_all_reduce = dist.all_reduce

    def last_bucket() -> torch.Tensor:
        return bucketer._reducer.bucket_flat(bucketer._reducer.launch_order[-1])

    def all_reduce(tensor, *args, **kwargs):
        gated = now["step"] == gated_step and tensor.data_ptr() == last_bucket().data_ptr()
        if gated and rank == 1:
            store.wait([f"first_module_started/{gated_step + 1}"], timedelta(seconds=20))
        work = real_all_reduce(tensor, *args, **kwargs)
        if gated and rank == 0:
            work.get_future().then(lambda _: events.append(("last_bucket_reduced", next(seq))))
        return work

    def first_module_started(_module, _args):
        if rank == 0 and now["step"] == gated_step + 1:
            events.append(("first_module_started", next(seq)))
            store.set(f"first_module_started/{gated_step + 1}", "1")

    model[0].register_forward_pre_hook(first_module_started)  # after the bucketer's own hook
    dist.all_reduce = all_reduce
    try:
        for now["step"], batch in enumerate(make_batches(gated_step + 2, world_size)):
            x, y = shard(batch, rank, world_size)
            nn.functional.mse_loss(model(x), y).backward()
            bucketer.step()
        bucketer.synchronize()
    finally:
        dist.all_reduce = real_all_reduce
    return {
        "events": events,
        "buckets": bucketer.bucket_parameter_names(),
        "order": bucketer._reducer.launch_order,
    }


def _refusals(rank, world_size):
    """Each conflict, and the message it raises (or None if nothing was raised)."""
    x, y = shard(make_batches(1, world_size)[0], rank, world_size)
    found = {}

    def attempt(name, fn):
        try:
            fn()
            found[name] = None
        except (OverlapConflict, RuntimeError, ValueError, TypeError) as error:
            found[name] = (type(error).__name__, str(error))

    def fresh(**options):
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, ok.GradBucketer(model, bucket_mb=0.004, optimizer=opt, **options)

    def clipped():
        model, _, bucketer = fresh()
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        bucketer.step()

    def scaled():
        model, opt, _ = fresh()
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)

    def direct_step():
        model, opt, _ = fresh()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    def wait_instead():
        model, _, bucketer = fresh()
        nn.functional.mse_loss(model(x), y).backward()
        bucketer.wait()

    def step_without_optimizer():
        model = make_mlp()
        bucketer = ok.GradBucketer(model, bucket_mb=0.004)
        nn.functional.mse_loss(model(x), y).backward()
        bucketer.step()

    def nonfinite_raise():
        model, _, bucketer = fresh(check_finite=True)
        loss = nn.functional.mse_loss(model(x), y) * (float("nan") if rank == 1 else 1.0)
        loss.backward()
        bucketer.step()
        bucketer.synchronize()

    def foreign_parameter():
        model = make_mlp()
        opt = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(3))], lr=0.1)
        ok.GradBucketer(model, optimizer=opt)

    def lbfgs():
        model = make_mlp()
        ok.GradBucketer(model, optimizer=torch.optim.LBFGS(model.parameters()))

    attempt("clip_grad_norm", clipped)
    attempt("grad_scaler", scaled)
    attempt("direct_step", direct_step)
    attempt("wait", wait_instead)
    attempt("step_without_optimizer", step_without_optimizer)
    attempt("foreign_parameter", foreign_parameter)
    attempt("lbfgs", lbfgs)
    try:
        nonfinite_raise()
        found["nonfinite"] = None
    except NonFiniteGradients as error:
        found["nonfinite"] = (type(error).__name__, str(error))
    return found


def _train_loop(rank, world_size):
    """overlapkit-train's step (``train_step``) with parallel=bucketer and =bucketer_overlap."""
    runs = [(o, "null") for o in ("bucketer", "bucketer_overlap", "fsdp", "fsdp_overlap")]
    runs += [(o, "0.06") for o in ("bucketer", "bucketer_overlap")]  # clipping active
    return {
        (option, clip): train_steps(
            rank, f"parallel={option}", *TRAIN_SMALL, f"train.clip_grad_norm={clip}"
        )
        for option, clip in runs
    }


def _fsdp_by_block(rank, world_size):
    """ok.fsdp + AdamW: step_by_block vs optimizer.step(), and the order step_by_block works in."""
    from tests.test_fsdp_blocks import make_mlp as make_blocks

    # ``overlapkit.fsdp`` the attribute is the function ok.fsdp; the module is in sys.modules.
    prefetch = importlib.import_module("overlapkit.fsdp.prefetch")
    per_block = importlib.import_module("overlapkit.optim.per_block")  # the loop step_by_block runs

    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    out = {}
    for mode in ("step", "by_block"):
        model = ok.fsdp(make_blocks(blocks=4, width=32), prefetch=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = _schedule(opt)
        owner = {id(p): f"block{i}" for i, b in enumerate(model) for p in b.parameters()}
        order = []
        real_step_subset = per_block.step_subset

        def spy(optimizer, params, real=real_step_subset, owner=owner, order=order, **kwargs):
            names = {owner.get(id(p), "root") for p in params} or {"root"}
            order.append(("update", *sorted(names)))
            real(optimizer, params, **kwargs)

        for name, module in [("root", model), *((f"block{i}", b) for i, b in enumerate(model))]:
            real_unshard = module.unshard
            module.unshard = lambda *a, n=name, f=real_unshard, order=order, **k: (
                order.append(("gather", n)),
                f(*a, **k),
            )[1]
        per_block.step_subset = spy
        try:
            for _ in range(4):
                model(x).square().mean().backward()
                order.clear()
                if mode == "by_block":
                    prefetch.step_by_block(model, opt)
                else:
                    opt.step()
                opt.zero_grad()
                sched.step()
        finally:
            per_block.step_subset = real_step_subset
        local = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
        state = {
            str(k): {
                sk: (sv.to_local() if hasattr(sv, "to_local") else sv).clone()
                for sk, sv in v.items()
            }
            for k, v in opt.state_dict()["state"].items()
        }
        out[mode] = {"params": local, "optim": state, "order": list(order)}
    return out


def _all_scenarios(rank, world_size, root):
    out = {"bitwise": {}, "accumulation": {}}
    for opt_name in OPTIMIZERS:
        for combo in COMBOS:
            out["bitwise"][opt_name, combo] = _train_with_checkpoint(
                rank, world_size, opt_name, combo, root
            )
    for mode in ("sync", "overlap"):
        out["accumulation"][mode] = _accumulation_and_unused(rank, world_size, mode)
    out["event_order"] = _event_order(rank, world_size)
    out["refusals"] = _refusals(rank, world_size)
    out["train_loop"] = _train_loop(rank, world_size)
    out["fsdp"] = _fsdp_by_block(rank, world_size)
    return out


@pytest.fixture(scope="module")
def scenarios():
    with tempfile.TemporaryDirectory() as root:
        return run_on_ranks(_all_scenarios, 2, root, total_timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("combo", COMBOS[1:], ids=["-".join(c) for c in COMBOS[1:]])
def test_params_state_and_evals_equal_synchronous_path_bitwise_across_dcp_checkpoint(
    scenarios, opt_name, combo
):
    for rank, result in enumerate(scenarios):
        expected = result["bitwise"][opt_name, ("sync", "sync")]
        actual = result["bitwise"][opt_name, combo]
        assert_bitwise(actual["params"], expected["params"], f"rank {rank} params")
        assert_bitwise(
            {str(k): v for k, v in actual["optim"].items()},
            {str(k): v for k, v in expected["optim"].items()},
            f"rank {rank} optimizer state",
        )
        for step, (a, e) in enumerate(zip(actual["evals"], expected["evals"], strict=True)):
            assert torch.equal(a, e), f"rank {rank}: eval forward after step {step} differs"


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_overlapped_training_equals_single_process_reference(scenarios, opt_name):
    model = make_mlp()
    opt = OPTIMIZERS[opt_name](model.parameters())
    sched = _schedule(opt)
    for x, y in make_batches(STEPS, 2):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    for result in scenarios:
        got = result["bitwise"][opt_name, ("overlap", "overlap")]["params"]
        for name, ref in model.named_parameters():
            torch.testing.assert_close(got[name], ref.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_no_sync_accumulation_and_unused_parameters_equal_synchronous_path(scenarios):
    for result in scenarios:
        assert_bitwise(result["accumulation"]["overlap"], result["accumulation"]["sync"], "params")
    assert not torch.equal(
        scenarios[0]["accumulation"]["overlap"]["b.weight"], _TwoHeads().b.weight
    )


@pytest.mark.slow
def test_next_forward_first_module_starts_before_last_bucket_is_reduced(scenarios):
    result = scenarios[0]["event_order"]
    # The first layer's bucket is launched just before the second layer's, which goes last.
    assert sorted(result["buckets"][result["order"][-2]]) == ["0.bias", "0.weight"], result
    assert sorted(result["buckets"][result["order"][-1]]) == ["2.bias", "2.weight"], result
    names = [name for name, _ in sorted(result["events"], key=lambda e: e[1])]
    assert names == ["first_module_started", "last_bucket_reduced"], result["events"]


REFUSALS = {
    "clip_grad_norm": ("OverlapConflict", r"clip_grad_norm_.*bucketer\.step\(clip_grad_norm="),
    "grad_scaler": ("OverlapConflict", r"GradScaler, pass it: bucketer\.step\(.*scaler=scaler"),
    "direct_step": ("OverlapConflict", r"optimizer\.step\(\) was called.*bucketer\.step\(\)"),
    "wait": ("RuntimeError", r"call bucketer\.step\(\)"),
    "step_without_optimizer": ("RuntimeError", r"step\(\) needs the optimizer"),
    "foreign_parameter": ("ValueError", r"param_groups\[0\]\['params'\]\[6\] \(shape \(3,\)\)"),
    "lbfgs": ("ValueError", r"LBFGS.*closure"),
    "nonfinite": ("NonFiniteGradients", r"non-finite \(NaN/Inf\) gradients"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REFUSALS))
def test_conflicts_raise_clear_errors(scenarios, name):
    kind, pattern = REFUSALS[name]
    for rank, result in enumerate(scenarios):
        if name == "grad_scaler" and rank == 0:
            continue  # same as rank 1; kept short
        found = result["refusals"][name]
        assert found is not None, f"rank {rank}: {name} raised nothing"
        assert found[0] == kind and re.search(pattern, found[1], re.S), found


@pytest.mark.parametrize(
    "options, pattern",
    [
        ({"bucket_mb": "auto"}, "bucket_mb='auto'"),
        ({"forward_order_tail": -1}, "forward_order_tail must be an int >= 0, got -1"),
    ],
)
def test_options_that_conflict_with_per_bucket_updates_are_refused(options, pattern):
    model = make_mlp()
    with pytest.raises(ValueError, match=pattern):
        ok.GradBucketer(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **options)


def test_forward_order_tail_without_optimizer_is_refused():
    with pytest.raises(ValueError, match="forward_order_tail=2 only applies with optimizer="):
        ok.GradBucketer(make_mlp(), forward_order_tail=2)


@pytest.mark.parametrize(
    "num_buckets, tail, expected",
    [(5, 2, [0, 1, 2, 4, 3]), (5, 0, [0, 1, 2, 3, 4]), (2, 3, [1, 0]), (1, 2, [0])],
)
def test_tail_launch_order_reverses_only_the_last_buckets(num_buckets, tail, expected):
    assert tail_launch_order(num_buckets, tail) == expected


def _dead_rank_run(rank, world_size, mode, clip):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bucketer = ok.GradBucketer(model, bucket_mb=0.004, optimizer=opt)

    def step(batch):
        x, y = batch
        nn.functional.mse_loss(model(x), y).backward()
        bucketer.step(clip_grad_norm=clip)

    return _train_until_failure(rank, step, model, mode)


@pytest.mark.slow
@pytest.mark.parametrize("clip", [None, 1.0], ids=["unclipped", "clipped"])
def test_dead_rank_raises_collective_failure_naming_the_bucket(clip):
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_dead_rank_run, 2, "kill", clip, collective_timeout_s=TIMEOUT_S, env=ENV)
    report = failure.value.results[0]
    assert report is not None and report["type"] == "CollectiveFailure", report
    # Detected in step() or in the next forward's pre-hook, whichever waits for it first.
    assert report["step"] in (FAULT_STEP, FAULT_STEP + 1), report
    assert re.search(
        rf"ok\.GradBucketer: all_reduce of bucket \d+ \(step {FAULT_STEP}\) failed on rank 0: "
        r"rank\(s\) \[1\] of the group \[0, 1\] never checked in",
        report["message"],
    ), report["message"]


@pytest.mark.slow
def test_train_option_bucketer_overlap_follows_parallel_bucketer_bitwise(scenarios):
    for result in scenarios:
        for plain, overlapped, clip, what in [
            ("bucketer", "bucketer_overlap", "null", "per-bucket optimizer updates"),
            ("bucketer", "bucketer_overlap", "0.06", "per-bucket optimizer updates"),
            ("fsdp", "fsdp_overlap", "null", "optimizer step by block"),
        ]:
            sync = result["train_loop"][plain, clip]
            overlap = result["train_loop"][overlapped, clip]
            assert what in overlap["description"]
            assert overlap["losses"] == sync["losses"], overlapped
            assert overlap["grad_norms"] == sync["grad_norms"], overlapped
            for name, before in overlap["initial"].items():  # every parameter was updated
                assert not torch.equal(overlap["params"][name], before), (overlapped, name)
            assert_bitwise(overlap["params"], sync["params"], f"{overlapped} params")
        norms = result["train_loop"]["bucketer_overlap", "0.06"]["grad_norms"]
        assert all(n is not None for n in norms) and min(norms) < 0.06 < max(norms), norms


def test_train_runs_bucketer_overlap_with_the_default_clip_grad_norm():
    from hydra.utils import instantiate

    from overlapkit.train.launch.cli import check_job

    cfg = compose_config("parallel=bucketer_overlap")
    assert cfg.train.clip_grad_norm == 1.0
    check_job(cfg, instantiate(cfg.launcher))  # refused before launch until issue 23


@pytest.mark.slow
def test_fsdp_step_by_block_equals_optimizer_step_and_gathers_first_blocks_early(scenarios):
    for result in scenarios:
        by_block, step = result["fsdp"]["by_block"], result["fsdp"]["step"]
        assert_bitwise(by_block["params"], step["params"], "fsdp params")
        assert_bitwise(by_block["optim"], step["optim"], "fsdp optimizer state")
        # prefetch=1: the root's and block 0's all-gathers start before blocks 1-3 are updated.
        assert by_block["order"] == [
            ("update", "root"),
            ("gather", "root"),
            ("update", "block0"),
            ("gather", "block0"),
            ("update", "block1"),
            ("update", "block2"),
            ("update", "block3"),
        ], by_block["order"]
