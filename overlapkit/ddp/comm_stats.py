"""Per-bucket collective timings, kept in a fixed-size ring buffer.

A ``CommRecorder`` is written from the backward pass (a comm hook or the ``GradBucketer``) and read
whenever the user asks (``ok.comm_stats(model)``). Writing never synchronises the device:

- on CPU the completion time is taken in the collective future's completion callback;
- on CUDA a timing event is recorded on the launching stream and another in the completion
  callback (which runs on a stream that waits for the collective); the events are only turned
  into milliseconds when read, and only once ``query()`` says they are done.

DDP rebuilds its buckets at the second forward, so bucket indices mean different things before
and after. Each record carries a ``layout`` number that changes whenever the step's bucket sizes
change; ``CommStats.by_bucket()`` summarises only the latest layout.
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_CAPACITY = 4096


@dataclass(frozen=True, slots=True)
class BucketCommRecord:
    """One bucket's collective in one step.

    Times are milliseconds on one per-process clock (``time.perf_counter``), so differences
    between records of the same process are meaningful; ``done_ms`` is None while in flight.
    """

    step: int
    """Optimizer step (0-based) in which the bucket was reduced."""
    layout: int
    """Bucket layout generation; increases when the bucket sizes change (DDP's rebuild)."""
    bucket_index: int
    nbytes: int
    """Bytes of gradient in the bucket (what the model produced)."""
    wire_bytes: int | None
    """Bytes handed to the collective (smaller under compression); None when unknown."""
    launch_ms: float
    done_ms: float | None

    @property
    def comm_ms(self) -> float | None:
        """Launch-to-completion time in ms, or None while in flight."""
        return None if self.done_ms is None else self.done_ms - self.launch_ms


@dataclass(frozen=True, slots=True)
class BucketSummary:
    """Median timing of one bucket index over the steps of the latest layout."""

    bucket_index: int
    nbytes: int
    steps: int
    median_comm_ms: float
    median_launch_offset_ms: float
    """Median of launch time minus the first bucket's launch time in the same step."""


@dataclass(frozen=True, slots=True)
class CommStats:
    """Snapshot of a recorder: completed and in-flight records, oldest first."""

    records: tuple[BucketCommRecord, ...]
    skipped_steps: tuple[int, ...] = ()
    """Steps dropped by ``check_finite=True, on_nonfinite="skip"`` (NaN/Inf gradients)."""

    def latest_layout(self) -> tuple[BucketCommRecord, ...]:
        """Records of the most recent bucket layout that completed."""
        done = [r for r in self.records if r.done_ms is not None]
        if not done:
            return ()
        layout = done[-1].layout
        return tuple(r for r in done if r.layout == layout)

    def by_bucket(self) -> list[BucketSummary]:
        """Per bucket index of the latest layout: bytes, median comm time and launch offset."""
        records = self.latest_layout()
        first_launch = {}
        for r in records:
            first_launch[r.step] = min(first_launch.get(r.step, r.launch_ms), r.launch_ms)
        summaries = []
        for index in sorted({r.bucket_index for r in records}):
            rows = [r for r in records if r.bucket_index == index]
            summaries.append(
                BucketSummary(
                    bucket_index=index,
                    nbytes=rows[-1].nbytes,
                    steps=len(rows),
                    median_comm_ms=statistics.median(r.comm_ms for r in rows),
                    median_launch_offset_ms=statistics.median(
                        r.launch_ms - first_launch[r.step] for r in rows
                    ),
                )
            )
        return summaries


class CommRecorder:
    """Fixed-size ring buffer of per-bucket collective timings for one process.

    ``launch`` is called when a bucket's collective is issued and returns a slot; ``watch`` hooks
    the collective's future so completion is timestamped; ``end_step`` closes a step. Memory is
    allocated once (``capacity`` slots); the oldest records are overwritten.
    """

    __slots__ = (
        "_bucket_index",
        "_done",
        "_done_event",
        "_launch",
        "_launch_event",
        "_layout",
        "_nbytes",
        "_next",
        "_origin_event",
        "_origin_ms",
        "_sizes_last_step",
        "_sizes_this_step",
        "_step",
        "_wire_bytes",
        "capacity",
        "layout",
        "skipped_steps",
        "step",
    )

    def __init__(self, capacity: int = DEFAULT_CAPACITY, device: torch.device | None = None):
        if capacity < 1:
            raise ValueError(f"CommRecorder capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.step = 0
        self.layout = 0
        self.skipped_steps: list[int] = []
        self._next = 0
        self._step = [-1] * capacity
        self._layout = [0] * capacity
        self._bucket_index = [0] * capacity
        self._nbytes = [0] * capacity
        self._wire_bytes: list[int | None] = [None] * capacity
        self._launch = [0.0] * capacity
        self._done: list[float | None] = [None] * capacity
        self._sizes_this_step: list[int] = []
        self._sizes_last_step: list[int] = []
        # CUDA events are created on a slot's first use, not all up front.
        use_events = device is not None and device.type == "cuda"
        self._launch_event: list[torch.cuda.Event | None] | None = (
            [None] * capacity if use_events else None
        )
        self._done_event: list[torch.cuda.Event | None] | None = (
            [None] * capacity if use_events else None
        )
        self._origin_event = None
        self._origin_ms = 0.0

    def launch(self, bucket_index: int, nbytes: int, wire_bytes: int | None) -> int:
        """Record that ``bucket_index`` (``nbytes`` of gradient) was issued now; return its slot."""
        slot = self._next
        self._next = (slot + 1) % self.capacity
        self._step[slot] = self.step
        self._bucket_index[slot] = bucket_index
        self._nbytes[slot] = nbytes
        self._wire_bytes[slot] = wire_bytes
        self._done[slot] = None
        self._sizes_this_step.append(nbytes)
        self._layout[slot] = self.layout
        if self._launch_event is None:
            self._launch[slot] = time.perf_counter() * 1e3
        else:
            if self._origin_event is None:
                self._origin_event = torch.cuda.Event(enable_timing=True)
                self._origin_event.record()
                self._origin_ms = time.perf_counter() * 1e3
            if self._launch_event[slot] is None:
                self._launch_event[slot] = torch.cuda.Event(enable_timing=True)
                self._done_event[slot] = torch.cuda.Event(enable_timing=True)
            self._launch_event[slot].record()
        return slot

    def watch(self, slot: int, future: torch.futures.Future) -> None:
        """Timestamp ``slot`` when ``future`` completes (no wait, no device sync)."""
        if self._done_event is None:
            future.add_done_callback(lambda _fut: self._mark_done(slot))
        else:
            future.add_done_callback(lambda _fut: self._mark_done_cuda(slot))

    def callbacks_pending(self) -> bool:
        """Whether the completion callback of a watched collective has not run yet (its
        record has no completion time)."""
        return any(
            step >= 0 and done is None for step, done in zip(self._step, self._done, strict=True)
        )

    def _mark_done(self, slot: int) -> None:
        self._done[slot] = time.perf_counter() * 1e3

    def _mark_done_cuda(self, slot: int) -> None:
        # The callback runs with the current stream synchronised to the collective, so an event
        # recorded here completes when the collective does. ``_done`` only flags "recorded".
        self._done_event[slot].record()
        self._done[slot] = 0.0

    def end_step(self) -> None:
        """Close the current step; a change of bucket sizes starts a new layout."""
        if self._sizes_last_step and self._sizes_this_step != self._sizes_last_step:
            self.layout += 1
            # Records of this step already carry the old layout number; relabel them.
            for k in range(len(self._sizes_this_step)):
                self._layout[(self._next - 1 - k) % self.capacity] = self.layout
        self._sizes_last_step, self._sizes_this_step = self._sizes_this_step, []
        self.step += 1

    def _event_ms(self, event: torch.cuda.Event) -> float | None:
        if not event.query():
            return None
        return self._origin_ms + self._origin_event.elapsed_time(event)

    def snapshot(self) -> CommStats:
        """All records currently held, oldest first (in-flight ones have ``done_ms=None``)."""
        order = [(self._next + k) % self.capacity for k in range(self.capacity)]
        records = []
        for slot in order:
            if self._step[slot] < 0:
                continue
            if self._launch_event is None:
                launch_ms, done_ms = self._launch[slot], self._done[slot]
            else:
                launch_ms = self._event_ms(self._launch_event[slot])
                if launch_ms is None:
                    continue
                recorded = self._done[slot] is not None
                done_ms = self._event_ms(self._done_event[slot]) if recorded else None
            records.append(
                BucketCommRecord(
                    step=self._step[slot],
                    layout=self._layout[slot],
                    bucket_index=self._bucket_index[slot],
                    nbytes=self._nbytes[slot],
                    wire_bytes=self._wire_bytes[slot],
                    launch_ms=launch_ms,
                    done_ms=done_ms,
                )
            )
        return CommStats(tuple(records), tuple(self.skipped_steps))


# Recorders by the object that owns them (a DDP module, the module inside it, a GradBucketer),
# without keeping the owner alive.
_recorders: weakref.WeakKeyDictionary[Any, CommRecorder] = weakref.WeakKeyDictionary()


def _uncompiled(owner: Any) -> Any:
    # ``torch.compile(module)`` returns an OptimizedModule holding the module as ``_orig_mod``.
    while isinstance(owner, torch.nn.Module) and isinstance(
        getattr(owner, "_orig_mod", None), torch.nn.Module
    ):
        owner = owner._orig_mod
    return owner


def register_recorder(owner: Any, recorder: CommRecorder) -> None:
    """Make ``recorder`` what ``comm_stats(owner)`` reads (also for ``owner`` compiled)."""
    _recorders[_uncompiled(owner)] = recorder


def comm_stats(owner: Any) -> CommStats:
    """Per-bucket collective timings of a model from ``ok.ddp`` or an ``ok.GradBucketer``.

    Args:
        owner: the DistributedDataParallel ``ok.ddp`` returned or adopted, the module inside
            it (the model given to ``ok.ddp``; a LightningModule once ``Trainer.fit()`` has
            unwrapped it), either of them compiled (``torch.compile``), or an
            ``ok.GradBucketer``. A module wrapped by ``ok.ddp`` twice reads its latest wrapper.

    Returns:
        CommStats: records (step, layout, bucket index, bytes, launch/done ms), oldest first;
        ``.by_bucket()`` gives medians over the latest bucket layout.

    Raises:
        TypeError: ``owner`` is none of these.
    """
    try:
        recorder = _recorders.get(_uncompiled(owner))
    except TypeError:  # not hashable, so not a model or a bucketer
        recorder = None
    if recorder is None:
        raise TypeError(
            f"comm_stats() takes a model returned by ok.ddp() (or the module it wraps, compiled "
            f"or not) or an ok.GradBucketer, got {type(owner).__name__}"
        )
    return recorder.snapshot()
