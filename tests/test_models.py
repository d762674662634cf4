"""Model zoo: shapes, repeated blocks for FSDP, and configuration errors that name the field."""

from __future__ import annotations

import math

import pytest
import torch

from overlapkit.train.models import GPT, MLP, GPTConfig, MLPConfig


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
