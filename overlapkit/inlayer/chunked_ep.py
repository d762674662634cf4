"""Expert parallelism's dispatch and combine, chunked by tokens and pipelined with the experts.

An expert-parallel MoE layer sends each routed row (one per token and chosen expert) to the rank
holding its expert (**dispatch**, an ``all_to_all_single`` over the ``ep`` group), runs the local
experts, and sends the outputs back (**combine**). Synchronously the two exchanges and the
experts run one after the other. ``dispatch_combine(..., chunks=N)`` cuts the rows into ``N``
contiguous chunks (of tokens, when the rows are token-major) and pipelines them:

- forward: chunk ``k+1``'s dispatch and chunk ``k-1``'s combine are in flight while chunk ``k``'s
  experts run (``async_op=True``; a chunk's rows are waited for only when its experts start);
- backward: the same in reverse. Each exchange is an ``_Issue`` node (forward: start the
  all-to-all; backward: wait for the reverse one) followed by a ``_Wait`` node (forward: wait;
  backward: start the reverse all-to-all of the gradient). Autograd's engine runs ready nodes in
  decreasing creation order, so every chunk's combine gradient starts at once, and chunk ``k``'s
  expert backward runs while chunk ``k-1``'s combine gradient and chunk ``k+1``'s dispatch
  gradient are in flight.

Host syncs: one per layer, in forward: the split sizes of every chunk at once (one all-to-all of
the ``(chunks, experts)`` routing counts, then one ``tolist``); none per chunk (the counts are
summed with ``scatter_add``, as CUDA's ``bincount`` syncs, and each chunk's regrouping
permutation is built on the device) and none in backward. On NCCL the async collectives run on
the process group's own stream and ``wait()`` makes the compute stream wait on their event (no
host sync); on gloo they run on the group's worker threads. ``chunks=1`` is the synchronous
dispatch (issue, then wait at once), by the same code.

Every exchange is issued inside ``comm_dim("ep")`` and waited inside ``comm_wait("all_to_all")``, so
``overlapkit report`` attributes it to ``ep`` on any backend and does not count the waits as
compute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from overlapkit.group.dim_labels import comm_dim, comm_wait

Experts = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]
"""``experts(rows, counts)``: rows grouped by local expert (``counts[e]`` rows for expert ``e``,
in local expert order) to their outputs, one per row, in the same order."""


@dataclass(slots=True)
class DispatchStats:
    """What one MoE layer's exchanges did on this rank (forward and backward)."""

    ranks: tuple[int, ...] = ()
    """Global ranks of the ``ep`` group the layer dispatches over; empty while local."""
    all_to_all_calls: int = 0
    """Token exchanges (dispatch and combine, both directions); the counts' exchange is not one."""
    tokens_sent: int = 0
    tokens_received: int = 0
    calls_by_group: dict[tuple[int, ...], int] = field(default_factory=dict)

    def record(self, sent: int, received: int) -> None:
        """Count one token exchange of ``sent`` rows out and ``received`` rows in."""
        self.all_to_all_calls += 1
        self.calls_by_group[self.ranks] = self.calls_by_group.get(self.ranks, 0) + 1
        self.tokens_sent += sent
        self.tokens_received += received


class _Link:
    """One exchange of a chunk: its splits, and the forward and reverse all-to-alls in flight."""

    __slots__ = ("group", "in_splits", "out_splits", "pending", "stats")

    def __init__(
        self,
        in_splits: list[int],
        out_splits: list[int],
        group: dist.ProcessGroup,
        stats: DispatchStats,
    ):
        self.in_splits, self.out_splits = in_splits, out_splits
        self.group, self.stats = group, stats
        self.pending: tuple[dist.Work, torch.Tensor] | None = None

    def start(self, x: torch.Tensor, *, reverse: bool) -> torch.Tensor:
        """Start the all-to-all of ``x`` (backwards with ``reverse``); its output buffer."""
        send, recv = (
            (self.out_splits, self.in_splits) if reverse else (self.in_splits, self.out_splits)
        )
        out = x.new_empty((sum(recv), *x.shape[1:]))
        with comm_dim("ep"):
            work = dist.all_to_all_single(
                out, x.contiguous(), recv, send, group=self.group, async_op=True
            )
        self.stats.record(sum(send), sum(recv))
        self.pending = (work, out)
        return out

    def finish(self) -> torch.Tensor:
        """Wait for the exchange in flight; its output."""
        assert self.pending is not None, "an exchange is waited for once, after it started"
        work, out = self.pending
        self.pending = None
        # Not compute, even inside an autograd node (the report); timed by the live monitor.
        with comm_wait("all_to_all"):
            work.wait()
        return out


