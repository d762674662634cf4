"""ok.fsdp rejects bad arguments before touching the model, naming the value (no processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

import overlapkit as ok
from overlapkit.fsdp import resolve_mixed_precision
from tests.test_fsdp_blocks import make_mlp


@pytest.mark.parametrize("prefetch", [3, -1, 8])
def test_rejects_prefetch_outside_0_1_2(prefetch):
    with pytest.raises(ValueError, match=rf"prefetch={prefetch} is not supported.*\[0, 1, 2\]"):
        ok.fsdp(make_mlp(), prefetch=prefetch)


@pytest.mark.parametrize("prefetch", [True, 1.0, "1", None])
def test_rejects_prefetch_that_is_not_an_int(prefetch):
    with pytest.raises(TypeError, match=rf"prefetch must be an int.*got {prefetch!r}"):
        ok.fsdp(make_mlp(), prefetch=prefetch)


def test_rejects_unknown_mixed_precision():
    with pytest.raises(ValueError, match=r"unknown mixed_precision='fp8'.*\[None, 'bf16'\]"):
        ok.fsdp(make_mlp(), mixed_precision="fp8")


def test_bf16_means_bf16_parameters_and_fp32_reduction():
    policy = resolve_mixed_precision("bf16")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    custom = MixedPrecisionPolicy(param_dtype=torch.float16)
    assert resolve_mixed_precision(custom) is custom
    assert resolve_mixed_precision(None) == MixedPrecisionPolicy()


def test_rejects_a_reshard_after_forward_neither_bool_nor_int_before_a_process_group():
    with pytest.raises(TypeError, match="reshard_after_forward must be a bool, an int .* got 2.0"):
        ok.fsdp(make_mlp(), reshard_after_forward=2.0)


def test_rejects_blocks_matching_nothing_before_needing_a_process_group():
    with pytest.raises(ValueError, match=r"blocks=\['Attention'\] matches no sub-module"):
        ok.fsdp(make_mlp(), blocks=["Attention"])


def test_asks_for_a_process_group_when_none_is_initialised():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"ok.fsdp needs an initialised process group"):
        ok.fsdp(make_mlp())


def test_fsdp_stats_rejects_a_model_not_from_ok_fsdp():
    with pytest.raises(TypeError, match=r"ok.fsdp_stats takes the model returned by ok.fsdp"):
        ok.fsdp_stats(make_mlp())
