"""The memory model against real models on CPU: exact state bytes, activations within 10 %.

``torch.cuda.max_memory_allocated`` needs a GPU; here the parameter, gradient and optimizer
bytes of a real ``ok.ddp`` / ``ok.fsdp``-wrapped gpt_tiny after an AdamW step are compared with
``autoplan.memory`` (fp32 training: 4 + 4 + 8 bytes per parameter), and one block's activations
with the tensors autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity

import overlapkit as ok
from overlapkit.autoplan.framework import OVERLAPKIT_TRAIN
from overlapkit.autoplan.memory import (
    FP32,
    layer_activation_bytes,
    memory_breakdown,
    model_state_bytes,
    stage_params,
)
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.models import train_model_spec
from overlapkit.autoplan.selective import SDPA_KERNEL
from overlapkit.autoplan.step_time import parameter_tensors
from overlapkit.layout import TrainingLayout
from overlapkit.train.models import GPT, GPTConfig, MoEConfig, MoEGPT
from overlapkit.train.models.moe import shard_experts
from overlapkit.train.parallel.recompute import apply_recompute
from overlapkit.train.parallel.tensor_parallel import apply_tensor_parallel
from tests.cuda import requires_cuda
from tests.multiproc import run_on_ranks

CONFIG = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
MOE = dict(n_expert=4, top_k=2, expert_hidden=256)


def tiny_spec() -> ModelSpec:
    """gpt_tiny as the planner describes it."""
    return train_model_spec(GPTConfig(**CONFIG), name="gpt_tiny")


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(parameter, gradient, Adam moment) bytes this rank holds, tied weights once."""

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = {local(p).data_ptr(): local(p) for p in model.parameters()}
    weights = sum(t.numel() * t.element_size() for t in params.values())
    grads = sum(local(p.grad).numel() * 4 for p in model.parameters() if p.grad is not None)
    moments = sum(
        local(state[key]).numel() * local(state[key]).element_size()
        for state in optimizer.state.values()
        for key in ("exp_avg", "exp_avg_sq")
    )
    return weights, grads, moments


