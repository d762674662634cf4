"""Tensor parallelism in overlapkit-train (``parallel.plan.tp``): every block of the model
sequence-parallel over the ``tp`` mesh axis, its collectives as ``parallel.plan.tp_comm`` says.

Attention: ``q``, ``k``, ``v`` column-wise (each rank computes its heads; one all-gather of the
sequence for the three), ``proj`` row-wise (partial sums reduce-scattered along the sequence). A
dense MLP: first layer column-wise, second row-wise. Between them norms and residual adds run on
each rank's ``T/tp`` tokens; embeddings, the final norm and the head see whole sequences. The
blocks' other parameters (norms, row-parallel biases, a mixture of experts) get their gradients
summed over ``tp`` once per step (``SequenceParallel.reduce_grads``, which the wrappers call after
the last backward). See ``overlapkit.inlayer.sequence_parallel``.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from overlapkit.inlayer.sequence_parallel import (
    COLWISE,
    DEFAULT_TP_CHUNKS,
    ROWWISE,
    SPLIT,
    SYNC,
    SequenceParallel,
    sequence_parallel,
)
from overlapkit.train.parallel.mesh import PlanConfig

ATTENTION_PLAN = {"attn.q": COLWISE, "attn.k": COLWISE, "attn.v": COLWISE, "attn.proj": ROWWISE}
"""The attention of every block (``gpt.CausalSelfAttention``)."""
MLP_PLAN = {"mlp.0": COLWISE, "mlp.2": ROWWISE}
"""A dense MLP (``gpt.dense_feed_forward``); a mixture of experts stays replicated over tp."""


def block_plan(model: nn.Module) -> dict[str, str]:
    """The plan of ``model``'s blocks: attention, and the MLP where every block has a dense one."""
    dense = all(isinstance(block.mlp, nn.Sequential) for block in model.blocks)
    return ATTENTION_PLAN | (MLP_PLAN if dense else {})


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    tp_comm: str = SYNC,
    tp_chunks: int = DEFAULT_TP_CHUNKS,
) -> SequenceParallel:
    """Sequence-parallel tensor parallelism of ``model.blocks`` over ``tp_mesh``, in place.

    Returns:
        SequenceParallel: its ``reduce_grads()`` is due once per step after the last backward.
    """
    return sequence_parallel(
        model.blocks, tp_mesh, plan=block_plan(model), tp_comm=tp_comm, tp_chunks=tp_chunks
    )


def check_tensor_parallel(plan: PlanConfig, *, batch_size: int, seq_len: int | None) -> None:
    """Refuse tensor-parallel settings that cannot run, before any worker starts (a sequence
    the ranks cannot cut aborts gloo mid-step).

    Raises:
        ValueError: one line naming the config key: ``tp_comm`` other than sync without tp;
            ``tp`` (times ``2 x cp`` with context parallelism) not dividing ``data.seq_len``;
            ``tp_chunks`` not dividing ``train.batch_size`` with ``tp_comm=split``.
    """
    tp, cp = plan.sizes.tp, plan.sizes.cp
    if tp == 1:
        if plan.tp_comm != SYNC:
            raise ValueError(
                f"parallel.plan.tp_comm={plan.tp_comm} overlaps tensor parallel's collectives; "
                "parallel.plan.tp is 1 (set parallel.plan.tp > 1, or tp_comm=sync)"
            )
        return
    slices = tp * 2 * cp if cp > 1 else tp
    if seq_len is not None and seq_len % slices:
        what = f"tp x 2 x cp = {tp} x 2 x {cp} = {slices}" if cp > 1 else f"tp={tp}"
        raise ValueError(
            f"parallel.plan.tp: sequence parallelism cuts each sequence into {what} equal "
            f"slices, which must divide data.seq_len ({seq_len})"
        )
    if plan.tp_comm == SPLIT and batch_size % plan.tp_chunks:
        raise ValueError(
            f"parallel.plan.tp_chunks ({plan.tp_chunks}) must divide train.batch_size "
            f"({batch_size}): tp_comm=split cuts each micro-batch into equal chunks"
        )
