"""Block discovery for ok.fsdp, and the small models the FSDP tests share (no processes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from overlapkit.fsdp import discover_blocks, resolve_blocks

VOCAB = 51  # odd, so the embedding's rows shard unevenly (FSDP2 pads the last shard)
SEQ = 8


def make_mlp(blocks: int = 4, width: int = 64, seed: int = 0) -> nn.Sequential:
    """``blocks`` x (Linear(width) + ReLU), each block an ``nn.Sequential``; seeded weights."""
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)]
    return nn.Sequential(*layers)


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP, as in a GPT layer."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Embedding, positions, ``layers`` blocks (a ModuleList), final norm, head: a tiny GPT."""

    def __init__(self, layers: int = 3, dim: int = 32, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, dim))
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for layer in self.layers:
            x = layer(x)
        # Flattened first, so the logits (B*T, vocab) are not a view (FSDP2 warns about views).
        return self.head(self.norm(x).flatten(0, 1))


def make_transformer(seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer()


def test_discovers_the_blocks_of_an_mlp_sequential():
    model = make_mlp(blocks=8)
    assert discover_blocks(model) == list(model)


def test_discovers_transformer_layers_not_the_inner_mlp():
    model = make_transformer()
    assert resolve_blocks(model, None) == list(model.layers)


def test_largest_list_wins_over_a_smaller_one():
    model = nn.Module()
    model.small, model.large = make_mlp(blocks=2, width=8), make_mlp(blocks=3, width=16)
    assert discover_blocks(model) == list(model.large)


def test_blocks_by_class_name_and_class_give_the_same_outermost_modules():
    model = make_transformer()
    assert resolve_blocks(model, ["Block"]) == list(model.layers)
    assert resolve_blocks(model, Block) == list(model.layers)
    # Linear matches inside the blocks and at the root: every Linear is a block.
    linears = resolve_blocks(model, nn.Linear)
    assert len(linears) == 3 * 4 + 1


def test_blocks_as_modules_keep_the_given_order():
    model = make_mlp(blocks=4)
    given = [model[2], model[0], model[1], model[3]]
    assert resolve_blocks(model, given) == given
    transformer = make_transformer()
    assert resolve_blocks(transformer, transformer.layers) == list(transformer.layers)


def test_blocks_matching_nothing_name_the_value():
    with pytest.raises(ValueError, match=r"blocks=\['DecoderLayer'\] matches no sub-module"):
        resolve_blocks(make_mlp(), ["DecoderLayer"])


def test_model_without_repeated_blocks_asks_for_blocks():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="pass blocks="):
        discover_blocks(model)


def test_rejects_foreign_nested_and_duplicate_block_modules():
    model = make_mlp()
    with pytest.raises(ValueError, match=r"blocks\[0\] \(Linear\) is not a sub-module"):
        resolve_blocks(model, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="nested inside another block"):
        resolve_blocks(model, [model[0], model[0][0]])
    with pytest.raises(ValueError, match="more than once"):
        resolve_blocks(model, [model[0], model[0]])
    with pytest.raises(ValueError, match="the model itself"):
        resolve_blocks(model, [model])


def test_rejects_blocks_of_the_wrong_type():
    with pytest.raises(TypeError, match="blocks must be"):
        resolve_blocks(make_mlp(), 3)
    with pytest.raises(TypeError, match="only module classes/class names or only modules"):
        resolve_blocks(make_mlp(), ["Linear", make_mlp()[0]])
