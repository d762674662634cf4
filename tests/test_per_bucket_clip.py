"""GradBucketer(optimizer=).step(clip_grad_norm=, scaler=) against the synchronous loop, bitwise:
``wait(); [scaler.unscale_]; clip_grad_norm_(model.parameters()); [scaler.]step; zero_grad``.

One spawned 2-rank group runs every scenario (``_all_scenarios``); the tests read its results.
Each run: 6 steps of 4 micro-batches (the first 3 under ``no_sync()``), a LambdaLR, an
evaluation forward under ``no_grad`` after each step, a DCP checkpoint after step 3 that the
second half loads into the other form (or the same).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile

import pytest
import torch
from torch import nn

import overlapkit as ok
from overlapkit.ddp.finite import NonFiniteGradients
from overlapkit.optim import per_bucket
from overlapkit.optim.grad_scaling import scaler_in_use
from overlapkit.optim.overlap_checks import refuse_compiled_step, validate_optimizer
from tests.dcp_switch import switch_through_dcp
from tests.multiproc import run_on_ranks
from tests.reference import assert_bitwise, make_batches, make_mlp, shard

STEPS = 6
MICRO = 4
CHECKPOINT_AFTER = 3
ONE_PARAM_PER_BUCKET_MB = 1e-6
# The 32-wide MLP's gradient norms over these batches lie between 0.35 and 0.75: clipping at
# 0.5 is active on some steps and not on others (test_clipping_was_active_on_some_steps_only).
MAX_NORM = 0.5
OPTIMIZERS = {
    "sgd_momentum_wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
}
COMBOS = [("sync", "sync"), ("overlap", "overlap"), ("overlap", "sync"), ("sync", "overlap")]
INF_STEP = 2


class _Cast(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


def _mixed_mlp() -> nn.Sequential:
    """fp32 - bf16 - fp32 layers: the norms of both dtypes meet in clip_grad_norm_'s stack."""
    model = make_mlp()
    model[2].to(torch.bfloat16)
    return nn.Sequential(
        model[0],
        model[1],
        _Cast(torch.bfloat16),
        model[2],
        _Cast(torch.float32),
        model[3],
        model[4],
    )


class _Encoder(nn.Module):
    """Two ``nn.TransformerEncoderLayer`` blocks (MultiheadAttention reads ``out_proj``'s
    parameters itself; in eval under no_grad the layer runs its fused fast path)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, 16)
        self.blocks = nn.Sequential(
            *(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in "ab")
        )
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        tokens = self.embed(x.view(x.shape[0], 2, 8).repeat(1, 1, 2))  # (B, 2, 16)
        return self.head(self.blocks(tokens)).mean(dim=1)


MODELS = {"mlp": make_mlp, "mixed": _mixed_mlp, "encoder": _Encoder}


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))


class _Run:
    """Model, optimizer, scheduler, bucketer (and GradScaler) in one form."""

    def __init__(self, opt_name, mode, model="mlp", *, scaler=False, **bucketer_options):
        self.model = MODELS[model]()
        self.opt = OPTIMIZERS[opt_name](self.model.parameters())
        self.sched = _schedule(self.opt)
        self.mode = mode
        self.scaler = torch.amp.GradScaler("cpu", growth_interval=2) if scaler else None
        extra = {"optimizer": self.opt} if mode == "overlap" else {}
        self.bucketer = ok.GradBucketer(
            self.model, bucket_mb=ONE_PARAM_PER_BUCKET_MB, **extra, **bucketer_options
        )

    def backward(self, x, y, loss_scale=1.0):
        """4 micro-batches, the first 3 under no_sync (what nanoGPT's accumulation does)."""
        rows = x.shape[0] // MICRO
        for k in range(MICRO):
            last = k == MICRO - 1
            with contextlib.nullcontext() if last else self.bucketer.no_sync():
                xs, ys = x[k * rows : (k + 1) * rows], y[k * rows : (k + 1) * rows]
                loss = nn.functional.mse_loss(self.model(xs).float(), ys) / MICRO * loss_scale
                (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, max_norm, norm_type=2.0):
        """The step; returns a callable giving the norm (read after the next eval forward)."""
        if self.mode == "overlap":
            self.bucketer.step(clip_grad_norm=max_norm, norm_type=norm_type, scaler=self.scaler)
            # Right after step(), updates pending: a no-op, even zeroing in place.
            self.opt.zero_grad(set_to_none=False)
            if self.scaler:
                self.scaler.update()
            return self.bucketer.total_norm if max_norm is not None else (lambda: None)
        self.bucketer.wait()
        if self.scaler and max_norm is not None:
            self.scaler.unscale_(self.opt)
        norm = None
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, norm_type)
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad()
        return lambda: norm