class _Issue(torch.autograd.Function):
    """Forward: start the exchange, return its (not yet filled) buffer. Backward: wait for the
    reverse exchange ``_Wait`` started and return its result."""

    @staticmethod
    def forward(ctx, x, link: _Link):
        ctx.link = link
        return link.start(x, reverse=False)

    @staticmethod
    def backward(ctx, _placeholder):
        return ctx.link.finish(), None


class _Wait(torch.autograd.Function):
    """Forward: wait for the exchange ``_Issue`` started. Backward: start the reverse exchange
    of the gradient; ``_Issue``'s backward waits for it."""

    @staticmethod
    def forward(ctx, buffer, link: _Link):
        ctx.link = link
        link.finish()
        return buffer.view_as(buffer)

    @staticmethod
    def backward(ctx, grad):
        ctx.link.start(grad, reverse=True)
        # What _Issue's backward receives only orders it after this node; it returns the
        # reverse exchange's result instead.
        return grad, None


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One chunk's routing: its rows sorted by expert, and the exchange's split sizes."""

    rows: slice
    order: torch.Tensor
    """The chunk's rows sorted by destination expert (stable)."""
    send: list[int]
    """Rows sent to each ep rank (dispatch)."""
    recv: list[int]
    """Rows received from each ep rank (dispatch)."""
    by_expert: torch.Tensor
    """Received rows, (source, expert)-major, reordered (expert, source)-major."""
    expert_counts: list[int]
    """Received rows per local expert."""


def _regroup(counts: torch.Tensor, total: int) -> torch.Tensor:
    """The row order that turns (source, expert)-major rows into (expert, source)-major.

    ``counts`` (sources, experts) on the rows' device: rows source ``s`` sent for local expert
    ``e``; ``total`` their sum, known on the host (``repeat_interleave`` with ``output_size``
    needs no host sync).
    """
    flat = counts.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts)  # each block's first received row
    block_counts, block_starts = counts.t().flatten(), starts.t().flatten()  # (expert, source)
    placed = torch.cumsum(block_counts, 0) - block_counts  # each block's first output row
    start = torch.repeat_interleave(block_starts, block_counts, output_size=total)
    first = torch.repeat_interleave(placed, block_counts, output_size=total)
    return start + torch.arange(total, device=counts.device) - first


def _plan(
    expert_of: torch.Tensor, n_expert: int, chunks: int, group: dist.ProcessGroup
) -> list[_Chunk]:
    """Every chunk's routing, from one exchange of all chunks' routing counts and one host sync
    (the split sizes); everything else stays on the rows' device."""
    ep = group.size()
    local = n_expert // ep
    slices, at = [], 0
    for piece in torch.tensor_split(expert_of, chunks):
        slices.append(slice(at, at + len(piece)))
        at += len(piece)
    # Rows per (chunk, expert), out of place and without bincount (which syncs on CUDA).
    counts = torch.stack(
        [
            expert_of.new_zeros(n_expert).scatter_add(
                0, expert_of[s], torch.ones_like(expert_of[s])
            )
            for s in slices
        ]
    )
    # Destination-major: rank r receives every chunk's counts for its own experts.
    send_counts = counts.view(chunks, ep, local).transpose(0, 1).contiguous()
    recv_counts = torch.empty_like(send_counts)
    with comm_dim("ep"):
        dist.all_to_all_single(recv_counts, send_counts, group=group)
    sent, got = torch.stack([send_counts, recv_counts]).tolist()  # (rank, chunk, expert) each
    plans = []
    for k, rows in enumerate(slices):
        received = [got[r][k] for r in range(ep)]
        recv = [sum(per_source) for per_source in received]
        plans.append(
            _Chunk(
                rows=rows,
                order=expert_of[rows].argsort(stable=True),
                send=[sum(sent[r][k]) for r in range(ep)],
                recv=recv,
                by_expert=_regroup(recv_counts[:, k], sum(recv)),
                expert_counts=[sum(col) for col in zip(*received, strict=True)],
            )
        )
    return plans


