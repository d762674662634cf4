"""ok.fsdp trains exactly like an unsharded model: 2 gloo ranks (FSDP), 4 ranks (HSDP).

Every rank also trains the unsharded reference on the whole global batch (the concatenation of
all ranks' batches); with equal per-rank batches and mean losses, averaging the ranks' gradients
gives the reference's gradient, so losses and parameters must agree to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.nn.parallel import DistributedDataParallel

import overlapkit as ok
from overlapkit.fsdp.prefetch import overlap_optimizer_step
from overlapkit.fsdp.state import state_of
from tests.multiproc import run_on_ranks
from tests.test_fsdp_blocks import SEQ, VOCAB, make_mlp, make_transformer

STEPS = 3
PER_RANK = 4
FP32_TOL = 1e-5
# bf16 keeps 8 significant bits (relative rounding 2**-9, about 2e-3 per value). Forward and
# gradients are computed from bf16 copies of the parameters, while the sharded parameters, the
# gradient reduction (reduce_dtype=fp32) and SGD stay fp32, so the parameters drift from the fp32
# reference by about lr x (accumulated gradient error). Measured after 3 steps at lr 0.1:
# parameters 1.5e-3 (MLP) and 2e-4 (transformer), loss 5e-5 and 3e-4 relative; the bounds leave
# about 3x margin.
BF16_PARAM_TOL = 5e-3
BF16_LOSS_RTOL = 1e-3
FULL = StateDictOptions(full_state_dict=True)


def _batches(kind: str, world_size: int, steps: int = STEPS + 1) -> list[tuple]:
    g = torch.Generator().manual_seed(1234)
    n = world_size * PER_RANK
    if kind == "mlp":
        return [
            (torch.randn(n, 64, generator=g), torch.randn(n, 64, generator=g)) for _ in range(steps)
        ]
    return [
        (torch.randint(VOCAB, (n, SEQ), generator=g), torch.randint(VOCAB, (n, SEQ), generator=g))
        for _ in range(steps)
    ]


def _loss(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x).float()
    if kind == "mlp":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def _make(kind: str) -> nn.Module:
    return make_mlp(blocks=4, width=64) if kind == "mlp" else make_transformer()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _local(batch: tuple, rank: int) -> tuple:
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return batch[0][rows], batch[1][rows]


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def _train(
    kind: str, model: nn.Module, optimizer, batches, rank: int | None, microbatches: int = 1
) -> list[float]:
    """Steps of SGD; ``rank=None`` is the reference on the whole batch. Returns the losses."""
    losses = []
    for batch in batches:
        x, y = batch if rank is None else _local(batch, rank)
        total = 0.0
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            loss = _loss(kind, model, xm, ym) / microbatches
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total.item() if rank is None else _mean_over_ranks(total))
    return losses


def _compare(
    kind: str,
    rank: int,
    world_size: int,
    wrap: Callable[[nn.Module], nn.Module],
    microbatches: int = 1,
    hook_optimizer: bool = False,
) -> dict:
    batches = _batches(kind, world_size)[:STEPS]
    reference = _make(kind)
    ref_losses = _train(kind, reference, _optimizer(reference), batches, None, microbatches)
    model = wrap(_make(kind))
    optimizer = _optimizer(model)
    if hook_optimizer:
        overlap_optimizer_step(model, optimizer)
    losses = _train(kind, model, optimizer, batches, rank, microbatches)
    full = get_model_state_dict(model, options=FULL)
    ref_state = reference.state_dict()
    return {
        "loss_diff": max(
            abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses, strict=True)
        ),
        "param_diff": max((full[k] - v).abs().max().item() for k, v in ref_state.items()),
        "same_keys": sorted(full) == sorted(ref_state),
        "async_reduce_scatters": state_of(model, caller="test").pending.issued,
        "reduce_scatters_in_flight": state_of(model, caller="test").pending.peak_in_flight,
        "peak_forward": max(s.forward_peak_blocks for s in ok.fsdp_stats(model).steps),
    }


def _resume(rank: int, world_size: int) -> dict:
    """Gather a full state dict, load it into a fresh sharded model, continue: same numbers."""
    kind = "transformer"
    batches = _batches(kind, world_size)
    model = ok.fsdp(_make(kind), prefetch=1)
    optimizer = _optimizer(model)
    _train(kind, model, optimizer, batches[:STEPS], rank)
    model_sd = get_model_state_dict(model, options=FULL)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=FULL)

    restored = ok.fsdp(make_transformer(seed=99), prefetch=2)
    restored_optimizer = _optimizer(restored)
    # Loading converts the given dict's tensors in place; keep the gathered one to compare.
    set_model_state_dict(restored, {k: v.clone() for k, v in model_sd.items()}, options=FULL)
    set_optimizer_state_dict(restored, restored_optimizer, optim_sd, options=FULL)
    reloaded = get_model_state_dict(restored, options=FULL)

    original_loss = _train(kind, model, optimizer, batches[STEPS:], rank)
    restored_loss = _train(kind, restored, restored_optimizer, batches[STEPS:], rank)
    after = get_model_state_dict(model, options=FULL)
    restored_after = get_model_state_dict(restored, options=FULL)
    return {
        "reload_diff": max((reloaded[k] - v).abs().max().item() for k, v in model_sd.items()),
        "loss_diff": abs(original_loss[0] - restored_loss[0]),
        "param_diff": max((restored_after[k] - v).abs().max().item() for k, v in after.items()),
    }


def _bad_meshes(rank: int, world_size: int) -> dict[str, str]:
    """The messages of ok.fsdp's errors that need a process group."""
    errors = {}
    attempts = {
        "small_mesh": lambda: ok.fsdp(make_mlp(), mesh=dist.device_mesh.DeviceMesh("cpu", [0])),
        "swapped_axes": lambda: ok.fsdp(
            make_mlp(),
            mesh=init_device_mesh(
                "cpu", (1, world_size), mesh_dim_names=("dp_shard", "dp_replicate")
            ),
        ),
        "three_axes": lambda: ok.fsdp(make_mlp(), mesh=init_device_mesh("cpu", (1, 1, world_size))),
        "wrapped_twice": lambda: ok.fsdp(ok.fsdp(make_mlp())),
        "fully_sharded": lambda: ok.fsdp(torch.distributed.fsdp.fully_shard(make_mlp())),
        "sharded_block": lambda: ok.fsdp(_with_sharded_block()),
        "ddp": lambda: ok.fsdp(DistributedDataParallel(make_mlp())),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except ValueError as err:
            errors[name] = str(err)
    return errors


def _with_sharded_block() -> nn.Module:
    model = make_mlp()
    torch.distributed.fsdp.fully_shard(model[1])
    return model


def _two_ranks(rank: int, world_size: int) -> dict:
    mlp = {
        f"prefetch{d}": _compare("mlp", rank, world_size, lambda m, d=d: ok.fsdp(m, prefetch=d))
        for d in (0, 1, 2)
    }
    return {
        **mlp,
        "transformer_prefetch2_optimizer_overlap": _compare(
            "transformer", rank, world_size, lambda m: ok.fsdp(m, prefetch=2), hook_optimizer=True
        ),
        "accumulate_2_microbatches": _compare(
            "mlp", rank, world_size, lambda m: ok.fsdp(m, prefetch=1), microbatches=2
        ),
        "bf16_mlp": _compare(
            "mlp", rank, world_size, lambda m: ok.fsdp(m, prefetch=1, mixed_precision="bf16")
        ),
        "bf16_transformer": _compare(
            "transformer",
            rank,
            world_size,
            lambda m: ok.fsdp(m, prefetch=2, mixed_precision="bf16"),
        ),
        "resume": _resume(rank, world_size),
        "errors": _bad_meshes(rank, world_size),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_ranks(_two_ranks, 2, collective_timeout_s=30, total_timeout_s=170)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["prefetch0", "prefetch1", "prefetch2", "transformer_prefetch2_optimizer_overlap"]
)
def test_fp32_matches_the_unsharded_reference_after_three_steps(two_ranks, name):
    for rank_result in two_ranks:
        result = rank_result[name]
        assert result["same_keys"]
        assert result["loss_diff"] < FP32_TOL, result
        assert result["param_diff"] < FP32_TOL, result


@pytest.mark.slow
def test_prefetch_uses_async_reduce_scatter_and_prefetch0_does_not(two_ranks):
    blocks = 4
    assert two_ranks[0]["prefetch0"]["async_reduce_scatters"] == 0
    assert two_ranks[0]["prefetch1"]["async_reduce_scatters"] == STEPS * blocks
    # One block's gradient buffer at a time, like FSDP2's reduce_scatter_max_input_buffers=1.
    assert two_ranks[0]["prefetch2"]["reduce_scatters_in_flight"] == 1
    assert [two_ranks[0][f"prefetch{d}"]["peak_forward"] for d in (0, 1, 2)] == [1, 2, 3]


@pytest.mark.slow
def test_gradient_accumulation_falls_back_to_blocking_reduce_scatter_and_matches(two_ranks):
    result = two_ranks[0]["accumulate_2_microbatches"]
    assert result["loss_diff"] < FP32_TOL and result["param_diff"] < FP32_TOL, result
    # The first microbatch's reduce-scatters run asynchronously, the second's add into .grad.
    assert result["async_reduce_scatters"] == STEPS * 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16_mlp", "bf16_transformer"])
def test_bf16_stays_within_its_tolerance_of_the_fp32_reference(two_ranks, name):
    result = two_ranks[0][name]
    assert result["loss_diff"] < BF16_LOSS_RTOL, result
    assert result["param_diff"] < BF16_PARAM_TOL, result
    assert result["param_diff"] > FP32_TOL, "bf16 should not be bit-for-bit fp32"


@pytest.mark.slow
def test_full_state_dict_round_trip_resumes_identically(two_ranks):
    for rank_result in two_ranks:
        result = rank_result["resume"]
        assert result["reload_diff"] == 0.0
        assert result["loss_diff"] == 0.0 and result["param_diff"] == 0.0, result


@pytest.mark.slow
def test_bad_meshes_and_wrapped_models_are_rejected_with_the_value(two_ranks):
    errors = two_ranks[0]["errors"]
    assert "mesh has 1 ranks" in errors["small_mesh"] and "world has 2" in errors["small_mesh"]
    assert "('dp_shard', 'dp_replicate')" in errors["swapped_axes"]
    assert "got 3-D" in errors["three_axes"]
    assert "already returned by ok.fsdp()" in errors["wrapped_twice"]
    assert "already sharded with fully_shard" in errors["fully_sharded"]
    assert "sub-module '1'" in errors["sharded_block"]
    assert "wrapped in DistributedDataParallel" in errors["ddp"]


def _four_ranks(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    placements = {}

    def wrap(model: nn.Module) -> nn.Module:
        model = ok.fsdp(model, prefetch=1, mesh=mesh)
        placements["head"] = tuple(model.head.weight.placements)
        return model

    def reshard_to_two(model: nn.Module) -> nn.Module:
        # fully_shard's int: after forward each block keeps a half over pairs of ranks.
        model = ok.fsdp(model, prefetch=1, reshard_after_forward=2)
        block = model.layers[0]  # registered after FSDP2's, so it sees what FSDP2 left

        def after_forward(*_):
            placements["post_forward"] = tuple(block.norm1.weight.device_mesh.shape)

        block.register_forward_hook(after_forward)
        return model

    return {
        "transformer": _compare("transformer", rank, world_size, wrap),
        "placements": placements["head"],
        "reshard_to_two": _compare("transformer", rank, world_size, reshard_to_two),
        "post_forward_mesh": placements["post_forward"],
    }


@pytest.mark.slow
def test_hsdp_and_an_int_reshard_after_forward_on_four_ranks_match_the_unsharded_reference():
    results = run_on_ranks(_four_ranks, 4, collective_timeout_s=30, total_timeout_s=150)
    for result in results:
        assert result["placements"] == (Replicate(), Shard(0))
        transformer = result["transformer"]
        assert transformer["loss_diff"] < FP32_TOL and transformer["param_diff"] < FP32_TOL
        # HSDP all-reduces the reduce-scatter output at once, so the reduce-scatter blocks.
        assert transformer["async_reduce_scatters"] == 0
        reshard_to_two = result["reshard_to_two"]
        assert reshard_to_two["loss_diff"] < FP32_TOL and reshard_to_two["param_diff"] < FP32_TOL
        assert reshard_to_two["peak_forward"] == 2  # a half-sharded block is not unsharded
        assert result["post_forward_mesh"] == (2, 2)  # pairs of ranks after forward
