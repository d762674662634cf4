"""Explicit forward/backward prefetch lists and the warning when a script replaces them; the
next step's first gathers after the optimizer, or after each of the first blocks' own update
(``step_by_block``).

With ``prefetch=d`` each block prefetches the next ``d`` blocks in forward and the previous
``d`` in backward (``prefetch_lists.ok_fsdp_lists``), so while block i computes the all-gathers
of the next d blocks are in flight. Each explicit list replaces FSDP2's implicit one-block
backward prefetch; lists of two "use more reserved memory" (FSDP2's docstring): ``d`` more
blocks are unsharded at once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from overlapkit.fsdp.prefetch_lists import apply_lists, describe_replacement, ok_fsdp_lists
from overlapkit.fsdp.state import OverlapState, state_of
from overlapkit.optim.clip import validate_clip_options
from overlapkit.optim.per_block import NormClip, step_by_sets

logger = logging.getLogger(__name__)


def set_explicit_prefetch(root: FSDPModule, blocks: Sequence[FSDPModule], depth: int) -> None:
    """Install depth-``depth`` forward and backward prefetch on ``blocks`` (forward order),
    replacing any list there (``prefetch_lists.ok_fsdp_lists``; depth 0 empties them)."""
    apply_lists(root, list(blocks), ok_fsdp_lists(len(blocks), depth))


def warn_if_prefetch_replaced(state: OverlapState) -> None:
    """Warn once per model when the prefetch lists in force are no longer ``ok.fsdp``'s.

    A script's own ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``
    (after ``ok.fsdp``) replace its lists: FSDP2 then prefetches as the script says, and
    ``ok.fsdp_stats`` bounds its peaks by those lists. The warning names both settings and the
    bound in force. Called before each step's forward; reads FSDP2's lists (no collective).
    """
    if state.prefetch_replaced_warned:
        return
    own, in_force = state.own_prefetch_lists, state.prefetch_lists
    if in_force == own:
        return
    state.prefetch_replaced_warned = True
    forward, backward = state.bound_blocks(in_force)
    own_forward, own_backward = state.bound_blocks(own)
    logger.warning(
        "ok.fsdp: the script's own prefetch replaced ok.fsdp(prefetch=%d)'s (%s); FSDP2 "
        "prefetches as the script says, and the bound in force is %d unsharded blocks in "
        "forward and %d in backward (ok.fsdp's: %d and %d), which ok.fsdp_stats(model) reports",
        state.prefetch,
        describe_replacement(own, in_force, state.block_names),
        forward,
        backward,
        own_forward,
        own_backward,
    )


def overlap_optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> RemovableHandle:
    """Start the next step's first all-gathers as soon as ``optimizer.step()`` returns.

    On CUDA this is FSDP2's ``set_post_optim_event``: a step post-hook records an event on
    the current stream, and the root's pre-forward makes the all-gather streams wait on that
    event only (not on whatever else the current stream runs after the optimizer). On host
    devices (gloo), where streams do not exist, the hook issues the all-gathers of the root and
    of the first ``max(prefetch, 1)`` blocks asynchronously, so they run while the host zeroes
    gradients, loads the next batch and logs; the next forward finds them in flight.

    Args:
        model (nn.Module): the model returned by ``ok.fsdp``.
        optimizer (torch.optim.Optimizer): the optimizer stepping its sharded parameters.

    Returns:
        RemovableHandle: ``handle.remove()`` turns it off.

    Raises:
        TypeError: ``model`` was not returned by ``ok.fsdp``.

    Example:
        >>> model = ok.fsdp(model, prefetch=1)
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> overlap_optimizer_step(model, optimizer)
    """
    state = state_of(model, caller="overlap_optimizer_step")
    first_blocks = state.blocks[: max(state.prefetch, 1)]

    def issue_next_gathers(*_: object) -> None:
        if state.device_type == "cpu":
            for module in (state.root, *first_blocks):
                module.unshard(async_op=True)
        else:
            stream = torch.get_device_module(state.device_type).current_stream()
            state.root.set_post_optim_event(stream.record_event())

    return optimizer.register_step_post_hook(issue_next_gathers)


def step_by_block(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    clip_grad_norm: float | None = None,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor | None:
    """``optimizer.step()`` block by block in forward order; each of the first blocks' next
    all-gather starts as soon as that block is updated (Megatron's
    ``overlap_param_gather_with_optimizer_step``), with global-norm clipping folded in.

    Call it instead of ``optimizer.step()`` (and instead of ``clip_grad_norm_`` before it). The
    root's own parameters are updated first, then each block's, with the user's optimizer
    (``overlapkit.optim.per_block``: bitwise what ``optimizer.step()`` gives). On host devices
    (gloo) the all-gathers of the root and of the first ``max(prefetch, 1)`` blocks are issued
    right after their own update, so they run while the rest of the model is clipped and
    updated. On CUDA, FSDP2 gates every all-gather of the next forward on one post-optimizer
    event (``FSDPModule.set_post_optim_event``, waited in the root's pre-forward), so the event
    is recorded after the last block; the update itself is the same.

    With ``clip_grad_norm``, the result is bitwise that of
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm, norm_type,
    error_if_nonfinite)`` on the sharded (DTensor) parameters followed by ``optimizer.step()``:
    the norm of the local shards' gradients is made global by DTensor itself (for p-norms one
    all-reduce of one float per parameter over the shard axis; HSDP's gradients are already
    equal across the replicate axis, so it needs none there), then each block's gradients are
    multiplied by ``min(clip_grad_norm / (norm + 1e-6), 1)`` right before its update.

    Args:
        model (nn.Module): the model returned by ``ok.fsdp``.
        optimizer (torch.optim.Optimizer): the optimizer of its (sharded) parameters; its step
            hooks, if any, do not run.
        clip_grad_norm (float | None): the max norm, >= 0 (0.0 zeroes the gradients, as in
            torch); None does not clip. Defaults to None.
        norm_type (float | str): p of the p-norm; ``inf`` (or ``"inf"``) for the max norm.
            Defaults to 2.0.
        error_if_nonfinite (bool): raise if the total norm is NaN or infinite instead of
            clipping by it; costs a host sync (on CUDA), as in torch. Defaults to False.

    Returns:
        Tensor | None: with ``clip_grad_norm``, the total gradient norm before clipping, a
        0-dim tensor on the gradients' device, equal on every rank (``clip_grad_norm_``'s value,
        ``full_tensor()``-ed). On CPU reading it costs nothing. On CUDA it is computed on the
        current stream before the updates, but ``norm.item()`` waits for everything queued on
        that stream, all block updates included: to keep the host running ahead, read it after
        the next forward has been issued (for example log the previous step's norm). None
        without ``clip_grad_norm``.

    Raises:
        TypeError: ``model`` was not returned by ``ok.fsdp``; a clip option of the wrong type.
        ValueError: ``optimizer`` holds parameters outside ``model``; ``clip_grad_norm``
            negative or NaN.
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite (torch's message);
            no gradient has been clipped and no parameter updated.

    Example:
        >>> model = ok.fsdp(model, prefetch=1)
        >>> loss_fn(model(x), y).backward()
        >>> norm = step_by_block(model, optimizer, clip_grad_norm=1.0)
        >>> optimizer.zero_grad()
    """
    state = state_of(model, caller="step_by_block")
    clip = None
    if clip_grad_norm is not None:
        max_norm, norm = validate_clip_options(
            clip_grad_norm, norm_type, error_if_nonfinite, caller="step_by_block"
        )
        clip = NormClip(max_norm, norm, error_if_nonfinite, caller="step_by_block")
    blocks = _ForwardOrderBlocks(state)
    held = {id(p) for params in blocks.parameter_sets() for p in params}
    if any(id(p) not in held for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            "step_by_block: the optimizer holds parameters that are not in the ok.fsdp model"
        )
    return step_by_sets(blocks, optimizer, clip=clip)


class _ForwardOrderBlocks:
    """An ``ok.fsdp`` model as a ``BlockSet``: the root's own parameters, then each block's.

    After its update, each of the root and the first ``max(prefetch, 1)`` blocks starts its next
    all-gather on host devices (gloo); on CUDA one post-optimizer event after the last block
    gates them all (FSDP2 waits for it in the root's pre-forward).
    """

    def __init__(self, state: OverlapState):
        self._state = state
        self._modules = [state.root, *state.blocks]
        in_blocks = {id(p) for block in state.blocks for p in block.parameters()}
        root_own = [p for p in state.root.parameters() if id(p) not in in_blocks]
        self._sets = [root_own, *(list(b.parameters()) for b in state.blocks)]
        self._early = 1 + max(state.prefetch, 1)

    def parameter_sets(self) -> list[list[torch.nn.Parameter]]:
        return self._sets

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._state.root.parameters())

    def updated(self, index: int) -> None:
        if self._state.device_type == "cpu" and index < self._early:
            self._modules[index].unshard(async_op=True)

    def all_updated(self) -> None:
        state = self._state
        if state.device_type != "cpu":
            stream = torch.get_device_module(state.device_type).current_stream()
            state.root.set_post_optim_event(stream.record_event())
