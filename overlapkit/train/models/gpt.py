"""A tiny GPT after nanoGPT's ``model.py``: token + position embeddings, pre-norm blocks.

The attention has separate ``q``, ``k`` and ``v`` projections (as torchtitan's llama) rather than
nanoGPT's fused ``c_attn``: column-wise tensor parallelism shards each projection's output
features, which then hold whole heads of q, k and v alike (a fused weight's contiguous shards
would mix q with k). A subclass changes the feed-forward part of every block by overriding
``feed_forward`` (the mixture of experts in ``moe.py`` does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    """Tokens; 256 covers raw bytes."""
    block_size: int = 128
    """Longest sequence the position embedding covers."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    """Model width; must be divisible by ``n_head``."""

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{type(self).__name__}.{name} must be >= 1, got {getattr(self, name)}"
                )
        if self.n_embd % self.n_head:
            raise ValueError(
                f"{type(self).__name__}.n_embd ({self.n_embd}) must be divisible by n_head "
                f"({self.n_head})"
            )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA with a causal mask; ``(B, nh, T, hs)`` each. Looked up in ``F`` per call, so
    torch's ``context_parallel`` (which patches ``F.scaled_dot_product_attention``) applies."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.q = nn.Linear(config.n_embd, config.n_embd)
        self.k = nn.Linear(config.n_embd, config.n_embd)
        self.v = nn.Linear(config.n_embd, config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        # The attention core (q, k, v) -> y; context parallelism replaces it
        # (overlapkit.train.parallel.context_parallel).
        self.attend = causal_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, nh, T, hs); under tensor parallelism nh counts this rank's heads only, and under
        # sequence parallelism x holds T/tp tokens that q, k and v gather back to T.
        q, k, v = (
            p(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
            for p in (self.q, self.k, self.v)
        )
        y = self.attend(q, k, v)
        return self.proj(y.transpose(1, 2).flatten(2))


def dense_feed_forward(config: GPTConfig) -> nn.Module:
    """GPT-2's MLP: ``Linear(C, 4C)``, GELU, ``Linear(4C, C)``."""
    return nn.Sequential(
        nn.Linear(config.n_embd, 4 * config.n_embd),
        nn.GELU(),
        nn.Linear(4 * config.n_embd, config.n_embd),
    )


class Block(nn.Module):
    def __init__(self, config: GPTConfig, mlp: nn.Module):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Causal language model: ``forward(idx (B, T) long) -> logits (B, T, vocab_size)``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(
            Block(config, self.feed_forward(config)) for _ in range(config.n_layer)
        )
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)

    def feed_forward(self, config: GPTConfig) -> nn.Module:
        """The feed-forward part of one block (called once per block)."""
        return dense_feed_forward(config)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's initialisation (as nanoGPT): N(0, 0.02) weights, zero biases.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab_size) of ``idx`` (B, T) long; ``pos`` (T,) long, the tokens'
        positions in their sequence (None: ``0 .. T-1``; a context-parallel shard passes its own).

        A pipeline stage (``overlapkit.train.parallel.pipeline_parallel``) is a GPT without the
        parts other stages run: without ``wte`` its input is the previous stage's activations (B, T,
        n_embd), without ``lm_head`` its output is (B, T, n_embd); the blocks of other stages are
        ``nn.Identity``.
        """
        x = idx if self.wte is None else self.embed(idx, pos)
        for block in self.blocks:
            x = block(x)
        return x if self.lm_head is None else self.lm_head(self.ln_f(x))

    def embed(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Token plus position embeddings (B, T, n_embd) of ``idx`` (B, T) long at ``pos``."""
        seq_len = idx.shape[1]
        if seq_len > self.config.block_size:
            raise ValueError(
                f"sequence length {seq_len} exceeds {type(self.config).__name__}.block_size "
                f"({self.config.block_size})"
            )
        if pos is None:
            pos = torch.arange(seq_len, device=idx.device)
        return self.wte(idx) + self.wpe(pos)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy; ``targets`` (B, T) long."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
