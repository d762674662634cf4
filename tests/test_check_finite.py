"""check_finite: a NaN gradient on one rank is caught after the all-reduce on every rank, naming
the parameter; "skip" drops the step everywhere and training goes on; disabled costs nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import overlapkit as ok
from overlapkit.ddp import hooks
from overlapkit.ddp.comm_stats import CommRecorder
from overlapkit.ddp.finite import (
    FiniteCheck,
    NonFiniteGradients,
    nonfinite_message,
    validate_finite_options,
)
from tests.multiproc import run_on_ranks
from tests.reference import make_batches, make_mlp, shard

BAD_STEP = 1
STEPS = 3
LR = 0.1
MOMENTUM = 0.9
SMALL_BUCKET_MB = 0.004  # several buckets for the 32-wide MLP
POISONED = "2.weight"


def _poison(mlp: nn.Module, rank: int, step: dict) -> None:
    """On rank 1 at ``BAD_STEP``, put one NaN into the gradient of ``POISONED``."""

    def hook(grad):
        if rank != 1 or step["now"] != BAD_STEP:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    dict(mlp.named_parameters())[POISONED].register_hook(hook)


def _train(rank, world_size, wrapper, **options):
    """Train ``STEPS`` steps with SGD+momentum; report each step's error (or None) and state."""
    mlp = make_mlp()
    step = {"now": 0}
    _poison(mlp, rank, step)
    if wrapper == "ddp":
        model, bucketer = ok.ddp(mlp, bucket_mb=SMALL_BUCKET_MB, **options), None
    else:
        model, bucketer = mlp, ok.GradBucketer(mlp, bucket_mb=SMALL_BUCKET_MB, **options)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    errors, changed, nan_grads = [], [], []
    for step["now"], batch in enumerate(make_batches(STEPS, world_size)):
        x, y = shard(batch, rank, world_size)
        opt.zero_grad(set_to_none=True)
        before = copy.deepcopy(mlp.state_dict())
        try:
            nn.functional.mse_loss(model(x), y).backward()
            if bucketer is not None:
                bucketer.wait()
        except RuntimeError as error:  # DDP re-raises what its backward callbacks raise
            errors.append(f"{type(error).__name__}: {error}")
            continue
        errors.append(None)
        nan_grads.append(any(p.grad is not None and p.grad.isnan().any() for p in mlp.parameters()))
        opt.step()
        changed.append(any(not torch.equal(before[k], v) for k, v in mlp.state_dict().items()))
    owner = model if bucketer is None else bucketer
    return {
        "errors": errors,
        "changed": changed,
        "nan_grads": nan_grads,
        "skipped": ok.comm_stats(owner).skipped_steps,
        "params": {n: p.detach().clone() for n, p in mlp.named_parameters()},
        "hook": None if bucketer is not None else model._comm_hooks[0][0].__name__,
    }


def _every_case(rank, world_size):
    cases = {
        f"{wrapper}_{name}": (wrapper, options)
        for wrapper in ("ddp", "bucketer")
        for name, options in {
            "raise": {"check_finite": True},
            "skip": {"check_finite": True, "on_nonfinite": "skip"},
            "disabled": {},
        }.items()
    }
    cases["ddp_bf16_raise"] = ("ddp", {"check_finite": True, "compress": "bf16"})
    return {name: _train(rank, world_size, w, **opts) for name, (w, opts) in cases.items()}


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_every_case, 2)


