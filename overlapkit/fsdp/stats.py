"""Memory accounting of ``ok.fsdp``: how many blocks hold unsharded parameters at once, per step.

A block's full-size parameter memory exists from the moment its all-gather is issued (FSDP2
allocates the all-gather output then) until it is resharded. The ``UnshardRecorder`` logs, per
step, a sequence of events:

- ``all_gather``: a block's all-gather was issued (``async_op`` says whether it returned before
  completing);
- ``compute``: a block's forward (or backward) compute is about to start; ``in_flight`` lists the
  blocks whose asynchronous all-gather had not completed at that moment;
- ``reshard``: a block was seen sharded again (observed at the next event, so it is counted
  before any later all-gather);
- ``held``: a block was already unsharded when the step began (``reshard_after_backward=False``).

``unshard_peaks`` turns such a sequence into the peak number of live blocks and their bytes in
forward and in backward; it is a pure function, tested without processes. With
``reshard_after_forward=True`` and ``prefetch=d`` the forward peak is at most ``1 + d`` blocks
(the one computing plus ``d`` prefetched) and the backward peak at most ``1 + max(d, 1)``
(FSDP2 prefetches one block in backward even by default).

Only blocks are counted; the root's own parameters (embeddings, final norm, head) are not a
block and stay unsharded from the root's forward until its backward.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor

DEFAULT_CAPACITY = 4096
ROOT = -1
"""Block index used for the root module's own parameters."""
PHASES = ("forward", "backward")


@dataclass(frozen=True, slots=True)
class UnshardEvent:
    """One event of a step; ``time_ms`` is ``time.perf_counter()`` in ms (one clock per process)."""

    kind: str
    """``"all_gather"``, ``"compute"``, ``"reshard"`` or ``"held"``."""
    block: int
    """Index into the blocks, in forward order; ``ROOT`` (-1) for the root's own parameters."""
    phase: str
    """``"forward"`` or ``"backward"``."""
    time_ms: float
    async_op: bool | None = None
    """For ``all_gather``: True when the call returned a pending ``Work`` instead of waiting."""
    in_flight: tuple[int, ...] = ()
    """For ``compute``: blocks whose asynchronous all-gather was still running."""


@dataclass(frozen=True, slots=True)
class StepUnshard:
    """Peak unsharded blocks of one step; each peak is the maximum over its phase."""

    step: int
    forward_peak_blocks: int
    forward_peak_bytes: int
    backward_peak_blocks: int
    backward_peak_bytes: int

    @property
    def peak_blocks(self) -> int:
        return max(self.forward_peak_blocks, self.backward_peak_blocks)

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes)


@dataclass(frozen=True, slots=True)
class FSDPStats:
    """Snapshot of an ``ok.fsdp`` model's memory accounting (``ok.fsdp_stats(model)``)."""

    prefetch: int
    block_names: tuple[str, ...]
    """Qualified names of the blocks, in forward order."""
    block_unsharded_bytes: tuple[int, ...]
    """Bytes of each block's parameters when unsharded (in the all-gather dtype)."""
    forward_bound_blocks: int
    """Most blocks the prefetch lists in force keep unsharded at once in forward (``ok.fsdp``'s
    own: ``1 + prefetch``, fewer when there are no more blocks; ``fsdp.prefetch_lists``)."""
    backward_bound_blocks: int
    """Most blocks unsharded at once in backward (``ok.fsdp``'s own: ``1 + max(prefetch, 1)``)."""
    steps: tuple[StepUnshard, ...]
    """Completed steps, oldest first (the most recent ``DEFAULT_CAPACITY``)."""
    last_step_events: tuple[UnshardEvent, ...]
    """Every event of the most recent completed step, in order."""
    prefetch_replaced: bool
    """Whether the explicit prefetch lists in force are not ``ok.fsdp``'s (a script set its own
    with ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``); the
    bounds are then those of its lists."""

    @property
    def peak_blocks(self) -> int:
        """Peak unsharded blocks over all recorded steps (0 before the first step)."""
        return max((s.peak_blocks for s in self.steps), default=0)

    @property
    def peak_bytes(self) -> int:
        """Peak unsharded block bytes over all recorded steps."""
        return max((s.peak_bytes for s in self.steps), default=0)

    def within_bound(self) -> bool:
        """Whether every recorded step stayed within the forward and backward bounds in force."""
        return all(
            s.forward_peak_blocks <= self.forward_bound_blocks
            and s.backward_peak_blocks <= self.backward_bound_blocks
            for s in self.steps
        )


