"""What ``ok.fsdp`` remembers about a model it wrapped, and ``ok.fsdp_stats`` to read it."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch.nn as nn

from overlapkit.fsdp.prefetch_lists import (
    PrefetchLists,
    lists_in_force,
    ok_fsdp_lists,
    unsharded_bound,
)
from overlapkit.fsdp.reduce_scatter import PendingReductions
from overlapkit.fsdp.stats import FSDPStats, UnshardRecorder


@dataclass(slots=True)
class OverlapState:
    """The blocks, settings and recorders of one ``ok.fsdp`` model."""

    root: nn.Module
    blocks: list[nn.Module]
    block_names: tuple[str, ...]
    block_bytes: tuple[int, ...]
    prefetch: int
    device_type: str
    reshard_after_forward: bool
    recorder: UnshardRecorder
    pending: PendingReductions
    zero: int | None = None
    """``ok.fsdp(zero=)``: 1 or 2, or None for ZeRO-3 (``overlapkit.fsdp.zero``)."""
    prefetch_replaced_warned: bool = False
    """Whether the warning that a script replaced the prefetch lists was given."""

    @property
    def own_prefetch_lists(self) -> PrefetchLists:
        """The explicit prefetch lists ``ok.fsdp`` set (for ``prefetch``)."""
        return ok_fsdp_lists(len(self.blocks), self.prefetch)

    @property
    def prefetch_lists(self) -> PrefetchLists:
        """The explicit prefetch lists in force: ``ok.fsdp``'s, or a script's own."""
        return lists_in_force(self.root, self.blocks)

    def bound_blocks(self, lists: PrefetchLists) -> tuple[int, int]:
        """Most blocks unsharded at once in (forward, backward) under ``lists``."""
        return unsharded_bound(lists, reshard_after_forward=self.reshard_after_forward)


_STATES: weakref.WeakKeyDictionary[nn.Module, OverlapState] = weakref.WeakKeyDictionary()


def register_state(model: nn.Module, state: OverlapState) -> None:
    _STATES[model] = state


def is_registered(model: nn.Module) -> bool:
    return model in _STATES


def state_of(model: nn.Module, *, caller: str) -> OverlapState:
    """The ``OverlapState`` of a model returned by ``ok.fsdp``.

    Raises:
        TypeError: ``model`` was not returned by ``ok.fsdp``.
    """
    state = _STATES.get(model)
    if state is None:
        raise TypeError(
            f"{caller} takes the model returned by ok.fsdp(), got {type(model).__name__}"
        )
    return state


def fsdp_stats(model: nn.Module) -> FSDPStats:
    """Per-step peak of blocks whose parameters are unsharded at once, and their bytes.

    Args:
        model (nn.Module): the model returned by ``ok.fsdp``.

    Returns:
        FSDPStats: per-step forward/backward peaks (blocks, bytes), the bounds of the prefetch
        lists in force (``1 + prefetch`` in forward for ``ok.fsdp``'s own; a script's own
        ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` replace
        them, and ``prefetch_replaced`` says so) and the event log of the most recent step.

    Raises:
        TypeError: ``model`` was not returned by ``ok.fsdp``.

    Example:
        >>> stats = ok.fsdp_stats(model)
        >>> stats.steps[-1].forward_peak_blocks, stats.within_bound()
    """
    state = state_of(model, caller="ok.fsdp_stats")
    steps, events = state.recorder.snapshot()
    lists = state.prefetch_lists
    forward_bound, backward_bound = state.bound_blocks(lists)
    return FSDPStats(
        prefetch=state.prefetch,
        block_names=state.block_names,
        block_unsharded_bytes=state.block_bytes,
        forward_bound_blocks=forward_bound,
        backward_bound_blocks=backward_bound,
        steps=steps,
        last_step_events=events,
        prefetch_replaced=lists != state.own_prefetch_lists,
    )
