"""What ``ok.fsdp`` remembers about a model it wrapped, and ``ok.fsdp_stats`` to read it."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch.nn as nn

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

    @property
    def forward_bound_blocks(self) -> int:
        # Without resharding after forward every block stays unsharded until backward.
        return 1 + self.prefetch if self.reshard_after_forward else len(self.blocks)

    @property
    def backward_bound_blocks(self) -> int:
        # FSDP2 prefetches one block in backward even without explicit prefetch.
        return 1 + max(self.prefetch, 1) if self.reshard_after_forward else len(self.blocks)


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
        FSDPStats: per-step forward/backward peaks (blocks, bytes), the design's bounds
        (``1 + prefetch`` in forward) and the event log of the most recent step.

    Raises:
        TypeError: ``model`` was not returned by ``ok.fsdp``.

    Example:
        >>> stats = ok.fsdp_stats(model)
        >>> stats.steps[-1].forward_peak_blocks, stats.within_bound()
    """
    state = state_of(model, caller="ok.fsdp_stats")
    steps, events = state.recorder.snapshot()
    return FSDPStats(
        prefetch=state.prefetch,
        block_names=state.block_names,
        block_unsharded_bytes=state.block_bytes,
        forward_bound_blocks=state.forward_bound_blocks,
        backward_bound_blocks=state.backward_bound_blocks,
        steps=steps,
        last_step_events=events,
    )