def _state(run):
    run.bucketer.synchronize()
    return {
        "params": {n: p.detach().clone() for n, p in run.model.named_parameters()},
        "optim": {str(k): v for k, v in run.opt.state_dict()["state"].items()},
    }


def _train(
    rank, world_size, opt_name, combo, root, *, model="mlp", max_norm=MAX_NORM, norm_type=2.0
):
    x_eval = make_batches(1, 1, seed=7)[0][0]
    run = _Run(opt_name, combo[0], model)
    evals, norms = [], []
    for step, batch in enumerate(make_batches(STEPS, world_size, per_rank=16)):
        if step == CHECKPOINT_AFTER:
            path = os.path.join(root, f"{model}-{opt_name}-{'-'.join(combo)}-{norm_type}")
            run = switch_through_dcp(run, lambda: _Run(opt_name, combo[1], model), path)
        run.backward(*shard(batch, rank, world_size))
        norm = run.step(max_norm, norm_type)
        run.sched.step()
        run.model.eval()  # nn.TransformerEncoderLayer: the fused fast path
        with torch.no_grad():
            evals.append(run.model(x_eval).clone())  # right after step(): no synchronize
        run.model.train()
        value = norm()
        norms.append(None if value is None else value.clone())
    return {**_state(run), "evals": evals, "norms": norms}


def _scaled(rank, world_size, opt_name, mode, max_norm):
    """GradScaler fp16 (autocast): rank 1's loss is inf at INF_STEP, so both ranks skip it."""
    run = _Run(opt_name, mode, scaler=True)
    out = {"scales": [], "params": [], "norms": []}
    for step, batch in enumerate(make_batches(STEPS, world_size, per_rank=16)):
        x, y = shard(batch, rank, world_size)
        with torch.autocast("cpu", dtype=torch.float16):
            run.backward(x, y, math.inf if step == INF_STEP and rank == 1 else 1.0)
        norm = run.step(max_norm)
        out["scales"].append(run.scaler.get_scale())
        run.sched.step()
        out["params"].append(_state(run))
        out["norms"].append(norm())
    return out


def _nonfinite(rank, world_size, mode, on_nonfinite):
    """check_finite: NaN on rank 1 at INF_STEP; raise (caught, training goes on) or skip."""
    run = _Run("adamw", mode, check_finite=True, on_nonfinite=on_nonfinite)
    raised, x_eval = [], make_batches(1, 1, seed=7)[0][0]
    for step, batch in enumerate(make_batches(STEPS, world_size, per_rank=16)):
        x, y = shard(batch, rank, world_size)
        run.backward(x, y, math.nan if step == INF_STEP and rank == 1 else 1.0)
        try:
            run.step(MAX_NORM if on_nonfinite == "skip" else None)
            with torch.no_grad():
                run.model(x_eval)  # the verdict may come in the next forward's pre-hook
        except NonFiniteGradients:
            raised.append(step)
            run.opt.zero_grad()  # what a loop that catches it does (the overlap form did too)
        run.sched.step()
    return {**_state(run), "raised": raised, "skipped": ok.comm_stats(run.bucketer).skipped_steps}


