"""How a tensor-parallel linear layer's matmuls meet its collectives: the contract, and ``sync``.

Column- and row-parallel layers under sequence parallelism need two fused steps, each used in
forward by one kind of layer and in backward by the other:

- ``gather_matmul(shard, weight, bias)``: the ``(B, T/tp, in)`` shards all-gathered along the
  sequence to ``x`` ``(B, T, in)``, then ``x @ weight.T (+ bias)``; returns the product and ``x``
  (a column-parallel forward; a row-parallel backward, with the gradient as ``shard``);
- ``matmul_scatter(h, weight)``: ``h @ weight.T`` ``(B, T, out)``, partial over the group,
  reduce-scattered along the sequence to this rank's ``(B, T/tp, out)`` of the sum (a
  row-parallel forward; a column-parallel backward).

``weight`` is ``(out, in)`` as ``F.linear`` takes it. ``matmul_scatter``'s ``while_waiting`` is
other work of the caller (a column-parallel backward's weight gradient) that an overlapping
schedule runs while its last collective is in flight. The schedules compute the same values and
differ in how the collective meets the matmul: ``SyncSchedule`` (``tp_comm=sync``) runs one whole
collective before or after one whole matmul; ``split_overlap`` and ``ring_overlap`` pipeline them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch.nn import functional as F

from overlapkit.inlayer.tp_collectives import TpGroup

Work = Callable[[], None]
"""Work of the caller's that a schedule may run while a collective is in flight."""


class TpSchedule(Protocol):
    """The two fused steps of a tensor-parallel linear layer (see the module docstring)."""

    group: TpGroup

    def gather_matmul(
        self, shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def matmul_scatter(
        self, h: torch.Tensor, weight: torch.Tensor, while_waiting: Work | None = None
    ) -> torch.Tensor: ...


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

    def matmul_scatter(
        self, h: torch.Tensor, weight: torch.Tensor, while_waiting: Work | None = None
    ) -> torch.Tensor:
        output = self.group.reduce_scatter(F.linear(h, weight)).wait()
        if while_waiting is not None:  # after the wait: the baseline overlaps nothing
            while_waiting()
        return output
