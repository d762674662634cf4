"""Tensor parallelism with sequence parallelism over a stack of blocks, its collectives overlapped.

``sequence_parallel(blocks, mesh, plan=...)`` shards, in place, the linear layers ``plan`` names
in every block over the 1-D ``tp`` mesh (``"colwise"`` / ``"rowwise"``, as torch's
``ColwiseParallel`` / ``RowwiseParallel``; ``parallel_linear``) and keeps the activations between
them sharded along the sequence (dim 1): the first block's input is cut into ``tp`` slices (no
communication: every tp rank holds the same input), the last block's output is all-gathered.
Inside, everything but the sharded matmuls (norms, residual adds, attention's core on the
gathered heads) runs on this rank's ``T/tp`` tokens; attention and MLPs all-gather their input
before their column-parallel matmuls and reduce-scatter after their row-parallel ones.

Every parameter of the blocks that is not sharded (the norms, row-parallel biases, anything the
plan leaves out) then sees only this rank's tokens: its gradient is a partial sum over ``tp``.
``SequenceParallel.reduce_grads()`` sums them all over the ``tp`` group in one all-reduce; call it
once per step, after the last backward and before clipping and the optimizer (not once per
parameter inside the optimizer, as a ``Partial`` DTensor gradient would be).

``tp_comm`` chooses how the collectives meet the matmuls (``TP_COMMS``): ``sync``
(``tp_sync``), ``split`` with ``tp_chunks`` chunks of the micro-batch (``split_overlap``), ``ring``
(``ring_overlap``). All compute the same values; ``SequenceParallel.use`` switches between
steps.

Example::

    >>> sp = ok.sequence_parallel(model.blocks, tp_mesh, plan={"attn.q": "colwise",
    ...     "attn.k": "colwise", "attn.v": "colwise", "attn.proj": "rowwise"}, tp_comm="ring")
    >>> loss_fn(model(x), y).backward(); sp.reduce_grads(); optimizer.step()
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from overlapkit.inlayer.parallel_linear import (
    ColumnGroup,
    RowParallelLinear,
    TpContext,
)
from overlapkit.inlayer.ring_overlap import RingSchedule
from overlapkit.inlayer.split_overlap import SplitSchedule
from overlapkit.inlayer.tp_collectives import SEQ_DIM, TpGroup
from overlapkit.inlayer.tp_sync import SyncSchedule, TpSchedule

logger = logging.getLogger(__name__)

COLWISE, ROWWISE = "colwise", "rowwise"
SYNC, SPLIT, RING = "sync", "split", "ring"
TP_COMMS = (SYNC, SPLIT, RING)
"""The ``tp_comm`` modes."""
DEFAULT_TP_CHUNKS = 2
"""``tp_chunks`` where none is given: two halves of the micro-batch, as Domino splits it."""


def schedule_for(tp_comm: str, group: TpGroup, tp_chunks: int = DEFAULT_TP_CHUNKS) -> TpSchedule:
    """The schedule of ``tp_comm`` over ``group``.

    Raises:
        ValueError: ``tp_comm`` not one of ``TP_COMMS``; ``tp_chunks`` below 1.
    """
    match tp_comm:
        case "sync":
            return SyncSchedule(group)
        case "split":
            return SplitSchedule(group, tp_chunks)
        case "ring":
            return RingSchedule(group)
        case _:
            raise ValueError(f"tp_comm must be one of {', '.join(TP_COMMS)}, got {tp_comm!r}")


def check_sequence(tp: int, seq_len: int) -> None:
    """Refuse a sequence that ``tp`` ranks cannot cut into equal slices.

    Raises:
        ValueError: ``tp`` does not divide ``seq_len``.
    """
    if seq_len % tp:
        raise ValueError(
            f"sequence parallelism cuts each sequence into tp={tp} equal slices; tp must divide "
            f"its {seq_len} tokens"
        )


class _ShardSequence(torch.autograd.Function):
    """This rank's slice of a ``(B, T, ...)`` input every tp rank holds; backward all-gathers
    the slices' gradients (the input's gradient is the same on every rank)."""

    @staticmethod
    def forward(ctx: FunctionCtx, full: torch.Tensor, group: TpGroup) -> torch.Tensor:
        check_sequence(group.size, full.shape[SEQ_DIM])
        ctx.group = group
        return full.chunk(group.size, SEQ_DIM)[group.rank].contiguous()

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        return ctx.group.all_gather(grad).wait(), None


class _GatherSequence(torch.autograd.Function):
    """The whole ``(B, T, ...)`` from the slices; backward keeps this rank's slice of the
    gradient (the layers after compute the same gradient on every rank)."""

    @staticmethod
    def forward(ctx: FunctionCtx, shard: torch.Tensor, group: TpGroup) -> torch.Tensor:
        ctx.group = group
        return group.all_gather(shard).wait()

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        group = ctx.group
        return grad.chunk(group.size, SEQ_DIM)[group.rank].contiguous(), None


class SequenceParallel:
    """What ``sequence_parallel`` did to a stack of blocks: the schedule in force, the hooks
    that shard and gather the sequence, and the parameters whose gradients are partial over tp.

    Attributes:
        group (TpGroup): the ``tp`` group.
        partial (tuple[nn.Parameter, ...]): the blocks' parameters that are not sharded.
        tp_comm (str): the mode in force; ``tp_chunks`` (int) its chunks (``split``).
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        group: TpGroup,
        context: TpContext,
        tp_comm: str,
        tp_chunks: int,
    ):
        self.group = group
        self.context = context
        self.tp_comm = tp_comm
        self.tp_chunks = tp_chunks
        self.partial = tuple(
            p for b in blocks for p in b.parameters() if not isinstance(p, DTensor)
        )
        blocks[0].register_forward_pre_hook(self._shard_input)
        blocks[-1].register_forward_hook(self._gather_output)

    def use(self, tp_comm: str, tp_chunks: int = DEFAULT_TP_CHUNKS) -> None:
        """Switch to another mode (between steps).

        Raises:
            ValueError: as ``schedule_for``.
        """
        self.context.schedule = schedule_for(tp_comm, self.group, tp_chunks)
        self.tp_comm, self.tp_chunks = tp_comm, tp_chunks

    @property
    def description(self) -> str:
        """``"sequence parallel tp=2, tp_comm=split (2 chunks)"``."""
        how = f"{self.tp_comm} ({self.tp_chunks} chunks)" if self.tp_comm == SPLIT else self.tp_comm
        return f"sequence parallel tp={self.group.size}, tp_comm={how}"

    def reduce_grads(self) -> None:
        """Sum the gradients of ``partial`` over tp, in one all-reduce (a collective: every tp
        rank calls it after the step's last backward)."""
        grads = [p.grad for p in self.partial if p.grad is not None]
        if not grads or self.group.size == 1:
            return
        total = self.group.all_reduce(torch.cat([g.reshape(-1) for g in grads]))
        for grad, summed in zip(grads, total.split([g.numel() for g in grads]), strict=True):
            grad.copy_(summed.view_as(grad))

    def _shard_input(self, module: nn.Module, args: tuple) -> tuple:
        return (_ShardSequence.apply(args[0], self.group), *args[1:])

    def _gather_output(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return _GatherSequence.apply(output, self.group)


def _parallelize(
    block: nn.Module, plan: Mapping[str, str], mesh: DeviceMesh, context: TpContext
) -> None:
    """Replace the linears ``plan`` names in ``block``; column-wise ones under one parent share
    one ``ColumnGroup``."""
    groups: dict[str, ColumnGroup] = {}
    for name, style in plan.items():
        parent_name, _, child = name.rpartition(".")
        parent = block.get_submodule(parent_name)
        linear = parent.get_submodule(child)
        if not isinstance(linear, nn.Linear):
            raise TypeError(
                f"sequence_parallel: plan entry {name!r} is {type(linear).__name__}, not nn.Linear"
            )
        match style:
            case "colwise":
                group = groups.setdefault(parent_name, ColumnGroup(context))
                setattr(parent, child, group.add(linear, mesh))
            case "rowwise":
                setattr(parent, child, RowParallelLinear(linear, mesh, context))
            case _:
                raise ValueError(
                    f"sequence_parallel: plan[{name!r}] must be {COLWISE!r} or {ROWWISE!r}, "
                    f"got {style!r}"
                )


def sequence_parallel(
    blocks: Sequence[nn.Module],
    mesh: DeviceMesh,
    *,
    plan: Mapping[str, str],
    tp_comm: str = SYNC,
    tp_chunks: int = DEFAULT_TP_CHUNKS,
) -> SequenceParallel:
    """Tensor- and sequence-parallelize ``blocks`` over the 1-D ``mesh``, in place.

    Args:
        blocks (Sequence[nn.Module]): the blocks in forward order, each called on ``(B, T, C)``
            (the sequence on dim 1) and returning the same shape; the same on every tp rank.
        mesh (DeviceMesh): the 1-D ``tp`` mesh.
        plan (Mapping[str, str]): each block's ``nn.Linear`` names (``"attn.q"``) to
            ``"colwise"`` or ``"rowwise"``. Column-wise linears under one parent read one input
            and share its all-gather.
        tp_comm (str): ``"sync"``, ``"split"`` or ``"ring"``. Defaults to ``"sync"``.
        tp_chunks (int): with ``split``, chunks of the micro-batch; it must divide the batch.
            Defaults to 2.

    Returns:
        SequenceParallel: call its ``reduce_grads()`` once per step before the optimizer.

    Raises:
        ValueError / TypeError: an unknown mode or style, a plan entry that is no ``nn.Linear``,
            no blocks, a mesh that is not 1-D.
    """
    if not blocks:
        raise ValueError("sequence_parallel: no blocks to parallelize")
    if mesh.ndim != 1:
        raise ValueError(f"sequence_parallel: the tp mesh must be 1-D, got {mesh.ndim} dims")
    group = TpGroup.of(mesh.get_group())
    context = TpContext(schedule_for(tp_comm, group, tp_chunks))
    for block in blocks:
        _parallelize(block, plan, mesh, context)
    result = SequenceParallel(blocks, group, context, tp_comm, tp_chunks)
    logger.info("%s over %d blocks", result.description, len(blocks))
    return result