def unshard_peaks(
    events: Iterable[UnshardEvent], block_bytes: Sequence[int]
) -> dict[str, tuple[int, int]]:
    """Peak number of live blocks and peak live bytes per phase, from a step's events.

    A block is live from its ``all_gather`` (or ``held``) event until its ``reshard`` event.
    The root (``block < 0``) is not counted.

    Returns:
        dict: ``{"forward": (blocks, bytes), "backward": (blocks, bytes)}``.
    """
    live: set[int] = set()
    peaks = {phase: (0, 0) for phase in PHASES}
    for event in events:
        if event.block < 0:
            continue
        if event.kind in ("all_gather", "held"):
            live.add(event.block)
        elif event.kind == "reshard":
            live.discard(event.block)
        blocks, nbytes = peaks[event.phase]
        peaks[event.phase] = (
            max(blocks, len(live)),
            max(nbytes, sum(block_bytes[i] for i in live)),
        )
    return peaks


def _is_sharded(module: nn.Module) -> bool:
    # FSDP2 registers DTensor parameters while sharded and plain tensors while unsharded.
    return all(isinstance(p, DTensor) for p in module.parameters())


class UnshardRecorder:
    """Collects ``UnshardEvent``s from hooks and the all-gather comms, one step at a time.

    A step begins at its first event (which may be a prefetch issued right after the previous
    optimizer step) and ends when backward finishes, or after a forward run without autograd.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        block_bytes: Sequence[int],
        capacity: int = DEFAULT_CAPACITY,
    ):
        self.blocks = list(blocks)
        self.block_bytes = list(block_bytes)
        self._steps: deque[StepUnshard] = deque(maxlen=capacity)
        self._last_events: tuple[UnshardEvent, ...] = ()
        self._events: list[UnshardEvent] | None = None
        self._phase = "forward"
        self._unsharded: set[int] = set()
        self._works: dict[int, dist.Work] = {}
        self._backward_started: set[int] = set()
        self._end_queued = False
        self._step = 0

    @property
    def step(self) -> int:
        """The step in progress (0-based): the number of steps completed so far."""
        return self._step

    # -- events ----------------------------------------------------------------------------
    def _open(self) -> None:
        if self._events is None:
            self._events = []
            self._phase = "forward"
            self._backward_started.clear()
            self._unsharded = {i for i, b in enumerate(self.blocks) if not _is_sharded(b)}
            for i in sorted(self._unsharded):
                self._emit("held", i)

    def _emit(self, kind: str, block: int, **fields) -> None:
        assert self._events is not None
        self._events.append(
            UnshardEvent(kind, block, self._phase, time.perf_counter() * 1e3, **fields)
        )

    def _sample_reshards(self) -> None:
        for i in sorted(self._unsharded):
            if _is_sharded(self.blocks[i]):
                self._unsharded.discard(i)
                self._emit("reshard", i)

    def all_gather_issued(self, block: int, work: dist.Work | None) -> None:
        """Called by a block's all-gather comm right after issuing the collective."""
        self._open()
        self._sample_reshards()
        if block >= 0 and work is not None:
            self._works[block] = work
        self._emit("all_gather", block, async_op=work is not None)

    def compute_start(self, block: int) -> None:
        """Called once FSDP2 has unsharded ``block``, just before its compute starts."""
        self._open()
        self._sample_reshards()
        in_flight = tuple(sorted(b for b, w in self._works.items() if not w.is_completed()))
        self._works.pop(block, None)
        self._unsharded.add(block)
        self._emit("compute", block, in_flight=in_flight)

    # -- hooks -----------------------------------------------------------------------------
    def block_post_forward(self, block: int, output: object) -> None:
        self._open()
        self._sample_reshards()
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in _tensors(output) if t.requires_grad]
        for tensor in tensors:
            tensor.register_hook(self._backward_hook(block))

    def _backward_hook(self, block: int):
        def hook(grad: torch.Tensor) -> None:
            # Runs after FSDP2's pre-backward hook on the same tensor (hooks run in order).
            if block in self._backward_started:
                return
            self._backward_started.add(block)
            if not self._end_queued:
                Variable._execution_engine.queue_callback(self._end_backward)
                self._end_queued = True
            self.compute_start(block)

        return hook

    def root_pre_forward(self) -> None:
        # A previous forward whose backward never ran (evaluation with autograd on) or raised
        # (its end-of-backward callback never came) ends here.
        if self._events is not None and self._phase == "backward":
            self._end_queued = False
            self._close()

    def root_post_forward(self) -> None:
        self._open()
        self._sample_reshards()
        self._phase = "backward"
        if not torch.is_grad_enabled():
            self._close()

    def _end_backward(self) -> None:
        self._end_queued = False
        if self._events is not None:
            self._sample_reshards()
            self._close()

    def _close(self) -> None:
        assert self._events is not None
        peaks = unshard_peaks(self._events, self.block_bytes)
        self._steps.append(StepUnshard(self._step, *peaks["forward"], *peaks["backward"]))
        self._last_events = tuple(self._events)
        self._events = None
        self._works.clear()
        self._step += 1

    def snapshot(self) -> tuple[tuple[StepUnshard, ...], tuple[UnshardEvent, ...]]:
        return tuple(self._steps), self._last_events


def _tensors(output: object) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []
