"""``tp_comm=split``: the local micro-batch cut into chunks, one chunk's collective in flight
while another chunk's matmul runs (DeepSpeed Domino's batch split, here inside each layer).

The ``B`` sequences of the micro-batch are cut into ``chunks`` equal parts along dim 0:

- ``gather_matmul``: every chunk's all-gather is issued at once; chunk ``k``'s matmul runs as soon
  as its gather is done, while the gathers of chunks ``k+1 ..`` are in flight. The first chunk's
  gather is exposed.
- ``matmul_scatter``: chunk ``k``'s reduce-scatter is issued as soon as its matmul is done and is
  in flight while chunk ``k+1``'s matmul runs; the last chunk's is in flight under the caller's
  ``while_waiting`` work (a column-parallel backward's weight gradient).

Each chunk's values are those of the whole batch's (rows of a matmul do not mix), so the results
equal ``sync``'s up to the GEMM's blocking; the cost is ``chunks`` times the collective launches
and GEMMs ``chunks`` times smaller.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from overlapkit.inlayer.tp_collectives import TpGroup
from overlapkit.inlayer.tp_sync import Work


def check_chunks(chunks: int, batch: int) -> None:
    """Refuse a split the micro-batch does not divide into.

    Raises:
        ValueError: ``chunks`` below 1 or not dividing ``batch``.
    """
    if chunks < 1 or batch % chunks:
        raise ValueError(
            f"tp_chunks ({chunks}) must be >= 1 and divide the micro-batch's {batch} sequences "
            "(tp_comm=split cuts them into equal chunks)"
        )


class SplitSchedule:
    """``tp_comm=split`` over ``chunks`` chunks of the micro-batch."""

    __slots__ = ("chunks", "group")

    def __init__(self, group: TpGroup, chunks: int):
        if chunks < 1:
            raise ValueError(f"tp_chunks must be >= 1, got {chunks}")
        self.group = group
        self.chunks = chunks

    def _split(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        check_chunks(self.chunks, tensor.shape[0])
        return tensor.chunk(self.chunks, dim=0)

    def gather_matmul(
        self, shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pending = [self.group.all_gather(part) for part in self._split(shard)]
        outputs, gathered = [], []
        for chunk in pending:
            full = chunk.wait()
            gathered.append(full)
            outputs.append(F.linear(full, weight, bias))
        return torch.cat(outputs), torch.cat(gathered)

    def matmul_scatter(
        self, h: torch.Tensor, weight: torch.Tensor, while_waiting: Work | None = None
    ) -> torch.Tensor:
        pending = [self.group.reduce_scatter(F.linear(part, weight)) for part in self._split(h)]
        if while_waiting is not None:  # under the last chunk's reduce-scatter
            while_waiting()
        return torch.cat([chunk.wait() for chunk in pending])
