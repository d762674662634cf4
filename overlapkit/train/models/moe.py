"""A tiny mixture-of-experts GPT: gpt.py's blocks with a top-k routed feed-forward layer.

Every token is sent to the ``top_k`` experts its router scores highest and gets their outputs
weighted by the router's softmax probabilities, renormalised over the chosen ones (Mixtral's
rule). There is no capacity limit (no token is dropped) and no auxiliary load-balancing loss.

**Expert parallelism.** ``shard_experts(model, ep_mesh)`` keeps ``n_expert / ep`` experts per
rank (a contiguous slice, as a ``DTensor`` sharded on dim 0 over the ``ep`` mesh axis, so that
checkpoints and gradient reducers see the sharding). A forward then dispatches each token to the
rank holding its expert with ``all_to_all_single`` over the ``ep`` group (split sizes from the
routing counts, exchanged first), runs the local experts, and returns the outputs with a second
all-to-all; backward runs the two all-to-alls in reverse. With ``ep = 1`` the same code runs
locally. The gradient an expert receives is the sum over the tokens of every rank of its ``ep``
group (each rank's loss counts once); the data-parallel reduction divides it accordingly
(``overlapkit.train.parallel.wrappers``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn import functional as F

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


@dataclass(slots=True)
class DispatchStats:
    """What one MoE layer's all-to-alls did on this rank (forward and backward)."""

    ranks: tuple[int, ...] = ()
    """Global ranks of the ``ep`` group the layer dispatches over; empty while local."""
    all_to_all_calls: int = 0
    tokens_sent: int = 0
    tokens_received: int = 0
    calls_by_group: dict[tuple[int, ...], int] = field(default_factory=dict)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; backward sends the gradients the reverse way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, stats):
        ctx.splits, ctx.group, ctx.stats = (out_splits, in_splits), group, stats
        return _all_to_all(x, out_splits, in_splits, group, stats)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return (
            _all_to_all(grad, in_splits, out_splits, ctx.group, ctx.stats),
            None,
            None,
            None,
            None,
        )


def _all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    stats: DispatchStats,
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    stats.all_to_all_calls += 1
    stats.calls_by_group[stats.ranks] = stats.calls_by_group.get(stats.ranks, 0) + 1
    stats.tokens_sent += sum(in_splits)
    stats.tokens_received += sum(out_splits)
    return out


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


def _regroup(counts: torch.Tensor) -> torch.Tensor:
    """The row order that turns (source, expert)-major rows into (expert, source)-major.

    ``counts`` (sources, experts) holds how many rows each source sent for each expert.
    """
    starts = torch.cumsum(counts.flatten(), 0) - counts.flatten()
    starts = starts.view_as(counts)
    pieces = [
        torch.arange(int(starts[s, e]), int(starts[s, e] + counts[s, e]))
        for e in range(counts.shape[1])
        for s in range(counts.shape[0])
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


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
        self.stats = DispatchStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, C)
        probs = self.router(tokens).softmax(dim=-1)  # (N, E)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # Assignments sorted by expert (stable: a token's rows keep their order).
        order = chosen.flatten().argsort(stable=True)  # (N * k,)
        counts = torch.bincount(chosen.flatten(), minlength=self.n_expert)  # (E,)
        token_of = order // self.top_k
        out = self._run_experts(tokens[token_of], counts)
        weighted = out * weights.flatten()[order].unsqueeze(1)
        return torch.zeros_like(tokens).index_add(0, token_of, weighted).view(shape)

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Outputs for ``rows`` (sorted by expert, ``counts[e]`` each), wherever they live."""
        if self.ep_group is None:
            return self.experts(rows, counts.tolist())
        group, stats = self.ep_group, self.stats
        ep = group.size()
        # recv[s, e]: rows source s sends to this rank's local expert e.
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=group)
        recv = recv.view(ep, self.n_expert // ep)
        send_splits = counts.view(ep, -1).sum(dim=1).tolist()
        recv_splits = recv.sum(dim=1).tolist()
        received = _AllToAll.apply(rows, recv_splits, send_splits, group, stats)
        by_expert = _regroup(recv)
        out = self.experts(received[by_expert], recv.sum(dim=0).tolist())
        # The inverse permutation, without writing into a tensor: selective recomputation
        # caches op outputs and refuses one that was changed in place.
        back = by_expert.argsort()
        return _AllToAll.apply(out[back], send_splits, recv_splits, group, stats)


class MoEGPT(GPT):
    """gpt.py's causal transformer whose blocks' feed-forward layers are ``MoE`` layers."""

    config: MoEConfig

    def feed_forward(self, config: MoEConfig) -> nn.Module:
        return MoE(config)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]


def shard_experts(model: nn.Module, ep_mesh: DeviceMesh) -> list[MoE]:
    """Keep this rank's slice of every MoE layer's experts and dispatch over ``ep_mesh``'s group.

    Every rank must hold the same full model (same seed): the slices are taken locally, with no
    communication. ``ep_mesh`` is the 1-D ``ep`` axis of the planner's mesh.

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
        layer.stats = DispatchStats(ranks=ranks)
    return layers