def _reference_skipping_bad_step():
    """Single process, whole batches, the bad step left out: what "skip" must reproduce."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step, (x, y) in enumerate(make_batches(STEPS, 2)):
        if step == BAD_STEP:
            continue
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return dict(model.named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ddp_raise", "ddp_bf16_raise", "bucketer_raise"])
def test_nan_on_one_rank_raises_on_both_naming_the_parameter(results, case):
    caller = "ok.ddp" if case.startswith("ddp") else "ok.GradBucketer"
    for rank in range(2):
        errors = results[rank][case]["errors"]
        assert [e is None for e in errors] == [s != BAD_STEP for s in range(STEPS)], errors
        message = errors[BAD_STEP]
        assert "NonFiniteGradients" in message
        assert f"{caller}: non-finite (NaN/Inf) gradients after the all-reduce in step" in message
        assert f"['{POISONED}'] (the bucket holds [" in message
        # Training went on after the error, and no NaN reached any later step.
        assert not any(results[rank][case]["nan_grads"])
    # The same verdict, bucket and parameter on both ranks (the reduced bucket is identical).
    assert results[0][case]["errors"] == results[1][case]["errors"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ddp_skip", "bucketer_skip"])
def test_skip_drops_the_step_on_every_rank_and_training_continues(results, case):
    reference = _reference_skipping_bad_step()
    for rank in range(2):
        got = results[rank][case]
        assert got["errors"] == [None] * STEPS
        assert got["skipped"] == (BAD_STEP,)
        # The skipped step changed no parameter (momentum included); the others did.
        assert got["changed"] == [s != BAD_STEP for s in range(STEPS)]
        for name, ref in reference.items():
            torch.testing.assert_close(got["params"][name], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ddp_disabled", "bucketer_disabled"])
def test_disabled_check_registers_the_plain_hook_and_lets_nan_through(results, case):
    for rank in range(2):
        got = results[rank][case]
        # Nothing looked: the NaN reached the gradients, and no step was skipped.
        assert got["errors"] == [None] * STEPS
        assert got["nan_grads"][BAD_STEP] and got["skipped"] == ()
        if case == "ddp_disabled":
            assert got["hook"] == hooks.allreduce_hook.__name__
    assert results[0]["ddp_raise"]["hook"] == "check_finite_hook"


def test_options_are_validated_with_the_offending_value():
    with pytest.raises(TypeError, match="check_finite must be a bool, got 'yes'"):
        validate_finite_options("yes", "raise", caller="ok.ddp")
    with pytest.raises(ValueError, match=r"unknown on_nonfinite='zero'; choose one of"):
        validate_finite_options(True, "zero", caller="ok.ddp")
    with pytest.raises(ValueError, match="on_nonfinite='skip' needs check_finite=True"):
        validate_finite_options(False, "skip", caller="ok.GradBucketer")
    with pytest.raises(ValueError, match="check_finite=True is not supported with compress="):
        ok.ddp(make_mlp(), compress="powersgd", check_finite=True)


def test_message_names_bad_parameters_and_their_bucket():
    text = nonfinite_message("ok.ddp", 4, [("bucket 1", ["b.weight"], ["b.weight", "b.bias"])])
    assert text.startswith(
        "ok.ddp: non-finite (NaN/Inf) gradients after the all-reduce in step 4, the same on "
        "every rank: bucket 1: ['b.weight'] (the bucket holds ['b.weight', 'b.bias'])."
    )
    assert issubclass(NonFiniteGradients, RuntimeError)


def test_finite_sum_fast_path_never_hides_nan_or_inf_and_overflow_is_not_flagged():
    check = FiniteCheck("ok.GradBucketer", "raise", CommRecorder(), [])
    big = torch.tensor([3e38, 3e38, 1.0])  # every element finite, the float32 sum overflows
    check.inspect("bucket 0", big, lambda: [("w", big[:2]), ("b", big[2:])])
    check.finish_step(0)  # nothing found: no raise
    for poison in (float("nan"), float("inf"), float("-inf")):
        bucket = torch.tensor([1.0, 2.0, poison])
        check.inspect("bucket 1", bucket, lambda b=bucket: [("w", b[:2]), ("b", b[2:])])
        with pytest.raises(NonFiniteGradients) as found:
            check.finish_step(3)
        assert found.value.parameters == ("b",) and found.value.buckets == ("bucket 1",)
