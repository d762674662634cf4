"""A tiny mixture-of-experts GPT: gpt.py's blocks with a top-k routed feed-forward layer.

Every token is sent to the ``top_k`` experts its router scores highest and gets their outputs
weighted by the router's softmax probabilities, renormalised over the chosen ones (Mixtral's
rule). There is no capacity limit (no token is dropped) and no auxiliary load-balancing loss.

**Expert parallelism.** ``shard_experts(model, ep_mesh)`` keeps ``n_expert / ep`` experts per
rank (a contiguous slice, as a ``DTensor`` sharded on dim 0 over the ``ep`` mesh axis, so that
checkpoints and gradient reducers see the sharding). A forward then dispatches each token to the
rank holding its expert with ``all_to_all_single`` over the ``ep`` group, runs the local
experts, and returns the outputs with a second all-to-all; backward runs the two all-to-alls in
reverse (``overlapkit.inlayer.chunked_ep``). With ``ep_chunks > 1`` the tokens are cut into
that many chunks whose exchanges are pipelined with the experts, forward and backward. With
``ep = 1`` the same code runs locally. The gradient an expert receives is the sum over the tokens
of every rank of its ``ep``
group (each rank's loss counts once); the data-parallel reduction divides it accordingly
(``overlapkit.train.parallel.wrappers``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn import functional as F

from overlapkit.inlayer.chunked_ep import DispatchStats, dispatch_combine
from overlapkit.train.models.gpt import GPT, GPTConfig


@dataclass(kw_only=True)
class MoEConfig(GPTConfig):
    n_expert: int = 4
    """Experts per MoE layer (every block has one)."""
    top_k: int = 2
    """Experts each token is routed to."""
    expert_hidden: int | None = None
    """Hidden features of each expert; None means ``4 * n_embd`` (GPT-2's MLP)."""

    def __post_init__(self):
        super().__post_init__()
        for name in ("n_expert", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.n_expert:
            raise ValueError(
                f"MoEConfig.top_k ({self.top_k}) must be <= n_expert ({self.n_expert})"
            )
        if self.expert_hidden is not None and self.expert_hidden < 1:
            raise ValueError(
                f"MoEConfig.expert_hidden must be >= 1 or null, got {self.expert_hidden}"
            )


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


class Experts(nn.Module):
    """``n_expert`` two-layer GELU MLPs without biases, weights stacked on dim 0.

    ``w1`` is (E, C, H) and ``w2`` (E, H, C); under expert parallelism both are DTensors
    sharded on dim 0 and this rank computes its local slice.
    """

    def __init__(self, n_expert: int, n_embd: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_expert, n_embd, hidden))
        self.w2 = nn.Parameter(torch.empty(n_expert, hidden, n_embd))
        for weight in (self.w1, self.w2):
            nn.init.normal_(weight, mean=0.0, std=0.02)  # GPT-2's initialisation

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """``x`` (sum(counts), C) grouped by local expert, ``counts[e]`` rows for expert e."""
        w1, w2 = _local(self.w1), _local(self.w2)
        # Every expert runs, even on zero rows, so each weight gets a gradient every step
        # (DDP and the bucketer then need no unused-parameter handling).
        outs = [F.gelu(rows @ w1[e]) @ w2[e] for e, rows in enumerate(torch.split(x, list(counts)))]
        return torch.cat(outs)


class MoE(nn.Module):
    """Top-k routed feed-forward layer: ``forward(x (B, T, C)) -> (B, T, C)``."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.n_expert = config.n_expert
        self.top_k = config.top_k
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=False)
        self.experts = Experts(
            config.n_expert, config.n_embd, config.expert_hidden or 4 * config.n_embd
        )
        self.ep_group: dist.ProcessGroup | None = None
        self.ep_chunks = 1
        """Token chunks each dispatch and combine is pipelined in (``shard_experts``)."""
        self.stats = DispatchStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, C)
        probs = self.router(tokens).softmax(dim=-1)  # (N, E)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # One row per (token, choice), token-major: the chunks of a pipelined dispatch are
        # chunks of tokens.
        rows = tokens.repeat_interleave(self.top_k, dim=0)  # (N * k, C)
        out = dispatch_combine(
            rows,
            chosen.flatten(),
            self.n_expert,
            self.experts,
            group=self.ep_group,
            chunks=self.ep_chunks,
            stats=self.stats,
        )
        mixed = (out.view(*weights.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)
        return mixed.view(shape)


class MoEGPT(GPT):
    """gpt.py's causal transformer whose blocks' feed-forward layers are ``MoE`` layers."""

    config: MoEConfig

    def feed_forward(self, config: MoEConfig) -> nn.Module:
        return MoE(config)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]


def shard_experts(model: nn.Module, ep_mesh: DeviceMesh, *, chunks: int = 1) -> list[MoE]:
    """Keep this rank's slice of every MoE layer's experts and dispatch over ``ep_mesh``'s group.

    Every rank must hold the same full model (same seed): the slices are taken locally, with no
    communication. ``ep_mesh`` is the 1-D ``ep`` axis of the planner's mesh; ``chunks``
    (``parallel.plan.ep_chunks``) the token chunks each exchange is pipelined in.

    Returns:
        list[MoE]: the layers now expert-parallel.

    Raises:
        ValueError: the model has no MoE layer, or the ``ep`` size does not divide its
            ``n_expert``.
    """
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError(
            f"expert parallelism needs a mixture-of-experts model (model=moe_tiny); "
            f"{type(model).__name__} has no MoE layer"
        )
    ep, index = ep_mesh.size(), ep_mesh.get_local_rank()
    group = ep_mesh.get_group()
    ranks = tuple(dist.get_process_group_ranks(group))
    for layer in layers:
        if layer.n_expert % ep:
            raise ValueError(
                f"parallel.plan.ep ({ep}) must divide model.config.n_expert ({layer.n_expert})"
            )
        local = layer.n_expert // ep
        experts = layer.experts
        for name in ("w1", "w2"):
            full = getattr(experts, name).detach()
            shard = full[index * local : (index + 1) * local].clone()
            sharded = DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(sharded))
        layer.ep_group = group
        layer.ep_chunks = chunks
        layer.stats = DispatchStats(ranks=ranks)
    return layers
