"""Activation recomputation (``train.recompute``): gradients bitwise those without it, and a
dispatch-mode count of what backward reran (no processes)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from overlapkit.train.models import GPT, GPTConfig
from overlapkit.train.parallel.recompute import (
    ATTENTION_OPS,
    apply_recompute,
    check_recompute_fits,
)
from overlapkit.train.run.loop import TrainConfig
from tests.cuda import requires_cuda

CONFIG = dict(n_layer=3, n_head=2, n_embd=16, block_size=16)
SDPA_KERNELS = {str(op) for op in ATTENTION_OPS}
# The forward kernels of a block (layer norms, linears, GELU, attention). Plain backward runs
# none of them (it runs mm, *_backward), so each one seen in backward was recomputed.
FORWARD_KERNELS = {"aten.native_layer_norm.default", "aten.addmm.default", "aten.gelu.default"}
FORWARD_KERNELS |= SDPA_KERNELS


class OpCount(TorchDispatchMode):
    """Counts every aten op dispatched while active (backward included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _backward(
    mode: str, layers: int | None, device: torch.device
) -> tuple[collections.Counter, list]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG)).to(device)
    chosen = apply_recompute(model.blocks, mode, layers)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    loss = GPT.loss(model(tokens), tokens)
    with OpCount() as count:
        loss.backward()
    assert len(chosen) == (0 if mode == "none" else layers or CONFIG["n_layer"])
    return count.ops, [p.grad for p in model.parameters()]


def _block_forward_ops(device: torch.device) -> collections.Counter:
    block = GPT(GPTConfig(**CONFIG)).blocks[0].to(device)
    x = torch.randn(2, 16, CONFIG["n_embd"], device=device)
    with OpCount() as count, torch.no_grad():
        block(x)
    return count.ops


def _kernels(ops: collections.Counter) -> dict[str, int]:
    return {op: n for op, n in ops.items() if op in FORWARD_KERNELS}


def _check_recompute_modes(device: torch.device) -> None:
    none_ops, none_grads = _backward("none", None, device)
    assert _kernels(none_ops) == {}  # the control: plain backward runs no forward kernel
    block = _kernels(_block_forward_ops(device))
    (sdpa,) = SDPA_KERNELS & set(block)  # the device's attention kernel
    assert block[sdpa] == 1 and block["aten.addmm.default"] == 6

    cases = {"selective": None, "full": None, "full:1": 1}
    for name, layers in cases.items():
        ops, grads = _backward(name.split(":")[0], layers, device)
        for a, b in zip(grads, none_grads, strict=True):
            assert torch.equal(a, b), name
        rerun = _kernels(ops)
        if name == "selective":
            # Only the attention core, once per block; everything else was saved.
            assert rerun == {sdpa: CONFIG["n_layer"]}
            continue
        k = layers or CONFIG["n_layer"]
        # Every recomputed block reran its forward up to the last activation backward reads
        # (torch's early stop skips the MLP's second linear: its output feeds only an add).
        expected = {op: k * n for op, n in block.items()}
        expected["aten.addmm.default"] -= k
        assert rerun == expected, name


def test_recompute_keeps_gradients_bitwise_and_reruns_only_what_its_mode_says():
    _check_recompute_modes(torch.device("cpu"))


@requires_cuda
def test_cuda_recompute_reruns_the_cuda_sdpa_kernel_and_keeps_gradients_bitwise():
    _check_recompute_modes(torch.device("cuda"))


def test_selective_policy_names_the_cpu_and_cuda_sdpa_kernels():
    names = SDPA_KERNELS
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in names
    assert "aten._scaled_dot_product_flash_attention.default" in names
    assert "aten._scaled_dot_product_efficient_attention.default" in names


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(recompute="sometimes"), r"train.recompute must be one of \['none', 'selective', "),
        (dict(recompute="full", recompute_layers=0), r"train.recompute_layers must be >= 1, got 0"),
        (dict(recompute="selective", recompute_layers=2), r"recompute_layers=2 .* needs train.rec"),
    ],
)
def test_bad_recompute_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**settings)


def test_recompute_layers_beyond_a_stage_and_selective_without_attention_are_refused():
    with pytest.raises(ValueError, match=r"recompute_layers \(5\) exceeds the 4 blocks of a stage"):
        check_recompute_fits("full", 5, blocks_per_stage=4, has_attention=True)
    with pytest.raises(ValueError, match=r"selective recomputes the attention core, and this"):
        check_recompute_fits("selective", None, blocks_per_stage=4, has_attention=False)
    check_recompute_fits("full", 4, blocks_per_stage=4, has_attention=False)
    model = GPT(GPTConfig(**CONFIG))
    with pytest.raises(ValueError, match=r"recompute_layers \(4\) exceeds the 3 blocks"):
        apply_recompute(model.blocks, "full", 4)
