"""Per-step records of one rank: the loop's phases and its waits, in a fixed-size ring.

A step is timed by its phases (``data``: waiting for the next batch; ``forward``;
``backward``; ``sync``: the wrapper's end of backward; ``optimizer``), each entered with
``StepClock.phase(name)``. Per phase the clock reads the wall clock and the training thread's
run time (``waits.ThreadRunTime``); the ``WaitTimer`` counts, meanwhile, the thread's blocked
time in collectives. A closed step becomes one row of ``FIELDS`` (ms), so that a window of steps
is a fixed-size array whatever happened in it:

- ``wall``: the phases' wall time (time between phases is not the step's);
- ``data``: wall time of the ``data`` phases;
- ``busy``: run time of the other phases: the rank computing (on a CPU, or ready to and
  waiting for one: with more ranks than cores a computing rank is descheduled, and that is
  compute taking longer, not a host gap);
- ``wait``: blocked in collectives (``wait_<kind>`` by kind); the live exposed communication;
- ``gap`` (derived, ``gap_ms``): the rest, neither computing, nor waiting for data or a
  collective: a host gap (a sleep, a blocking system call, a page fault).

Memory is ``capacity x len(FIELDS)`` floats, allocated once.
"""

from __future__ import annotations

import time

import numpy as np

from overlapkit.live.waits import KINDS, WaitTimer

PHASES = ("data", "forward", "backward", "sync", "optimizer")
FIELDS = ("step", "wall", "data", "busy", "wait", *(f"wait_{k}" for k in KINDS))
STEP, WALL, DATA, BUSY, WAIT = range(5)
WAIT_KINDS = slice(5, 5 + len(KINDS))


class _Phase:
    """One phase's context manager (reused: entering it twice in a step adds up)."""

    __slots__ = ("_clock", "_cpu", "_data", "ended_ms", "started_ms")

    def __init__(self, clock: StepClock, data: bool):
        self._clock, self._data = clock, data
        self._cpu = self.started_ms = self.ended_ms = 0.0
        """``started_ms``/``ended_ms``: the last entry and exit, ms of ``time.perf_counter``."""

    def __enter__(self) -> None:
        self._clock.timer.active = True
        self.started_ms = time.perf_counter() * 1e3
        self._cpu = self._clock.timer.run_time.ms()

    def __exit__(self, *exc: object) -> None:
        self.ended_ms = time.perf_counter() * 1e3
        wall = self.ended_ms - self.started_ms
        cpu = self._clock.timer.run_time.ms() - self._cpu
        self._clock.timer.active = False
        row = self._clock.current
        row[WALL] += wall
        if self._data:
            row[DATA] += wall
        else:
            row[BUSY] += cpu


class StepClock:
    """Times one rank's steps into a ring of ``capacity`` rows.

    Create it on the thread it times (the training thread).

    Args:
        timer (WaitTimer): counts the waits; installed on the training thread by the caller.
        capacity (int): rows kept (the newest); at least a window.
    """

    def __init__(self, timer: WaitTimer, capacity: int):
        if capacity < 1:
            raise ValueError(f"StepClock capacity must be >= 1, got {capacity}")
        self.timer = timer
        self.rows = np.zeros((capacity, len(FIELDS)))
        self.current = np.zeros(len(FIELDS))
        self.closed = 0
        """Steps closed so far (the ring holds the newest ``capacity`` of them)."""
        self._phases = {name: _Phase(self, data=name == "data") for name in PHASES}

    def phase(self, name: str) -> _Phase:
        """The context manager timing phase ``name`` (one of ``PHASES``)."""
        return self._phases[name]

    def add_wait(self, kind: int, ms: float) -> None:
        """Count a wait the timer cannot see (the DDP reducer's, in C++) in the open step."""
        self.current[WAIT_KINDS.start + kind] += ms

    def settle_device_waits(self, since: int) -> None:
        """Count the device waits done by now (``WaitTimer.resolved``: no host sync) in their
        steps' rows; a wait whose step is before closed index ``since`` (already gathered) or
        out of the ring is counted in the open step instead, late rather than lost."""
        oldest = max(since, self.closed - len(self.rows))
        for index, kind, ms in self.timer.resolved():
            if oldest <= index < self.closed:
                row = self.rows[index % len(self.rows)]
                row[WAIT] += ms
            else:
                row = self.current  # its WAIT is summed when it closes
            row[WAIT_KINDS.start + kind] += ms

    def close_step(self, step: int) -> np.ndarray:
        """Close the open step as ``step``; returns its row (a view into the ring)."""
        row = self.current
        waits = self.timer.drain()
        row[WAIT_KINDS] += waits
        row[WAIT] = row[WAIT_KINDS].sum()
        row[STEP] = step
        slot = self.rows[self.closed % len(self.rows)]
        slot[:] = row
        row[:] = 0.0
        self.closed += 1
        return slot

    def last(self, count: int) -> np.ndarray:
        """The newest ``count`` closed rows, oldest first (fewer if fewer were closed)."""
        count = min(count, self.closed, len(self.rows))
        index = [(self.closed - count + k) % len(self.rows) for k in range(count)]
        return self.rows[index]


def gap_ms(rows: np.ndarray) -> np.ndarray:
    """Per row: wall time neither computing nor waiting (for data or a collective), ms >= 0."""
    return np.maximum(rows[..., WALL] - rows[..., DATA] - rows[..., BUSY] - rows[..., WAIT], 0.0)
