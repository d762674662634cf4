"""Waits timed on a CUDA device: an event pair around each stream-wait, read without a host sync.

On CUDA a collective's ``Work.wait()`` (and ``wait_tensor``, and an NCCL future's ``wait()``)
does not block the host: it makes the current stream wait for the collective's end. What the
step loses is the stream's stall, so each wait is bracketed by two timing events recorded on
the current stream, one before the stream-wait and one after: their elapsed time is how long the
stream stood still on the collective (about 0 when the collective had already ended).

The pairs wait in a FIFO of at most ``capacity`` until ``resolve()``, which reads only the pairs
whose end event has completed (``Event.query()``: no synchronize) and carries the rest forward;
beyond ``capacity`` the oldest unread pair is dropped and counted (``dropped``), so memory is
bounded over a run of any length. Read events go to a free list and are recorded again.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

CAPACITY = 4096
"""Event pairs kept unread at most (a few steps of waits: the host runs a step or two ahead)."""


class DeviceWaits:
    """The waits of one thread timed on the device, by the step (``closed`` index) they are in.

    Args:
        capacity (int): unread pairs kept at most (the oldest is dropped beyond it).
    """

    __slots__ = ("_free", "dropped", "pending")

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.pending: deque[tuple[int, int, Any, Any]] = deque(maxlen=capacity)
        """``(step index, kind, start event, end event)``, oldest first."""
        self._free: list[Any] = []
        self.dropped = 0
        """Pairs dropped unread because ``capacity`` were waiting (their time is not counted)."""

    def _recorded(self) -> Any:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream, where the stream-wait goes
        return event

    def begin(self, kind: int) -> tuple[int, Any]:
        """Before the stream-wait on a collective of ``kind``: its start event."""
        return kind, self._recorded()

    def end(self, token: tuple[int, Any], step: int) -> None:
        """After the stream-wait ``begin`` returned ``token`` for, in step index ``step``."""
        kind, start = token
        if len(self.pending) == self.pending.maxlen:
            self.dropped += 1
        self.pending.append((step, kind, start, self._recorded()))

    def resolve(self) -> list[tuple[int, int, float]]:
        """The pairs done on the device, oldest first, as ``(step index, kind, ms)``; the rest
        stay queued. Never waits for the device."""
        done = []
        while self.pending and self.pending[0][3].query():
            step, kind, start, stop = self.pending.popleft()
            done.append((step, kind, start.elapsed_time(stop)))
            self._free += (start, stop)
        return done
