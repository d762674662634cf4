"""``ok.LiveMonitor``: every step, the exposed communication and the rank that holds the job back.

Each rank times its steps (``StepClock``: the loop's phases, the training thread's waits on
collectives); every ``every`` steps one fixed-size ``gather`` (``every x len(FIELDS)``
float64 per rank) brings the window to rank 0, which applies the ``StragglerRule``, logs one
warning line when it names a rank (and one when the rank recovers), and keeps per-rank totals.
Memory is bounded: the ring of ``capacity`` steps, one window, the rule's few windows and at
most ``HISTORY`` stragglers. On CUDA the waits are timed on the device (``waits``) and the
windows gathered over a gloo group of the same ranks, CPU tensors: the monitor never syncs the
host with the device.

Example::

    >>> live = ok.LiveMonitor()   # every rank, after init_process_group
    >>> for step in range(1, steps + 1):
    ...     with live.phase("data"):
    ...         x, y = next(batches)
    ...     with live.phase("forward"):
    ...         loss = loss_fn(ddp_model(x), y)
    ...     with live.phase("backward"):
    ...         loss.backward()
    ...     with live.phase("optimizer"):
    ...         opt.step(); opt.zero_grad()
    ...     live.end_step(step)                   # a collective every `every` steps
    >>> live.close()                              # a collective: the last partial window
    >>> live.summary()["stragglers"]              # rank 0
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from overlapkit.group.process_group import backend_device_type, backend_of, inherit_timeout
from overlapkit.live.detect import LiveStraggler, StragglerRule
from overlapkit.live.steps import (
    BUSY,
    DATA,
    FIELDS,
    PHASES,
    STEP,
    WAIT,
    WALL,
    StepClock,
    gap_ms,
)
from overlapkit.live.waits import WaitTimer
from overlapkit.validation import check_int

logger = logging.getLogger(__name__)

TOTALS = ("steps", "wall_ms", "data_ms", "busy_ms", "wait_ms", "gap_ms")


@dataclass(kw_only=True, slots=True)
class LiveConfig:
    """The ``live`` config group (``ok.LiveMonitor``'s settings)."""

    every: int = 10
    """Steps per window: one fixed-size gather to rank 0 each ``every`` steps."""
    noise_factor: float = 6.0
    """Threshold on a window's median lateness, in robust standard deviations of it."""
    floor_ms: float = 1.0
    """The smallest threshold, ms per step."""
    calibration_windows: int = 2
    """Windows after the first (warm-up) that set each rank's baseline."""
    confirm_windows: int = 2
    """Consecutive windows above the threshold that name a rank (below it: recover it)."""
    capacity: int = 1024
    """Steps kept per rank (the newest)."""

    def __post_init__(self) -> None:
        check_int("live.every", self.every, 2)
        check_int("live.calibration_windows", self.calibration_windows, 1)
        check_int("live.confirm_windows", self.confirm_windows, 1)
        check_int("live.capacity", self.capacity, 1)
        if self.capacity < self.every:
            raise ValueError(
                f"live.capacity ({self.capacity}) must be >= live.every ({self.every}): the ring "
                "of steps holds at least a window"
            )
        if not self.noise_factor > 0:
            raise ValueError(f"live.noise_factor must be > 0, got {self.noise_factor!r}")
        if not self.floor_ms >= 0:
            raise ValueError(f"live.floor_ms must be >= 0 ms, got {self.floor_ms!r}")


@dataclass(frozen=True, slots=True)
class LiveWindow:
    """What rank 0 learned from one window (ms)."""

    steps: np.ndarray
    """The window's steps (``int``)."""
    wait_ms: np.ndarray
    """``ranks x steps``: each rank's collective waits, its live exposed communication."""
    changed: tuple[LiveStraggler, ...]
    """Stragglers named (``last_step`` None) or recovered by this window."""
    named: dict[int, LiveStraggler]
    """Every rank named now."""


class LiveMonitor:
    """Per-step exposed communication and live stragglers (every rank constructs one).

    Args:
        config (LiveConfig | None): settings. Defaults to ``LiveConfig()``.
        group (ProcessGroup | None): the ranks watched (all of them call ``end_step``).
            Defaults to the default group.
        device (torch.device | None): where the collectives run, which chooses how waits are
            timed (CUDA: on the device, by events). Defaults to the current CUDA device when the
            default group communicates on CUDA (``backend_device_type``), else the CPU.

    On a backend without CPU tensors (NCCL) every rank of the default group constructs one: it
    creates the gloo group its windows are gathered over.
    """

    def __init__(
        self, config: LiveConfig | None = None, *, group: Any = None, device: Any = None
    ) -> None:
        self.config = config or LiveConfig()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timer = WaitTimer(device if device is not None else _collective_device())
        self.gather_group = _window_group(group)
        """The group the windows go to rank 0 over: ``group``, or gloo's on its ranks."""
        self.timer.install()
        self.clock = StepClock(self.timer, self.config.capacity)
        self.rule = StragglerRule(
            noise_factor=self.config.noise_factor,
            floor_ms=self.config.floor_ms,
            calibration_windows=self.config.calibration_windows,
            confirm_windows=self.config.confirm_windows,
        )
        self.totals = np.zeros((self.world_size, len(TOTALS)))
        self.gather_ms = 0.0
        """Wall time this rank spent in the monitor's gathers, ms (its own cost, with the wait
        for the last rank to arrive)."""
        self._pending = 0

    def phase(self, name: str) -> Any:
        """Context manager timing phase ``name`` of the open step (one of ``PHASES``)."""
        if name not in PHASES:
            raise ValueError(f"LiveMonitor.phase name must be one of {list(PHASES)}, got {name!r}")
        return self.clock.phase(name)

    def end_step(self, step: int) -> LiveWindow | None:
        """Close ``step``; every ``every`` steps gather the window (a collective on every rank).

        Returns:
            LiveWindow | None: on rank 0 after a gather, what it found; otherwise None.
        """
        self.clock.close_step(step)
        self._pending += 1
        if self._pending < self.config.every:
            return None
        return self._gather()

    def exposed_ms(self, steps: int | None = None) -> float | None:
        """This rank's median collective wait over its newest ``steps`` steps (default: a window),
        ms per step; None before the first step (device waits: those done by now)."""
        self.clock.settle_device_waits(self.clock.closed - self._pending)
        rows = self.clock.last(steps or self.config.every)
        return float(np.median(rows[:, WAIT])) if len(rows) else None

    def close(self) -> LiveWindow | None:
        """Gather a last partial window (a collective on every rank) and ``stop``."""
        try:
            return self._gather() if self._pending else None
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop timing waits, without a collective (what an aborted run calls; idempotent)."""
        self.timer.uninstall()

    def _gather(self) -> LiveWindow | None:
        start = time.perf_counter()
        try:
            return self._gather_window()
        finally:
            self.gather_ms += (time.perf_counter() - start) * 1e3

    def _gather_window(self) -> LiveWindow | None:
        every = self.config.every
        self.clock.settle_device_waits(self.clock.closed - self._pending)
        mine = torch.full((every, len(FIELDS)), float("nan"), dtype=torch.float64)
        mine[: self._pending] = torch.from_numpy(self.clock.last(self._pending))
        self._pending = 0
        gathered = (
            [torch.empty_like(mine) for _ in range(self.world_size)] if self.rank == 0 else None
        )
        dist.gather(mine, gathered, group=self.gather_group, group_dst=0)
        if gathered is None:
            return None
        window = torch.stack(gathered).numpy()
        return self._judge(window)

    def _judge(self, window: np.ndarray) -> LiveWindow:
        valid = ~np.isnan(window[..., STEP]).any(axis=0)
        rows = window[:, valid]
        self.totals += np.stack(
            [
                np.full(len(rows), rows.shape[1]),
                rows[..., WALL].sum(axis=1),
                rows[..., DATA].sum(axis=1),
                rows[..., BUSY].sum(axis=1),
                rows[..., WAIT].sum(axis=1),
                gap_ms(rows).sum(axis=1),
            ],
            axis=1,
        )
        changed = self.rule.observe(window)
        for straggler in changed:
            _log_change(straggler)
        return LiveWindow(
            steps=rows[0, :, STEP].astype(int),
            wait_ms=rows[..., WAIT],
            changed=tuple(changed),
            named=dict(self.rule.named),
        )

    def summary(self) -> dict[str, Any]:
        """Rank 0's record of the run: settings, noise, per-rank totals, stragglers (ms)."""
        per_rank = []
        for rank, row in enumerate(self.totals):
            record = {"rank": rank, **{k: float(v) for k, v in zip(TOTALS, row, strict=True)}}
            record["steps"] = int(row[0])
            record["exposed_ms_per_step"] = float(row[4] / row[0]) if row[0] else None
            per_rank.append(record)
        steps = self.clock.closed
        return {
            "every": self.config.every,
            "gather_ms_per_step": self.gather_ms / steps if steps else None,
            "noise_ms": self.rule.noise_ms,
            "threshold_ms": self.rule.threshold_ms,
            "per_rank": per_rank,
            "stragglers": [s.to_dict() for s in self.rule.stragglers()],
        }


def _collective_device() -> torch.device:
    if backend_device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _window_group(group: Any) -> Any:
    backend = backend_of(group if group is not None else dist.group.WORLD)
    if backend == "gloo" or "cpu:gloo" in backend:
        return group
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return inherit_timeout(dist.new_group(ranks, backend="gloo"))


def _log_change(straggler: LiveStraggler) -> None:
    if straggler.last_step is None:
        logger.warning(
            "live: rank %d holds the job back since step %d (%s; the others wait in %s), "
            "%.1f ms per step",
            straggler.rank,
            straggler.step,
            straggler.cause,
            straggler.collective,
            straggler.cost_ms,
        )
    else:
        logger.warning(
            "live: rank %d recovered after step %d (cost %.1f ms per step over %d steps)",
            straggler.rank,
            straggler.last_step,
            straggler.cost_ms,
            straggler.steps,
        )
