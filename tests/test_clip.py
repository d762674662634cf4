"""overlapkit.optim.clip: global-norm clipping assembled part by part equals
``torch.nn.utils.clip_grad_norm_`` bitwise (norm and clipped gradients), one process."""

from __future__ import annotations

import math
import random

import pytest
import torch

from overlapkit.optim.clip import (
    NormPartials,
    clip_coefficient,
    raise_if_nonfinite,
    scale_grads_,
    validate_clip_options,
)

# Parameter dtypes in registration order: fp32 only, and mixes where torch's (device, dtype)
# grouping yields the groups in another order than they first appear.
DTYPE_MIXES = {
    "fp32": [torch.float32] * 6,
    "fp32_bf16": [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16],
    "bf16_fp32_fp16_fp64": [torch.bfloat16, torch.float32, torch.float16, torch.float64] * 2,
}
NORM_TYPES = [2.0, math.inf, 1.0, 3.5, "inf"]


def _params(dtypes, seed, none_at=(), scale=1.0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for k, dtype in enumerate(dtypes):
        p = torch.nn.Parameter(torch.zeros(3 + 5 * k, 2 + k % 3, dtype=dtype))
        if k not in none_at:
            p.grad = (torch.randn(p.shape, generator=g) * scale).to(dtype)
        params.append(p)
    return params


def _clip_in_parts(params, max_norm, norm_type, seed):
    """clip_grad_norm_'s math over a random partition of ``params``, parts in random order."""
    order = list(range(len(params)))
    rng = random.Random(seed)
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, len(order)), k=min(2, len(order) - 1)))
    parts = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)], strict=True)]
    _, norm = validate_clip_options(max_norm, norm_type, False, caller="test")
    partials = NormPartials(norm)
    for part in parts:
        keys = [i for i in part if params[i].grad is not None]
        partials.add(keys, [params[i].grad for i in keys])
    with_grad = [i for i, p in enumerate(params) if p.grad is not None]
    total = partials.total(with_grad, [params[i].grad for i in with_grad])
    coef = clip_coefficient(max_norm, total)
    for part in reversed(parts):
        scale_grads_([params[i].grad for i in part if params[i].grad is not None], coef)
    return total


def _assert_same(mine, theirs, total, expected):
    assert total.dtype == expected.dtype and total.device == expected.device
    assert torch.equal(total, expected) or (total.isnan() and expected.isnan()), (total, expected)
    for a, b in zip(mine, theirs, strict=True):
        if b.grad is None:
            assert a.grad is None
        else:
            assert torch.equal(a.grad, b.grad) or torch.equal(a.grad.isnan(), b.grad.isnan())


@pytest.mark.parametrize("mix", list(DTYPE_MIXES))
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=str)
@pytest.mark.parametrize("max_norm", [0.0, 0.5, 5.0, math.inf], ids=str)
def test_parts_equal_clip_grad_norm_bitwise(mix, norm_type, max_norm):
    for seed in range(3):
        mine = _params(DTYPE_MIXES[mix], seed, none_at=(1,) if seed == 2 else ())
        theirs = _params(DTYPE_MIXES[mix], seed, none_at=(1,) if seed == 2 else ())
        expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
        total = _clip_in_parts(mine, max_norm, norm_type, seed)
        _assert_same(mine, theirs, total, expected)


def test_clipping_was_active_and_inactive_in_the_bitwise_cases():
    small = _params(DTYPE_MIXES["fp32"], 0, scale=1e-3)
    large = _params(DTYPE_MIXES["fp32"], 0, scale=10.0)
    assert clip_coefficient(1.0, _clip_in_parts(small, 1.0, 2.0, 0)).item() == 1.0
    assert clip_coefficient(1.0, _clip_in_parts(large, 1.0, 2.0, 0)).item() < 1.0


def test_mixed_dtypes_stack_in_group_order_not_first_appearance():
    # The point of assembling in torch's order: first-appearance order gives other bits here.
    params = _params([torch.float32, torch.bfloat16] * 4, 0, scale=3.0)
    norms = [torch.linalg.vector_norm(p.grad) for p in params]
    naive = torch.linalg.vector_norm(torch.stack(norms))
    expected = torch.nn.utils.clip_grad_norm_(params, math.inf)
    assert not torch.equal(naive, expected), "pick a seed where the order matters"
    partials = NormPartials(2.0)
    partials.add(list(range(len(params))), [p.grad for p in params])
    assert torch.equal(partials.total(list(range(len(params))), [p.grad for p in params]), expected)


def test_no_gradients_give_torch_zero_and_change_nothing():
    params = _params([torch.float32] * 2, 0, none_at=(0, 1))
    partials = NormPartials(2.0)
    total = partials.total([], [])
    assert torch.equal(total, torch.nn.utils.clip_grad_norm_(params, 1.0))
    scale_grads_([], clip_coefficient(1.0, total))


def test_nonfinite_total_raises_as_torch_does_only_when_asked():
    for bad in (math.inf, math.nan):
        mine, theirs = (_params([torch.float32] * 3, 0) for _ in range(2))
        for params in (mine, theirs):
            params[1].grad[0, 0] = bad
        with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
            torch.nn.utils.clip_grad_norm_(theirs, 1.0, error_if_nonfinite=True)
        total = _clip_in_parts(mine, 1.0, 2.0, 0)
        with pytest.raises(RuntimeError, match=r"test: the total norm of order 2.0 .* non-finite"):
            raise_if_nonfinite(total, 2.0, caller="test")
        expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)  # error_if_nonfinite=False
        _assert_same(mine, theirs, total, expected)
    raise_if_nonfinite(torch.tensor(3.0), 2.0, caller="test")


def test_total_refuses_a_gradient_whose_norm_was_never_added():
    partials = NormPartials(2.0)
    partials.add(["a"], [torch.ones(2)])
    with pytest.raises(KeyError, match=r"no norm was added for \['b'\]"):
        partials.total(["a", "b"], [torch.ones(2), torch.ones(3)])
    partials.clear()
    assert "a" not in partials


@pytest.mark.parametrize(
    "args, error, pattern",
    [
        ((-1.0, 2.0, False), ValueError, r"clip_grad_norm must be >= 0 .* got -1\.0"),
        ((math.nan, 2.0, False), ValueError, r"clip_grad_norm must be >= 0 .* got nan"),
        (("1.0", 2.0, False), TypeError, r"clip_grad_norm must be a number .* got '1\.0'"),
        ((True, 2.0, False), TypeError, r"got True"),
        ((1.0, "two", False), TypeError, r"norm_type must be a number or 'inf', got 'two'"),
        ((1.0, math.nan, False), ValueError, r"norm_type must be a number or 'inf', got nan"),
        ((1.0, 2.0, "yes"), TypeError, r"error_if_nonfinite must be a bool, got 'yes'"),
    ],
)
def test_bad_clip_options_are_refused_naming_the_value(args, error, pattern):
    with pytest.raises(error, match=pattern):
        validate_clip_options(*args, caller="ok.GradBucketer.step")


def test_good_clip_options_are_converted_as_torch_converts_them():
    assert validate_clip_options(1, "inf", True, caller="x") == (1.0, math.inf)
    assert validate_clip_options(0.0, 2, False, caller="x") == (0.0, 2.0)