def dispatch_combine(
    x: torch.Tensor,
    expert_of: torch.Tensor,
    n_expert: int,
    experts: Experts,
    *,
    group: dist.ProcessGroup | None,
    chunks: int = 1,
    stats: DispatchStats | None = None,
) -> torch.Tensor:
    """Every row of ``x`` through its expert, wherever the expert lives; outputs in ``x``'s order.

    Args:
        x (Tensor): ``(R, C)`` routed rows (one per token and chosen expert; token-major, so
            that the chunks are chunks of tokens).
        expert_of (Tensor): ``(R,)`` long, the global expert of each row.
        n_expert (int): experts in the layer; ep rank ``r`` holds experts ``r * L .. (r+1) * L
            - 1`` with ``L = n_expert / ep``.
        experts (Experts): runs this rank's ``L`` experts (see ``Experts``).
        group (ProcessGroup | None): the ``ep`` group; None (or one rank) runs every expert
            locally, with no exchange.
        chunks (int): row chunks pipelined with the experts (1: synchronous exchanges).
        stats (DispatchStats | None): counts the exchanges when given.

    Returns:
        Tensor: ``(R, C')``, row ``i`` the output of ``expert_of[i]`` on ``x[i]``.

    Raises:
        ValueError: ``chunks`` below 1 or above the rows, or ``ep`` not dividing ``n_expert``.
    """
    if group is None or group.size() == 1:
        order = expert_of.argsort(stable=True)
        counts = torch.bincount(expert_of, minlength=n_expert).tolist()
        return experts(x[order], counts)[order.argsort()]
    _check(chunks, len(x), n_expert, group.size())
    stats = stats if stats is not None else DispatchStats()
    plans = _plan(expert_of, n_expert, chunks, group)
    links = [_Link(p.send, p.recv, group, stats) for p in plans]
    buffers = [_Issue.apply(x[plans[0].rows][plans[0].order], links[0])]
    combined = []
    for k, plan in enumerate(plans):
        received = _Wait.apply(buffers[k], links[k])
        if k + 1 < len(plans):  # the next chunk's rows travel while this chunk's experts run
            nxt = plans[k + 1]
            buffers.append(_Issue.apply(x[nxt.rows][nxt.order], links[k + 1]))
        out = experts(received[plan.by_expert], plan.expert_counts)
        back = _Link(plan.recv, plan.send, group, stats)
        # The inverse permutation by indexing, not by writing into a tensor: selective
        # recomputation caches op outputs and refuses one changed in place.
        combined.append((_Issue.apply(out[plan.by_expert.argsort()], back), back, plan))
    outputs = [_Wait.apply(buffer, back)[plan.order.argsort()] for buffer, back, plan in combined]
    return torch.cat(outputs)


def _check(chunks: int, rows: int, n_expert: int, ep: int) -> None:
    if n_expert % ep:
        raise ValueError(f"parallel.plan.ep ({ep}) must divide the layer's n_expert ({n_expert})")
    if not 1 <= chunks <= max(rows, 1):
        raise ValueError(
            f"parallel.plan.ep_chunks={chunks} must be between 1 and the rows each rank routes "
            f"per micro-batch ({rows}: tokens x top_k)"
        )