def _error_if_nonfinite(rank, world_size, mode):
    """error_if_nonfinite=True: an inf on rank 1 at INF_STEP raises torch's error from the step
    on both ranks (caught); the other steps clip as usual."""
    run = _Run("adamw", mode)
    raised = []
    for step, batch in enumerate(make_batches(STEPS, world_size, per_rank=16)):
        run.backward(
            *shard(batch, rank, world_size), math.inf if step == INF_STEP and rank == 1 else 1.0
        )
        try:
            if mode == "overlap":
                run.bucketer.step(clip_grad_norm=MAX_NORM, error_if_nonfinite=True)
            else:
                run.bucketer.wait()
                torch.nn.utils.clip_grad_norm_(
                    run.model.parameters(), MAX_NORM, error_if_nonfinite=True
                )
                run.opt.step()
                run.opt.zero_grad()
        except RuntimeError as error:
            raised.append((step, "is non-finite, so it cannot be clipped" in str(error)))
            run.opt.zero_grad()
        run.sched.step()
    return {**_state(run), "raised": raised}


def _rebuild_while_pending(rank, world_size, mode):
    """load_state_dict (a bucket rebuild) right after step(), updates still pending."""
    run = _Run("adam", mode)
    for step, batch in enumerate(make_batches(4, world_size, per_rank=16)):
        run.backward(*shard(batch, rank, world_size))
        run.step(None)
        if step >= 1:
            run.bucketer.load_state_dict(run.bucketer.state_dict())
    return _state(run)


def _hooks_once_per_step(rank, world_size):
    """Global and the optimizer's own step hooks run once per step(), not once per bucket."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    run = _Run("adamw", "overlap")
    seen = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: seen.append(("global_pre", o))),
        register_optimizer_step_post_hook(lambda o, a, k: seen.append(("global_post", o))),
        run.opt.register_step_post_hook(lambda o, a, k: seen.append(("own_post", o))),
    ]
    for batch in make_batches(3, world_size, per_rank=16):
        run.backward(*shard(batch, rank, world_size))
        run.step(None)
    run.bucketer.synchronize()
    for h in handles:
        h.remove()
    return {
        "events": [name for name, _ in seen],
        "same_optimizer": all(o is run.opt for _, o in seen),
        "buckets": run.bucketer.num_buckets,
    }


def _event_order_clipped(rank, world_size):
    """With clipping, the next forward's first module starts before the other buckets' updates."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    bucketer = ok.GradBucketer(model, bucket_mb=0.0005, optimizer=opt)
    first = {id(p) for p in model[0].parameters()}
    log, real = [], per_bucket.step_subset

    def spy(optimizer, params, **kwargs):
        params = list(params)
        log.append("update_first_layer" if {id(p) for p in params} <= first else "update_other")
        real(optimizer, params, **kwargs)

    model[0].register_forward_pre_hook(lambda m, a: log.append("first_module_started"))
    per_bucket.step_subset = spy
    try:
        for batch in make_batches(3, world_size):
            log.clear()
            x, y = shard(batch, rank, world_size)
            nn.functional.mse_loss(model(x), y).backward()
            bucketer.step(clip_grad_norm=1e-3)
        with torch.no_grad():
            log.clear()
            model(x)
        order = list(log)
        bucketer.synchronize()
    finally:
        per_bucket.step_subset = real
    return {"order": order, "norm_clipped": bool(bucketer.total_norm() > 1e-3)}