def _train_one_step(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(CONFIG["vocab_size"], (2, CONFIG["block_size"]))
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    optimizer.step()
    return optimizer


def test_ddp_state_bytes_are_exactly_the_predicted_ones():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    optimizer = _train_one_step(model)
    layout = TrainingLayout(dp=1, sharding="ddp")
    predicted = model_state_bytes(stage_params(tiny_spec(), layout, stage=0), layout, FP32)
    assert _state_bytes(model, optimizer) == tuple(int(p) for p in predicted)


def _fsdp_state(rank: int, world_size: int) -> tuple[int, int, int]:
    torch.manual_seed(0)
    model = ok.fsdp(GPT(GPTConfig(**CONFIG)))
    optimizer = _train_one_step(model)
    return _state_bytes(model, optimizer)


@pytest.mark.slow
def test_fsdp_state_bytes_sum_to_the_prediction_over_the_shards():
    per_rank = run_on_ranks(_fsdp_state, 2)
    layout = TrainingLayout(dp=2, sharding="fsdp")
    weights, grads, moments = model_state_bytes(
        stage_params(tiny_spec(), layout, stage=0), layout, FP32
    )
    # FSDP2 splits each parameter's dim 0 into chunks: the ranks' shards add up to exactly the
    # model; each rank holds half of it up to one row per parameter.
    assert sum(r[0] for r in per_rank) == 2 * weights
    assert sum(r[1] for r in per_rank) == 2 * grads
    assert sum(r[2] for r in per_rank) == 2 * moments
    assert all(abs(r[0] - weights) / weights < 0.02 for r in per_rank)


def _tensor_kinds(rank: int, world_size: int) -> dict[str, tuple[int, int]]:
    """(plain, DTensor) parameters of overlapkit-train's tp, ep and FSDP wrappings of the
    tiny models, on a mesh of both ranks."""
    mesh = DeviceMesh("cpu", list(range(world_size)))

    def kinds(model: torch.nn.Module) -> tuple[int, int]:
        dtensors = sum(isinstance(p, DTensor) for p in model.parameters())
        return len(list(model.parameters())) - dtensors, dtensors

    tp = GPT(GPTConfig(**CONFIG))
    apply_tensor_parallel(tp, mesh)
    ep = MoEGPT(MoEConfig(**CONFIG, **MOE))
    shard_experts(ep, mesh)
    return {"tp": kinds(tp), "ep": kinds(ep), "fsdp": kinds(ok.fsdp(GPT(GPTConfig(**CONFIG))))}


@pytest.mark.slow
def test_plain_and_dtensor_parameter_counts_are_the_wrapped_models():
    got = run_on_ranks(_tensor_kinds, 2)[0]
    moe = train_model_spec(MoEConfig(**CONFIG, **MOE), name="moe_tiny")
    layouts = {
        "tp": (tiny_spec(), TrainingLayout(tp=2)),
        "ep": (moe, TrainingLayout(ep=2)),
        "fsdp": (tiny_spec(), TrainingLayout(dp=2, sharding="fsdp")),
    }
    for name, (spec, layout) in layouts.items():
        predicted = parameter_tensors(spec, layout, OVERLAPKIT_TRAIN, layers=4, stage=0)
        assert predicted == got[name], name


def _saved_bytes_of_one_block(batch: int, seq: int) -> int:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    block = model.blocks[0]
    x = torch.randn(batch, seq, CONFIG["n_embd"], requires_grad=True)
    params = {p.data_ptr() for p in block.parameters()}
    saved: dict[tuple[int, tuple], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # Parameters are not activations; a tensor saved twice (views of one storage) once.
        if t.data_ptr() not in params and t.data_ptr() != x.data_ptr():
            key = (t.untyped_storage().data_ptr(), tuple(t.shape))
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x).sum().backward()
    # The block's input is what the previous layer produced: it counts (the norm saves it).
    return sum(saved.values()) + x.numel() * x.element_size()


@pytest.mark.parametrize(("batch", "seq"), [(2, 64), (4, 32)])
def test_one_block_saves_the_predicted_activation_bytes_within_10_percent(batch, seq):
    measured = _saved_bytes_of_one_block(batch, seq)
    layout = TrainingLayout(dp=1, micro_batch=batch)
    predicted = layer_activation_bytes(
        tiny_spec(), layout, FP32, seq_len=seq, flash_attention=True, moe_layer=False
    )
    assert measured == pytest.approx(predicted, rel=0.10), (measured, predicted)


def _retained_by_one_block_forward(recompute: str, batch: int, seq: int) -> int:
    """Bytes one block's forward leaves allocated (the profiler's allocations minus frees):
    what it keeps for backward, the selective cache included, beside its output."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**(CONFIG | {"block_size": seq})))
    apply_recompute(model.blocks, recompute)
    x = torch.randn(batch, seq, CONFIG["n_embd"], requires_grad=True)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model.blocks[0](x)  # held: its graph keeps what backward needs
    retained = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_parent is None)
    del out
    return retained


def test_overlapkit_train_selective_recomputation_keeps_what_its_policy_prices():
    # overlapkit-train's selective reruns SDPA only: the log-sum-exp is freed, the SDPA output
    # is not (proj keeps a view of it), and the outputs of proj and the MLP's second layer
    # stay in the selective cache (autoplan.selective.SDPA_KERNEL).
    batch, seq = 4, 128
    measured = _retained_by_one_block_forward("selective", batch, seq)
    measured -= _retained_by_one_block_forward("none", batch, seq)
    layout = TrainingLayout(dp=1, micro_batch=batch)
    predicted = [
        layer_activation_bytes(
            tiny_spec(),
            layout,
            FP32,
            seq_len=seq,
            flash_attention=True,
            moe_layer=False,
            recompute=mode,
            selective=SDPA_KERNEL,
        )
        for mode in ("selective", "none")
    ]
    assert measured > 0  # it keeps more than without recomputation
    assert measured == pytest.approx(predicted[0] - predicted[1], rel=0.05)


@requires_cuda
def test_predicted_peak_bounds_cuda_max_memory_allocated_within_15_percent():
    """On a GPU: the predicted allocation (states + activations + logits, no allowance) of an
    fp32 gpt step against ``torch.cuda.max_memory_allocated`` (written here without a GPU)."""
    config = dict(CONFIG, n_embd=1024, n_head=16, block_size=1024, vocab_size=8192)
    spec = train_model_spec(GPTConfig(**config), name="gpt")
    torch.cuda.reset_peak_memory_stats()
    model = GPT(GPTConfig(**config)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(config["vocab_size"], (8, config["block_size"]), device="cuda")
    for _ in range(2):  # the second step has the optimizer state allocated
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    measured = torch.cuda.max_memory_allocated()
    layout = TrainingLayout(dp=1, micro_batch=8)
    memory = memory_breakdown(spec, layout, seq_len=config["block_size"], precision=FP32)
    predicted = memory.total - memory.reserved
    assert measured == pytest.approx(predicted, rel=0.15), (measured, memory.to_dict())
