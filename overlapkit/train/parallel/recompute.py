"""Activation recomputation (``train.recompute``): blocks whose activations backward recomputes.

Two modes, priced as the planner prices them for ``overlapkit-train``:

- ``full``: the first ``train.recompute_layers`` blocks of each pipeline stage (all of them when
  it is absent; the planner's ``full:K`` / ``full:all``) keep only their input; backward reruns
  their forward (torch's non-reentrant ``torch.utils.checkpoint``, which stops replaying once
  the last activation backward needs is back: the residual add after the MLP is not rerun).
- ``selective``: every block is checkpointed with a policy
  (``create_selective_checkpoint_contexts``) that recomputes the attention core only: the SDPA
  kernels (``ATTENTION_OPS``, the CPU and CUDA ones) are rerun in backward, every other op's
  output is saved. Collectives inside a block (the context-parallel K/V all-gather, the
  tensor-parallel all-gathers and reduce-scatters, functional ops in every ``tp_comm`` mode) are
  saved too, so backward issues none of them again; under ``full`` they are rerun with the
  block.

Each block's own ``forward`` is replaced by the checkpointed call (the module is not wrapped,
unlike ``checkpoint_wrapper``): parameter names, the modules FSDP2 and tensor parallelism find,
and checkpoints stay those of the model without recomputation. Hooks on the block itself (FSDP2's
unshard, ``ok.fsdp``'s accounting) run once, around the checkpointed call, as they would around a
``checkpoint_wrapper``; in backward FSDP2's pre-backward unshard runs before the recomputation
needs the parameters. Gradients are bitwise those without recomputation: the same kernels run on
the same inputs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from overlapkit.layout import RECOMPUTE
from overlapkit.validation import check_int

logger = logging.getLogger(__name__)

# The modes are the layout's (one list: what the search proposes is what train accepts).
NONE, SELECTIVE, FULL = RECOMPUTE

_aten = torch.ops.aten
ATTENTION_OPS = frozenset(
    {
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    }
)
"""The SDPA kernels (CPU flash; CUDA flash, memory-efficient, cuDNN) that ``selective`` reruns."""


def check_recompute_mode(mode: str, layers: int | None) -> None:
    """Refuse an unknown ``train.recompute`` or a ``train.recompute_layers`` it cannot use.

    Raises:
        ValueError: a mode outside ``RECOMPUTE``; ``recompute_layers`` below 1, or given
            with a mode other than ``full`` (selective recomputes every block's attention core).
        TypeError: ``recompute_layers`` not an int.
    """
    if mode not in RECOMPUTE:
        raise ValueError(f"train.recompute must be one of {list(RECOMPUTE)}, got {mode!r}")
    if layers is None:
        return
    check_int("train.recompute_layers", layers, 1)
    if mode != FULL:
        raise ValueError(
            f"train.recompute_layers={layers} counts the blocks of each stage that full "
            f"recomputation reruns; it needs train.recompute=full, got {mode!r} (null: all blocks)"
        )


def check_recompute_fits(
    mode: str, layers: int | None, *, blocks_per_stage: int, has_attention: bool = True
) -> None:
    """Refuse recomputation that the model cannot take; messages name the config keys.

    Args:
        mode (str): ``train.recompute``.
        layers (int | None): ``train.recompute_layers``.
        blocks_per_stage (int): blocks each pipeline stage holds (all blocks without pp).
        has_attention (bool): whether the blocks compute attention (``selective`` needs it).
            Defaults to True (not checked).

    Raises:
        ValueError: ``recompute_layers`` above the blocks of a stage; ``selective`` on a model
            without attention; recomputation of a model without blocks.
    """
    check_recompute_mode(mode, layers)
    if mode == NONE:
        return
    if blocks_per_stage < 1:
        raise ValueError(f"train.recompute={mode} needs a model of blocks (model.blocks)")
    if layers is not None and layers > blocks_per_stage:
        raise ValueError(
            f"train.recompute_layers ({layers}) exceeds the {blocks_per_stage} blocks of a "
            f"stage; use at most {blocks_per_stage}, or null for all of them"
        )
    if mode == SELECTIVE and not has_attention:
        raise ValueError(
            "train.recompute=selective recomputes the attention core, and this model has no "
            "attention; use train.recompute=full (or none)"
        )


def selective_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """``create_selective_checkpoint_contexts``'s policy: rerun SDPA, save everything else."""
    return CheckpointPolicy.PREFER_RECOMPUTE if op in ATTENTION_OPS else CheckpointPolicy.MUST_SAVE


def _checkpoint_forward(block: nn.Module, context_fn: Callable[[], tuple]) -> None:
    forward = block.forward

    @functools.wraps(forward)
    def recomputed(*args: object, **kwargs: object) -> object:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    block.forward = recomputed


def apply_recompute(blocks: Sequence[nn.Module], mode: str, layers: int | None = None) -> list[int]:
    """Checkpoint the blocks of one pipeline stage (the whole model without pp), in place.

    Args:
        blocks (Sequence[nn.Module]): the stage's blocks in forward order (``model.blocks``).
        mode (str): ``"none"``, ``"selective"`` (every block's attention core) or ``"full"``.
        layers (int | None): with ``full``, how many blocks, counted from the stage's first;
            None means all of them.

    Returns:
        list[int]: indices (in ``blocks``) of the blocks that recompute in backward.

    Raises:
        ValueError: an unknown mode, or ``layers`` outside 1 .. ``len(blocks)``.

    Example:
        >>> apply_recompute(model.blocks, "full", layers=2)   # blocks 0 and 1
        [0, 1]
    """
    check_recompute_fits(mode, layers, blocks_per_stage=len(blocks))
    if mode == NONE:
        return []
    if mode == SELECTIVE:
        context_fn = functools.partial(create_selective_checkpoint_contexts, selective_policy)
        chosen = list(range(len(blocks)))
    else:
        context_fn = noop_context_fn
        chosen = list(range(len(blocks) if layers is None else layers))
    for index in chosen:
        _checkpoint_forward(blocks[index], context_fn)
    logger.info("recompute=%s: blocks %s of %d", mode, chosen, len(blocks))
    return chosen