def _all_scenarios(rank, world_size, root):
    out = {"bitwise": {}, "mixed": {}, "encoder": {}, "scaled": {}, "nonfinite": {}}
    for opt_name in OPTIMIZERS:
        for combo in COMBOS:
            out["bitwise"][opt_name, combo] = _train(rank, world_size, opt_name, combo, root)
    for norm_type in (2.0, math.inf):
        for mode in ("sync", "overlap"):
            out["mixed"][norm_type, mode] = _train(
                rank, world_size, "adam", (mode, mode), root, model="mixed", norm_type=norm_type
            )
    for mode in ("sync", "overlap"):
        for max_norm in (None, MAX_NORM):
            out["encoder"][mode, max_norm] = _train(
                rank, world_size, "adamw", (mode, mode), root, model="encoder", max_norm=max_norm
            )
    for opt_name in ("adamw", "adamw_fused", "sgd_momentum_wd"):
        for max_norm in (None, MAX_NORM):
            for mode in ("sync", "overlap"):
                out["scaled"][opt_name, max_norm, mode] = _scaled(
                    rank, world_size, opt_name, mode, max_norm
                )
    for on_nonfinite in ("raise", "skip"):
        for mode in ("sync", "overlap"):
            out["nonfinite"][on_nonfinite, mode] = _nonfinite(rank, world_size, mode, on_nonfinite)
    out["rebuild"] = {m: _rebuild_while_pending(rank, world_size, m) for m in ("sync", "overlap")}
    out["error"] = {m: _error_if_nonfinite(rank, world_size, m) for m in ("sync", "overlap")}
    out["hooks"] = _hooks_once_per_step(rank, world_size)
    out["event_order"] = _event_order_clipped(rank, world_size)
    return out


@pytest.fixture(scope="module")
def scenarios():
    with tempfile.TemporaryDirectory() as root:
        return run_on_ranks(_all_scenarios, 2, root, total_timeout_s=400)


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("combo", COMBOS[1:], ids=["-".join(c) for c in COMBOS[1:]])
def test_clipped_params_state_evals_and_norms_equal_synchronous_path_bitwise(
    scenarios, opt_name, combo
):
    for rank, result in enumerate(scenarios):
        expected = result["bitwise"][opt_name, ("sync", "sync")]
        assert_bitwise(result["bitwise"][opt_name, combo], expected, f"rank {rank}")


@pytest.mark.slow
def test_clipping_was_active_on_some_steps_only(scenarios):
    norms = [float(n) for n in scenarios[0]["bitwise"]["adam", ("sync", "sync")]["norms"]]
    assert any(n > MAX_NORM for n in norms) and any(n < MAX_NORM for n in norms), norms


@pytest.mark.slow
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_total_norm_equals_clip_grad_norm_on_fp32_and_bf16_parameters(scenarios, norm_type):
    for rank, result in enumerate(scenarios):
        sync, overlap = result["mixed"][norm_type, "sync"], result["mixed"][norm_type, "overlap"]
        assert {p.dtype for p in overlap["params"].values()} == {torch.float32, torch.bfloat16}
        assert all(n.dtype == torch.float32 for n in overlap["norms"])
        assert_bitwise(overlap, sync, f"rank {rank} {norm_type}")


@pytest.mark.slow
@pytest.mark.parametrize("max_norm", [None, MAX_NORM], ids=["unclipped", "clipped"])
def test_transformer_encoder_layers_eval_right_after_step_sees_updated_parameters(
    scenarios, max_norm
):
    for rank, result in enumerate(scenarios):
        sync, overlap = result["encoder"]["sync", max_norm], result["encoder"]["overlap", max_norm]
        assert_bitwise(overlap["evals"], sync["evals"], f"rank {rank} evals")
        assert_bitwise(overlap, sync, f"rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", ["adamw", "adamw_fused", "sgd_momentum_wd"])
@pytest.mark.parametrize("max_norm", [None, MAX_NORM], ids=["unclipped", "clipped"])
def test_grad_scaler_skips_the_inf_step_on_both_ranks_and_follows_synchronous_path(
    scenarios, opt_name, max_norm
):
    for rank, result in enumerate(scenarios):
        sync = result["scaled"][opt_name, max_norm, "sync"]
        overlap = result["scaled"][opt_name, max_norm, "overlap"]
        assert_bitwise(overlap, sync, f"rank {rank}")
        scales = overlap["scales"]
        assert scales[INF_STEP] == scales[INF_STEP - 1] / 2, scales  # backed off
        before, after = overlap["params"][INF_STEP - 1], overlap["params"][INF_STEP]
        assert_bitwise(after, before, f"rank {rank}: the inf step changed something")
        assert not torch.equal(
            overlap["params"][-1]["params"]["0.weight"], before["params"]["0.weight"]
        )


