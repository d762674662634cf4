"""Model zoo: shapes, repeated blocks for FSDP, configuration errors that name the field, and
the workload the doctor and the benchmarks time."""

from __future__ import annotations

import math

import pytest
import torch

from overlapkit.train.models import GPT, MLP, GPTConfig, MLPConfig
from overlapkit.train.models.workload import DEFAULT_SIZES, make_workload


def test_gpt_maps_tokens_to_logits_and_starts_near_uniform():
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (3, 17))
    logits = model(tokens[:, :-1])
    assert logits.shape == (3, 16, config.vocab_size)
    # GPT-2 initialisation: the first loss is close to log(vocab_size).
    assert GPT.loss(logits, tokens[:, 1:]).item() == pytest.approx(math.log(256), rel=0.05)
    assert len(model.blocks) == 2 and model.lm_head.weight is model.wte.weight


def test_gpt_refuses_sequences_longer_than_block_size():
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4))
    with pytest.raises(ValueError, match="sequence length 5 exceeds GPTConfig.block_size \\(4\\)"):
        model(torch.zeros(1, 5, dtype=torch.long))


def test_gpt_config_names_the_invalid_field():
    with pytest.raises(ValueError, match=r"n_embd \(30\) must be divisible by n_head \(4\)"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="GPTConfig.n_layer must be >= 1, got 0"):
        GPTConfig(n_layer=0)


def test_mlp_has_one_block_per_layer_and_keeps_width():
    model = MLP(MLPConfig(width=8, n_layer=3))
    assert len(model.blocks) == 3
    assert model(torch.randn(2, 8)).shape == (2, 8)
    with pytest.raises(ValueError, match="MLPConfig.width must be >= 1, got 0"):
        MLPConfig(width=0)


@pytest.mark.parametrize(("model", "items"), [("mlp", 4), ("gpt_tiny", 4 * 16)])
def test_workload_models_are_alike_everywhere_and_batches_differ_per_rank(model, items):
    sizes = {"layers": 2, "width": 32, "batch": 4, "seq_len": 16}
    rank0, rank1 = (make_workload(model, rank=r, **sizes) for r in (0, 1))
    first, again, on_rank1 = rank0.new_model(), rank0.new_model(), rank1.new_model()
    for a, b, c in zip(first.parameters(), again.parameters(), on_rank1.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert rank0.loss(first).item() != rank1.loss(first).item()
    assert rank0.loss(first).item() == make_workload(model, rank=0, **sizes).loss(first).item()
    assert rank0.items == items


def test_workload_sizes_are_the_defaults_the_doctor_and_benchmarks_time():
    mlp = make_workload("mlp", rank=0, **DEFAULT_SIZES["mlp"]).new_model()
    assert len(mlp.blocks) == 8 and mlp.blocks[0][0].in_features == 1024
    gpt = make_workload("gpt_tiny", rank=0, **DEFAULT_SIZES["gpt_tiny"])
    assert gpt.items == 2 * 64 and len(gpt.new_model().blocks) == 4


def test_workload_names_the_unknown_model():
    with pytest.raises(ValueError, match=r"one of \['mlp', 'gpt_tiny'\], got 'resnet'"):
        make_workload("resnet", rank=0, layers=1, width=8, batch=1)
