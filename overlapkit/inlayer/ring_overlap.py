"""``tp_comm=ring``: all-gather + matmul and matmul + reduce-scatter decomposed into ``tp - 1``
point-to-point steps around the ring of tp ranks ("collective matmul", as JAX/XLA and torch's
symmetric-memory ``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` do on CUDA).

The sequence is ``tp`` chunks of ``T/tp`` tokens; rank ``r`` starts with chunk ``r``.

- ``gather_matmul``: at step ``s`` the chunk in hand, ``(r - s) mod tp``, is sent on to rank
  ``r+1`` while its matmul runs; the chunk from ``r-1`` arrives for step ``s+1``. Only the
  transfers are on the ring; every matmul has its input when it starts.
- ``matmul_scatter``: at step ``s`` rank ``r`` computes the partial product of chunk
  ``(r - 1 - s) mod tp``, adds the running sum that ``r-1`` sent for that chunk, and sends the sum
  on to ``r+1``; the matmul of step ``s+1`` runs while that transfer is in flight, and the
  caller's ``while_waiting`` work under the last one. After ``tp - 1`` transfers each rank holds
  the whole sum of its own chunk ``r``.

Sums run around the ring rather than in the collective's own order, so results equal ``sync``'s
up to float rounding.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from overlapkit.inlayer.tp_collectives import SEQ_DIM, TpGroup
from overlapkit.inlayer.tp_sync import Work


class RingSchedule:
    """``tp_comm=ring`` over the group's ``tp`` ranks."""

    __slots__ = ("group",)

    def __init__(self, group: TpGroup):
        self.group = group

    def gather_matmul(
        self, shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size, rank = self.group.size, self.group.rank
        chunks: list[torch.Tensor | None] = [None] * size
        outputs: list[torch.Tensor | None] = [None] * size
        held = shard.contiguous()
        for step in range(size):
            arriving = self.group.shift(held) if step < size - 1 else None
            index = (rank - step) % size
            chunks[index] = held
            outputs[index] = F.linear(held, weight, bias)
            if arriving is not None:
                held = arriving.wait()
        return torch.cat(outputs, SEQ_DIM), torch.cat(chunks, SEQ_DIM)

    def matmul_scatter(
        self, h: torch.Tensor, weight: torch.Tensor, while_waiting: Work | None = None
    ) -> torch.Tensor:
        size, rank = self.group.size, self.group.rank
        parts = h.chunk(size, SEQ_DIM)
        partial = F.linear(parts[(rank - 1) % size], weight)
        for step in range(1, size):
            running = self.group.shift(partial)
            partial = F.linear(parts[(rank - 1 - step) % size], weight)
            if step == size - 1 and while_waiting is not None:  # under the last transfer
                while_waiting()
                while_waiting = None
            partial = partial + running.wait()
        if while_waiting is not None:  # tp = 1: no transfer to run it under
            while_waiting()
        return partial
