"""The optimizer applied set by set in the order the next forward needs the parameters.

``overlapkit.fsdp.step_by_block`` updates an ``ok.fsdp`` model's root, then each block, in
forward order, and starts each of the first blocks' next all-gather as soon as that block is
updated; this module holds that loop, over any ``BlockSet`` (``overlapkit.optim.protocols``).
Each set is updated by ``step_subset`` with the hyper-parameters taken before the first one, so
the result is bitwise what one ``optimizer.step()`` gives.

With ``clip`` the loop first takes the global gradient norm, with ``clip_grad_norm_``'s bits
(``overlapkit.optim.clip``), and then multiplies each set's gradients by the clip coefficient
right before that set's update, so the clipping of the later sets runs while the first sets'
all-gathers are in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from overlapkit.optim.clip import (
    clip_coefficient,
    grad_norms,
    raise_if_nonfinite,
    scale_grads_,
    total_norm,
)
from overlapkit.optim.protocols import BlockSet
from overlapkit.optim.subset import (
    group_of,
    hyper_parameters,
    mark_stepped,
    run_step_hooks,
    step_hooks,
    step_subset,
)


@dataclass(frozen=True, slots=True)
class NormClip:
    """Global-norm clipping as ``torch.nn.utils.clip_grad_norm_`` takes it (validated values:
    ``overlapkit.optim.clip.validate_clip_options``)."""

    max_norm: float
    """Gradients are scaled by ``min(max_norm / (total + 1e-6), 1)``; 0.0 zeroes them."""
    norm_type: float = 2.0
    """p of the p-norm; ``inf`` for the largest absolute value."""
    error_if_nonfinite: bool = False
    """Raise (a host sync) instead of clipping when the total norm is NaN or infinite."""
    caller: str = "step_by_sets"
    """The API to name in the non-finite error."""


def step_by_sets(
    blocks: BlockSet, optimizer: torch.optim.Optimizer, *, clip: NormClip | None = None
) -> torch.Tensor | None:
    """``optimizer.step()`` over ``blocks.parameter_sets()``, one set after the other.

    After each set's update ``blocks.updated(index)`` runs, after the last
    ``blocks.all_updated()``. The step pre/post hooks (the optimizer's and the global ones) run
    once, before the first set (after the norm, so they see the clip coming, as after
    ``clip_grad_norm_``) and after the last, as around one ``optimizer.step()``. Parameters of
    a set that the optimizer does not hold are left alone (but clipped, as ``clip_grad_norm_``
    over ``blocks.parameters()`` would clip them).

    Args:
        blocks (BlockSet): the sets, in update order.
        optimizer (torch.optim.Optimizer): the user's optimizer; its state is updated in place.
        clip (NormClip | None): clip the gradients first, bitwise as
            ``torch.nn.utils.clip_grad_norm_(blocks.parameters(), ...)``. Defaults to None.

    Returns:
        Tensor | None: with ``clip``, the total norm before clipping as a plain 0-dim tensor
        on the gradients' device (``clip_grad_norm_``'s value, made whole with
        ``full_tensor()`` for sharded gradients); None without.

    Raises:
        RuntimeError: ``clip.error_if_nonfinite`` and the total norm is NaN or infinite;
            nothing has been clipped or updated.
    """
    total = coefficient = None
    if clip is not None:
        total = global_grad_norm(blocks.parameters(), clip.norm_type)
        if clip.error_if_nonfinite:
            raise_if_nonfinite(total, clip.norm_type, caller=clip.caller)
        coefficient = clip_coefficient(clip.max_norm, total)
    pre_hooks, post_hooks = step_hooks(optimizer)
    run_step_hooks(optimizer, pre_hooks)
    groups = group_of(optimizer)
    hyper = hyper_parameters(optimizer)
    for index, params in enumerate(blocks.parameter_sets()):
        if coefficient is not None:
            clip_subset_([p.grad for p in params if p.grad is not None], coefficient)
        step_subset(optimizer, [p for p in params if id(p) in groups], hyper=hyper, groups=groups)
        blocks.updated(index)
    mark_stepped(optimizer)
    run_step_hooks(optimizer, post_hooks)
    blocks.all_updated()
    return total


def global_grad_norm(params: list[torch.nn.Parameter], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of every gradient of ``params``, as ``clip_grad_norm_`` takes it.

    The gradients go to ``overlapkit.optim.clip`` as they are: sharded ones as DTensors, so the
    per-shard norms and their reduction are DTensor's own, as in ``clip_grad_norm_`` on DTensor
    parameters (for p-norms one all-reduce of the per-tensor ``norm ** p`` over the mesh axes the
    gradients are sharded on; for ``inf`` one max all-reduce of the total, in ``full_tensor``).

    Returns:
        Tensor: a plain 0-dim tensor, the same value on every rank.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = total_norm(grads, grad_norms(grads, norm_type), norm_type)
    return total.full_tensor() if isinstance(total, DTensor) else total


def clip_subset_(grads: list[torch.Tensor], coefficient: torch.Tensor) -> None:
    """Multiply one set's gradients by the clip ``coefficient`` (a plain 0-dim tensor).

    A sharded gradient is multiplied through its local shard: the same element-wise kernel
    DTensor would run, without mixing a plain tensor into a DTensor op.
    """
    scale_grads_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coefficient)
