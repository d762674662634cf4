"""``ok.ddp`` keeps gradients as views of DDP's buckets by default, and what that implies.

One launch of 2 gloo ranks trains the same MLP three ways: the default (``gradient_as_bucket_view``
True) with ``zero_grad()`` freeing the gradients and with ``zero_grad(set_to_none=False)``, and
``gradient_as_bucket_view=False`` (gradients copied into the buckets and back), the control for
every aliasing check. docs/ddp.md says why the default is what it is.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import overlapkit as ok
from tests.multiproc import run_on_ranks
from tests.reference import grads_of, make_batches, make_mlp, reference_grads, shard

STEPS = 3
LR = 0.1
# (name, ok.ddp keyword arguments, zero_grad's set_to_none)
SETUPS = (
    ("view", {}, True),
    ("view_zeroed", {}, False),
    ("copy", {"gradient_as_bucket_view": False}, True),
)


def _saved_bytes(obj: object) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.tell()


def _train(rank: int, world_size: int, model: DistributedDataParallel, set_to_none: bool) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    params = list(model.parameters())
    grads, storages = [], []
    for step, batch in enumerate(make_batches(STEPS, world_size)):
        x, y = shard(batch, rank, world_size)
        # set_to_none=False zeroes each .grad in place (requires_grad_(False), zero_()): no
        # detach_(), which a view refuses.
        opt.zero_grad(set_to_none=set_to_none)
        nn.functional.mse_loss(model(x), y).backward()
        grads.append(grads_of(model))
        storages.append(len({p.grad.untyped_storage().data_ptr() for p in params}))
        if step == 1:
            kept = [p.grad for p in params]  # no clone: what a user's list of grads would hold
            kept_values = [g.clone() for g in kept]
        opt.step()
    last_bias = model.module[-1].bias.grad
    try:
        model.module[0].weight.grad.detach_()
        detach_error = None
    except RuntimeError as error:
        detach_error = str(error)
    return {
        "grads": grads,
        "storages": storages,
        "kept_unchanged": all(torch.equal(k, v) for k, v in zip(kept, kept_values, strict=True)),
        "saved_bias_grad": _saved_bytes(last_bias),
        "saved_bias_grad_clone": _saved_bytes(last_bias.clone()),
        "saved_state_dict": _saved_bytes(model.state_dict()),
        "detach_error": detach_error,
    }


def _views_and_copies(rank: int, world_size: int) -> dict:
    out = {}
    for name, kwargs, set_to_none in SETUPS:
        model = ok.ddp(make_mlp(), **kwargs)
        out[name] = {"as_bucket_view": model.gradient_as_bucket_view}
        out[name] |= _train(rank, world_size, model, set_to_none)
    # A DDP built elsewhere (Accelerate, HF Trainer) keeps its own setting; naming one is refused.
    adopted = ok.ddp(DistributedDataParallel(make_mlp()))
    out["adopted_as_bucket_view"] = adopted.gradient_as_bucket_view
    try:
        ok.ddp(DistributedDataParallel(make_mlp()), gradient_as_bucket_view=True)
    except TypeError as error:
        out["adopted_error"] = str(error)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(_views_and_copies, 2)


@pytest.mark.slow
def test_default_keeps_grads_as_bucket_views_and_every_setup_matches_the_reference(runs):
    reference = reference_grads(make_mlp(), make_batches(STEPS, 2), lr=LR)
    n_params = len(list(make_mlp().parameters()))
    for per_rank in runs:
        assert per_rank["view"]["as_bucket_view"] and per_rank["view_zeroed"]["as_bucket_view"]
        assert not per_rank["copy"]["as_bucket_view"]
        # ok.ddp's default bucket (>= 1 MiB) holds this whole MLP: as views, every .grad lives in
        # that one bucket's storage, at every step (DDP's rebuild at step 1 re-points them);
        # copied, each has its own.
        assert per_rank["view"]["storages"] == [1] * STEPS
        assert per_rank["view_zeroed"]["storages"] == [1] * STEPS
        assert per_rank["copy"]["storages"] == [n_params] * STEPS
        for name, _, _ in SETUPS:
            for step, want in enumerate(reference):
                for param, g in want.items():
                    torch.testing.assert_close(
                        per_rank[name]["grads"][step][param], g, rtol=1e-6, atol=1e-7
                    )


@pytest.mark.slow
def test_a_grad_kept_across_steps_aliases_the_bucket_only_as_a_view(runs):
    for per_rank in runs:
        # zero_grad() frees .grad, backward makes a new one and DDP points it back at the bucket,
        # so a reference kept from an earlier step shows the latest values: clone what you keep.
        assert not per_rank["view"]["kept_unchanged"]
        assert per_rank["copy"]["kept_unchanged"]
        # Zeroed in place, a kept .grad is the live gradient in both settings.
        assert not per_rank["view_zeroed"]["kept_unchanged"]


@pytest.mark.slow
def test_detach_in_place_is_refused_on_a_view(runs):
    for per_rank in runs:
        assert "detach views in-place" in per_rank["view"]["detach_error"]
        assert per_rank["copy"]["detach_error"] is None


@pytest.mark.slow
def test_saving_one_grad_writes_its_whole_bucket_and_state_dicts_are_unchanged(runs):
    grad_bytes = sum(p.numel() * p.element_size() for p in make_mlp().parameters())
    for per_rank in runs:
        view, copy = per_rank["view"], per_rank["copy"]
        # torch.save of a view writes its storage: the last bias's 16 bytes bring every gradient.
        assert view["saved_bias_grad"] - view["saved_bias_grad_clone"] >= grad_bytes - 16
        assert copy["saved_bias_grad"] == copy["saved_bias_grad_clone"]
        # A state_dict holds parameters and buffers, no gradient: checkpoints are the same.
        assert view["saved_state_dict"] == copy["saved_state_dict"]


@pytest.mark.slow
def test_an_adopted_ddp_keeps_its_setting_and_refuses_one_given(runs):
    for per_rank in runs:
        assert per_rank["adopted_as_bucket_view"] is False  # torch DDP's own default
        assert (
            "['gradient_as_bucket_view'] only apply when ok.ddp builds it"
            in per_rank["adopted_error"]
        )


def test_gradient_as_bucket_view_that_is_not_a_bool_is_refused_naming_it():
    with pytest.raises(TypeError, match="gradient_as_bucket_view must be True, False or None"):
        ok.ddp(make_mlp(), gradient_as_bucket_view="yes")
