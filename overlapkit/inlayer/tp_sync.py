"""How a tensor-parallel linear layer's matmuls meet its collectives: the contract, and ``sync``.

Column- and row-parallel layers under sequence parallelism need two fused steps, each used in
forward by one kind of layer and in backward by the other:

- ``gather_matmul(shard, weight, bias)``: the ``(B, T/tp, in)`` shards all-gathered along the
  sequence to ``x`` ``(B, T, in)``, then ``x @ weight.T (+ bias)``; returns the product and ``x``
  (a column-parallel forward; a row-parallel backward, with the gradient as ``shard``);
- ``matmul_scatter(h, weight)``: ``h @ weight.T`` ``(B, T, out)``, partial over the group,
  reduce-scattered along the sequence to this rank's ``(B, T/tp, out)`` of the sum (a
  row-parallel forward; a column-parallel backward).

``weight`` is ``(out, in)`` as ``F.linear`` takes it. The schedules compute the same values and
differ in how the collective meets the matmul: ``SyncSchedule`` (``tp_comm=sync``) runs one whole
collective before or after one whole matmul; ``split_overlap`` and ``ring_overlap`` pipeline them.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.nn import functional as F

from overlapkit.inlayer.tp_collectives import TpGroup


class TpSchedule(Protocol):
    """The two fused steps of a tensor-parallel linear layer (see the module docstring)."""

    group: TpGroup

    def gather_matmul(
        self, shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def matmul_scatter(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...


class SyncSchedule:
    """``tp_comm=sync``: the collective, waited for, then the matmul (or the reverse)."""

    __slots__ = ("group",)

    def __init__(self, group: TpGroup):
        self.group = group

    def gather_matmul(
        self, shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        full = self.group.all_gather(shard).wait()
        return F.linear(full, weight, bias), full

    def matmul_scatter(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.group.reduce_scatter(F.linear(h, weight)).wait()
