"""Column- and row-parallel linear layers over sequence-parallel activations.

Megatron's split of a pair of linear layers over ``tp`` ranks, with the activations between
blocks sharded along the sequence (``(B, T/tp, C)`` on each rank):

- **column-parallel** (``ColumnParallelLinear``): the weight's output features sharded (``Shard(0)``
  DTensor, its bias too). Forward all-gathers the input along the sequence and multiplies;
  backward reduce-scatters the input's gradient. Linears that read the same input (attention's
  ``q``, ``k`` and ``v``) form one ``ColumnGroup``: one all-gather and one matmul for all of them,
  as torchtitan's ``PrepareModuleInput`` gathers once per attention.
- **row-parallel** (``RowParallelLinear``): the weight's input features sharded (``Shard(1)``).
  Forward multiplies this rank's features and reduce-scatters the partial sums along the
  sequence, then adds the bias on the shard; backward all-gathers the output's gradient.

The collectives and the matmuls meet as the context's ``TpSchedule`` says (``tp_comm``: sync,
split, ring); it can be swapped between steps (``TpContext.schedule``). The sharded weights are
DTensors on the ``tp`` mesh, so checkpoints, clipping and ``ok.GradBucketer`` see them as under
torch's ``parallelize_module``; the forward uses their local shards. A row-parallel bias is a
plain parameter added on the sequence shard: its gradient is a partial sum over ``tp``
(``SequenceParallel.reduce_grads``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from overlapkit.inlayer.tp_sync import TpSchedule


@dataclass(slots=True)
class TpContext:
    """What every parallel linear of one transform shares: the schedule in force."""

    schedule: TpSchedule


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``(..., features)`` as ``(rows, features)``."""
    return tensor.reshape(-1, tensor.shape[-1])


class _ColumnParallel(torch.autograd.Function):
    """``y = all_gather(x) @ weight.T + bias``; backward reduce-scatters the input's gradient."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        shard: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        schedule: TpSchedule,
    ) -> torch.Tensor:
        output, full = schedule.gather_matmul(shard, weight, bias)
        ctx.save_for_backward(full, weight)
        ctx.schedule, ctx.has_bias = schedule, bias is not None
        return output

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        full, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grads: list[torch.Tensor | None] = []

        def weight_grads() -> None:  # independent of the input's gradient: under its scatter
            grads.append(_rows(grad).t() @ _rows(full))
            grads.append(_rows(grad).sum(0) if ctx.has_bias else None)

        grad_input = ctx.schedule.matmul_scatter(grad, weight.t(), weight_grads)
        return grad_input, *grads, None


class _RowParallel(torch.autograd.Function):
    """``y = reduce_scatter(h @ weight.T)``; backward all-gathers the output's gradient."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, h: torch.Tensor, weight: torch.Tensor, schedule: TpSchedule
    ) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        ctx.schedule = schedule
        return schedule.matmul_scatter(h, weight)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, weight = ctx.saved_tensors
        grad_input, grad_full = ctx.schedule.gather_matmul(grad.contiguous(), weight.t(), None)
        return grad_input, _rows(grad_full).t() @ _rows(h), None


def _shard(param: nn.Parameter, mesh: DeviceMesh, dim: int) -> nn.Parameter:
    """``param`` as a DTensor parameter sharded along ``dim`` over ``mesh`` (from rank 0's)."""
    return nn.Parameter(distribute_tensor(param.data, mesh, [Shard(dim)]), param.requires_grad)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


class ColumnParallelLinear(nn.Module):
    """A column-parallel ``nn.Linear`` (``weight`` and ``bias`` keep their names), one member of a
    ``ColumnGroup``; call it on the ``(B, T/tp, in)`` shard, get ``(B, T, out/tp)``."""

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh, group: ColumnGroup):
        super().__init__()
        self.weight = _shard(linear.weight, mesh, 0)
        self.bias = None if linear.bias is None else _shard(linear.bias, mesh, 0)
        self.group = group

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        return self.group.output(self, shard)


class ColumnGroup:
    """Column-parallel linears that read one input: the first call on an input computes every
    member's output (one all-gather, one matmul on the concatenated weights); each member's call
    on that same input takes its own. A call on another input starts over.

    Args:
        context (TpContext): the schedule in force.
    """

    def __init__(self, context: TpContext):
        self.context = context
        self.members: list[ColumnParallelLinear] = []
        self._input: torch.Tensor | None = None
        self._ready: dict[int, torch.Tensor] = {}

    def add(self, linear: nn.Linear, mesh: DeviceMesh) -> ColumnParallelLinear:
        member = ColumnParallelLinear(linear, mesh, self)
        if self.members and (member.bias is None) != (self.members[0].bias is None):
            raise ValueError(
                "sequence_parallel: column-parallel linears that read one input must all have "
                "a bias or none"
            )
        self.members.append(member)
        return member

    def output(self, member: ColumnParallelLinear, shard: torch.Tensor) -> torch.Tensor:
        if self._input is not shard or id(member) not in self._ready:
            self._compute(shard)
        output = self._ready.pop(id(member))
        if not self._ready:
            self._input = None  # every member has its output: hold no activation
        return output

    def _compute(self, shard: torch.Tensor) -> None:
        weights = [_local(m.weight) for m in self.members]
        biases = [_local(m.bias) for m in self.members if m.bias is not None]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        bias = None if not biases else biases[0] if len(biases) == 1 else torch.cat(biases)
        output = _ColumnParallel.apply(shard, weight, bias, self.context.schedule)
        sizes = [w.shape[0] for w in weights]
        self._input = shard
        self._ready = {
            id(m): out for m, out in zip(self.members, output.split(sizes, -1), strict=True)
        }


class RowParallelLinear(nn.Module):
    """A row-parallel ``nn.Linear`` (``weight`` sharded, ``bias`` a plain parameter); call it on
    ``(B, T, in/tp)``, get the ``(B, T/tp, out)`` shard of the sum over tp."""

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh, context: TpContext):
        super().__init__()
        self.weight = _shard(linear.weight, mesh, 1)
        self.bias = linear.bias
        self.context = context

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        output = _RowParallel.apply(h, _local(self.weight), self.context.schedule)
        return output if self.bias is None else output + self.bias
