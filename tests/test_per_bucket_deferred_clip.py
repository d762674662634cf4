"""What the framework adapters need of ``GradBucketer(optimizer=)``, against the synchronous loop.

``bucketer.clip_grad_norm_(params, max_norm)`` before ``step()`` must be bitwise ``wait();
clip_grad_norm_(params, max_norm); optimizer.step()`` for a parameter list in another order
than the model's and without some of its parameters (Lightning clips the optimizer's param
groups); the tensor it returns must hold that norm once the step has decided it;
``step_skipped()`` must say which GradScaler steps were skipped; a parameter read without its
module's forward must raise a clear error unless ``before_forward(module)`` ran first. One
2-rank launch runs every scenario.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import overlapkit as ok
from overlapkit.optim.overlap_checks import OverlapConflict
from tests.multiproc import run_on_ranks
from tests.reference import assert_bitwise, make_batches, make_mlp, shard

STEPS = 5
INF_STEP = 2
ONE_PARAM_PER_BUCKET_MB = 1e-6
# The MLP's norms over these batches lie between 0.35 and 0.75 (tests/test_per_bucket_clip.py).
MAX_NORM = 0.5


def _clip_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters in reverse order, the first layer's bias left out."""
    return [p for p in reversed(list(model.parameters())) if p is not model[0].bias]


def _deferred(rank, world_size, mode, *, scaler=False):
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    extra = {"optimizer": opt} if mode == "overlap" else {}
    bucketer = ok.GradBucketer(model, bucket_mb=ONE_PARAM_PER_BUCKET_MB, **extra)
    grad_scaler = torch.amp.GradScaler("cpu") if scaler else None
    x_eval = make_batches(1, 1, seed=7)[0][0]
    norms, evals, skipped = [], [], []
    for step, batch in enumerate(make_batches(STEPS, world_size, per_rank=16)):
        x, y = shard(batch, rank, world_size)
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if scaler and step == INF_STEP and rank == 1:
            loss = loss * math.inf
        (grad_scaler.scale(loss) if scaler else loss).backward()
        if mode == "overlap":
            norm = bucketer.clip_grad_norm_(_clip_params(model), MAX_NORM)
            bucketer.step(scaler=grad_scaler)
            if scaler:
                skipped.append(bucketer.step_skipped())
        else:
            bucketer.wait()
            if scaler:
                grad_scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(_clip_params(model), MAX_NORM)
            (grad_scaler.step(opt) if scaler else opt.step())
            opt.zero_grad()
        if scaler:
            grad_scaler.update()
        with torch.no_grad():
            evals.append(model(x_eval).clone())  # decides the step, writes the norm
        norms.append(norm.clone())
    bucketer.synchronize()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "optim": {str(k): v for k, v in opt.state_dict()["state"].items()},
        "norms": norms,
        "evals": evals,
        "skipped": skipped,
    }


class _ReadsChildWeight(nn.Module):
    """A parent that computes with its child's weight itself (not through the child)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.child = nn.Linear(16, 4)

    def forward(self, x):
        return x @ self.child.weight.t()


def _direct_read(rank, world_size, before_forward: bool) -> str:
    model = _ReadsChildWeight()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bucketer = ok.GradBucketer(model, bucket_mb=ONE_PARAM_PER_BUCKET_MB, optimizer=opt)
    try:
        for batch in make_batches(3, world_size):
            x, y = shard(batch, rank, world_size)
            if before_forward:
                bucketer.before_forward(model.child)
            nn.functional.mse_loss(model(x), y).backward()
            bucketer.step(clip_grad_norm=MAX_NORM)
    except OverlapConflict as error:
        return str(error)
    finally:
        bucketer.remove()
    return "trained"


def _misuse(rank, world_size) -> dict:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bucketer = ok.GradBucketer(model, optimizer=opt)
    errors = {}

    def refused(case, call):
        try:
            call()
            errors[case] = None
        except (RuntimeError, ValueError) as error:
            errors[case] = str(error)

    refused("before_backward", lambda: bucketer.clip_grad_norm_(model.parameters(), 1.0))
    x, y = shard(make_batches(1, world_size)[0], rank, world_size)
    nn.functional.mse_loss(model(x), y).backward()
    refused("foreign", lambda: bucketer.clip_grad_norm_([nn.Parameter(torch.ones(3))], 1.0))
    bucketer.clip_grad_norm_(model.parameters(), 1.0)
    refused("twice", lambda: bucketer.clip_grad_norm_(model.parameters(), 1.0))
    refused("and_step_clip", lambda: bucketer.step(clip_grad_norm=1.0))
    bucketer.step()  # the refused step left the backward's gradients in place
    bucketer.remove()
    return errors


def _all(rank, world_size):
    return {
        "deferred": {m: _deferred(rank, world_size, m) for m in ("sync", "overlap")},
        "scaled": {m: _deferred(rank, world_size, m, scaler=True) for m in ("sync", "overlap")},
        "direct": {b: _direct_read(rank, world_size, b) for b in (False, True)},
        "misuse": _misuse(rank, world_size),
    }


@pytest.fixture(scope="module")
def scenarios():
    return run_on_ranks(_all, 2, total_timeout_s=240, collective_timeout_s=60)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["deferred", "scaled"])
def test_deferred_clip_over_a_reordered_subset_equals_clip_grad_norm_bitwise(scenarios, case):
    for rank, result in enumerate(scenarios):
        sync, overlap = result[case]["sync"], result[case]["overlap"]
        assert_bitwise({**overlap, "skipped": []}, {**sync, "skipped": []}, f"rank {rank}")
    norms = [float(n) for n in scenarios[0]["deferred"]["sync"]["norms"]]
    assert any(n > MAX_NORM for n in norms) and any(n < MAX_NORM for n in norms), norms


@pytest.mark.slow
def test_step_skipped_names_the_grad_scaler_steps_that_applied_nothing(scenarios):
    for result in scenarios:
        skipped = result["scaled"]["overlap"]["skipped"]
        assert skipped[INF_STEP] and skipped.count(True) < len(skipped), skipped
        assert not math.isfinite(float(result["scaled"]["sync"]["norms"][INF_STEP]))


@pytest.mark.slow
def test_a_parameter_read_outside_its_module_raises_unless_before_forward_ran(scenarios):
    for result in scenarios:
        assert "the gradient of 'child.weight' arrived while" in result["direct"][False]
        assert "bucketer.before_forward(module)" in result["direct"][False]
        assert result["direct"][True] == "trained"


@pytest.mark.slow
def test_deferred_clip_misuse_is_refused_clearly(scenarios):
    errors = scenarios[0]["misuse"]
    assert "no backward has produced gradients" in errors["before_backward"]
    assert (
        "parameters[0] (shape (3,)) is not a parameter this bucketer reduces" in (errors["foreign"])
    )
    assert "already called for this step" in errors["twice"]
    assert "already asked for a clip in this step" in errors["and_step_clip"]