@pytest.mark.slow
@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_nonfinite_step_is_dropped_whole_and_training_goes_on_as_synchronous(
    scenarios, on_nonfinite
):
    for rank, result in enumerate(scenarios):
        sync = result["nonfinite"][on_nonfinite, "sync"]
        overlap = result["nonfinite"][on_nonfinite, "overlap"]
        assert_bitwise(overlap["params"], sync["params"], f"rank {rank} params")
        assert_bitwise(overlap["optim"], sync["optim"], f"rank {rank} optimizer state")
        if on_nonfinite == "raise":
            assert overlap["raised"] == sync["raised"] == [INF_STEP]
        else:
            assert overlap["skipped"] == sync["skipped"] == (INF_STEP,)


@pytest.mark.slow
def test_error_if_nonfinite_raises_torchs_error_on_both_ranks_and_training_goes_on(scenarios):
    for rank, result in enumerate(scenarios):
        sync, overlap = result["error"]["sync"], result["error"]["overlap"]
        assert overlap["raised"] == sync["raised"] == [(INF_STEP, True)], (rank, overlap["raised"])
        assert_bitwise(overlap["params"], sync["params"], f"rank {rank} params")
        assert_bitwise(overlap["optim"], sync["optim"], f"rank {rank} optimizer state")


@pytest.mark.slow
def test_load_state_dict_right_after_step_applies_pending_updates_first(scenarios):
    for rank, result in enumerate(scenarios):
        assert_bitwise(result["rebuild"]["overlap"], result["rebuild"]["sync"], f"rank {rank}")


@pytest.mark.slow
def test_optimizer_step_hooks_run_once_per_step_on_the_users_optimizer(scenarios):
    hooks = scenarios[0]["hooks"]
    assert hooks["buckets"] > 3
    assert hooks["events"] == ["global_pre", "own_post", "global_post"] * 3, hooks
    assert hooks["same_optimizer"]


@pytest.mark.slow
def test_clipped_step_lets_the_next_forward_start_before_the_other_updates(scenarios):
    for result in scenarios:
        order = result["event_order"]["order"]
        assert order[:2] == ["update_first_layer", "first_module_started"], order
        assert order.count("update_other") >= 2 and "update_other" not in order[:2], order
        assert result["event_order"]["norm_clipped"]


def _two_linears():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    names = [n for n, _ in model.named_parameters()]
    return model, names


def test_parameters_on_two_devices_are_refused_naming_them():
    model, names = _two_linears()
    model[1].to("meta")
    params = list(model.parameters())
    with pytest.raises(
        ValueError, match=r"on 2 devices \('0\.weight' on cpu, '1\.weight' on meta\)"
    ):
        validate_optimizer(torch.optim.SGD(params, lr=0.1), params, names)


def test_a_compiled_optimizer_step_is_refused_at_construction_and_at_step():
    model, names = _two_linears()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=0.1)
    validate_optimizer(opt, params, names)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # wraps the instance's step itself
    validate_optimizer(opt, params, names)
    opt.step = torch.compile(opt.step)
    with pytest.raises(ValueError, match=r"optimizer\.step is compiled \(torch\.compile\)"):
        validate_optimizer(opt, params, names)
    with pytest.raises(ValueError, match=r"optimizer\.step is compiled"):
        refuse_compiled_step(opt)


def test_step_options_are_checked_before_anything_runs():
    with pytest.raises(TypeError, match=r"scaler must be a torch\.amp\.GradScaler, got 'fp16'"):
        scaler_in_use("fp16", caller="ok.GradBucketer.step")
    assert scaler_in_use(torch.amp.GradScaler("cpu", enabled=False), caller="x") is None
