"""The live straggler rule: which rank's late arrivals cost the others, why, and since when.

Rank 0 applies it to each window of steps every rank recorded (``ranks x steps x FIELDS``,
``overlapkit.live.steps``). In a synchronous step a rank that arrives late at a collective
makes every other rank wait for it there, and waits less itself; so per step the rank's
**lateness** is the median of the other ranks' collective waits minus its own (the difference of
their arrivals at the collective that ended the wait: each rank's clock is only ever compared
with itself, so hosts need no clock alignment). A window's statistic per rank is the median over
its steps (robust to a single descheduled step) of that lateness and of:

- the excess of its ``data`` time (waiting for the next batch) over the others' median;
- the excess of its ``busy`` time (computing);
- the excess of its ``gap`` (neither computing nor waiting: a host gap);
- its collective waits by kind.

A layout need not be symmetric (pipeline stages wait differently), so every statistic is taken
relative to the rank's own **baseline**, its median over the calibration windows (after the
first, warm-up, window). The **noise** is measured by the rule itself: the robust spread of
step-to-step changes of lateness (``1.4826 x MAD / sqrt(2)``, blind to a steady offset), the
median over the recent quiet windows (nobody above the threshold or named); the threshold on a
window median is ``noise_factor x noise / sqrt(steps)``, at least ``floor_ms``.

Change points: a rank is **named** when its lateness over baseline exceeds the threshold in
``confirm_windows`` consecutive windows; its onset is the change point of its lateness from none
to its level now (a CUSUM with each step's weight bounded); it is **recovered** when below the
threshold for as many windows. Named: the rank; ``cause`` the largest excess among
``data_loading``, ``compute``, ``host_gap`` (the trace report's names); ``collective`` the kind
the others waited longer on; ``cost_ms`` the lateness over baseline, ms per step (the others'
extra wait for it).
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from overlapkit.live.steps import BUSY, DATA, STEP, WAIT, WAIT_KINDS, gap_ms
from overlapkit.live.waits import KINDS

CAUSES = ("data_loading", "compute", "host_gap")
MAD_TO_SIGMA = 1.4826
NOISE_WINDOWS = 32
"""Recent windows whose noise estimates the threshold takes the median of."""
ONSET_WINDOWS = 3
"""Windows of per-step lateness kept per rank to find an onset in."""
HISTORY = 64
"""Stragglers kept (the costliest) over a run of any length."""


@dataclass(slots=True)
class LiveStraggler:
    """One rank named as holding the others back, from its onset to its recovery (ms)."""

    rank: int
    collective: str
    """The collective kind the others waited longer on (``KINDS``)."""
    cause: str
    """``data_loading``, ``compute`` or ``host_gap``."""
    cost_ms: float
    """The others' extra wait per step for it (median over its windows), ms per step."""
    step: int
    """The first step of its onset (the change point)."""
    named_at: int
    """The last step of the window in which it was named."""
    last_step: int | None = None
    """The last step it was slow in; None while it still is."""
    steps: int = 0
    """Steps of its windows while named."""
    excess_ms: dict[str, float] = field(default_factory=dict)
    """Per cause, its excess over the others' median, ms per step (over baseline)."""
    _costs: list[float] = field(default_factory=list, repr=False)

    @property
    def total_cost_ms(self) -> float:
        """``cost_ms`` times the steps named: what it cost the run, ms."""
        return self.cost_ms * self.steps

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["_costs"]
        out["total_cost_ms"] = self.total_cost_ms
        return out


def others_median(values: np.ndarray) -> np.ndarray:
    """Per rank (axis 0), the median of the other ranks' values (``ranks x ...``)."""
    ranks = values.shape[0]
    if ranks < 2:
        return np.full_like(values, np.nan)
    return np.stack([np.median(np.delete(values, r, axis=0), axis=0) for r in range(ranks)])


def window_statistics(window: np.ndarray) -> np.ndarray:
    """Per rank: medians over the window's steps of lateness, the three cause excesses and the
    waits by kind (``ranks x (4 + len(KINDS))``); steps with a NaN row are left out."""
    steps = ~np.isnan(window[..., STEP]).any(axis=0)
    window = window[:, steps]
    parts = [window[..., DATA], window[..., BUSY], gap_ms(window)]
    lateness = others_median(window[..., WAIT]) - window[..., WAIT]
    excess = [p - others_median(p) for p in parts]
    columns = [lateness, *excess, *np.moveaxis(window[..., WAIT_KINDS], -1, 0)]
    return np.stack([np.median(c, axis=1) for c in columns], axis=1)


def step_lateness(window: np.ndarray) -> np.ndarray:
    """Per rank and step: the others' median wait minus its own (``ranks x steps``)."""
    return others_median(window[..., WAIT]) - window[..., WAIT]


def noise_of(lateness: np.ndarray) -> float:
    """The per-step spread of lateness, from its step-to-step changes (0 with < 2 steps)."""
    changes = np.diff(lateness, axis=1).ravel()
    changes = changes[~np.isnan(changes)]
    if len(changes) == 0:
        return 0.0
    mad = float(np.median(np.abs(changes - np.median(changes))))
    return MAD_TO_SIGMA * mad / np.sqrt(2.0)


class StragglerRule:
    """Names stragglers window by window (rank 0); see the module docstring.

    Args:
        noise_factor (float): the threshold in robust standard deviations of a window median.
        floor_ms (float): the smallest threshold, ms per step.
        calibration_windows (int): windows after the first that set each rank's baseline.
        confirm_windows (int): consecutive windows above (below) the threshold that name
            (recover) a rank.
    """

    def __init__(
        self,
        *,
        noise_factor: float = 6.0,
        floor_ms: float = 1.0,
        calibration_windows: int = 2,
        confirm_windows: int = 2,
    ):
        self.noise_factor = noise_factor
        self.floor_ms = floor_ms
        self.calibration_windows = calibration_windows
        self.confirm_windows = confirm_windows
        self.windows = 0
        self.named: dict[int, LiveStraggler] = {}
        self.history: list[LiveStraggler] = []
        self._calibration: list[np.ndarray] = []
        self._baseline: np.ndarray | None = None
        self._noise: collections.deque[float] = collections.deque(maxlen=NOISE_WINDOWS)
        self._lateness: collections.deque[np.ndarray] = collections.deque(maxlen=ONSET_WINDOWS)
        self._runs: dict[int, int] = {}
        self.threshold_ms: float | None = None

    @property
    def noise_ms(self) -> float | None:
        """The per-step noise of lateness, ms; None before the first measured window."""
        return float(np.median(self._noise)) if self._noise else None

    def observe(self, window: np.ndarray) -> list[LiveStraggler]:
        """Take one window (``ranks x steps x FIELDS``); return the stragglers named or
        recovered by it (the same objects ``named``/``history`` hold)."""
        self.windows += 1
        if self.windows == 1 or window.shape[0] < 2:  # the first window warms up
            return []
        stats = window_statistics(window)
        lateness = step_lateness(window)
        steps = window[0, :, STEP]
        self._lateness.append(np.vstack([steps, lateness]))
        noise = noise_of(lateness)
        if self._baseline is None:
            self._noise.append(noise)
            self._calibration.append(stats)
            if len(self._calibration) == self.calibration_windows:
                self._baseline = np.median(np.stack(self._calibration), axis=0)
            return []
        count = int((~np.isnan(steps)).sum())
        self.threshold_ms = max(self.floor_ms, self.noise_factor * self.noise_ms / np.sqrt(count))
        delta = stats - self._baseline
        if not self.named and (delta[:, 0] <= self.threshold_ms).all():
            # Noise is learnt from quiet windows only: a slow rank's own jitter (a delay that
            # varies) must not raise the bar that names it.
            self._noise.append(noise)
        return self._judge(delta, count, int(np.nanmax(steps)))

    def _judge(self, delta: np.ndarray, count: int, last_step: int) -> list[LiveStraggler]:
        changed = []
        threshold = self.threshold_ms
        for rank, row in enumerate(delta):
            named = self.named.get(rank)
            slow = row[0] > threshold
            run = self._runs.get(rank, 0)
            run = run + 1 if slow == (named is None) else 0
            self._runs[rank] = run
            if named is not None and slow:
                named._costs.append(float(row[0]))
                named.cost_ms = float(np.median(named._costs))
                named.steps += count
            if run < self.confirm_windows:
                continue
            self._runs[rank] = 0
            if named is None:
                changed.append(self._name(rank, delta, count, last_step))
            else:
                named.last_step = last_step - count * self.confirm_windows
                del self.named[rank]
                changed.append(named)
        return changed

    def _name(self, rank: int, delta: np.ndarray, count: int, last_step: int) -> LiveStraggler:
        row = delta[rank]
        others = np.delete(delta, rank, axis=0)
        waits = others[:, 4 : 4 + len(KINDS)].sum(axis=0) if len(others) else np.zeros(len(KINDS))
        onset = self._onset(rank, float(row[0]))
        named = LiveStraggler(
            rank=rank,
            collective=KINDS[int(np.argmax(waits))],
            cause=CAUSES[int(np.argmax(row[1:4]))],
            cost_ms=float(row[0]),
            step=onset,
            named_at=last_step,
            steps=last_step - onset + 1,
            excess_ms={c: float(v) for c, v in zip(CAUSES, row[1:4], strict=True)},
            _costs=[float(row[0])],
        )
        self.named[rank] = named
        self.history.append(named)
        self.history.sort(key=lambda s: -s.total_cost_ms)
        del self.history[HISTORY:]
        return named

    def _onset(self, rank: int, level: float) -> int:
        """The change point of ``rank``'s lateness over baseline among the kept windows, from
        about 0 to ``level`` (its lateness now): the step that maximises the sum, over it and
        the steps after it, of the lateness clipped to ``[0, level]`` less ``level / 2`` (a
        CUSUM of the mean shift, each step's weight bounded so that one noisy step does not
        outweigh the slow ones); the earliest such step."""
        kept = np.hstack(list(self._lateness))
        steps, lateness = kept[0], kept[1 + rank] - self._baseline[rank, 0]
        valid = ~np.isnan(steps)
        steps, lateness = steps[valid], lateness[valid]
        level = max(level, self.threshold_ms)
        shift = np.clip(lateness, 0.0, level) - level / 2
        after = np.cumsum(shift[::-1])[::-1]  # the sum over each step and the ones after it
        return int(steps[int(np.argmax(after))])

    def stragglers(self) -> list[LiveStraggler]:
        """Every straggler named in the run (bounded to ``HISTORY``), costliest first."""
        return sorted(self.history, key=lambda s: -s.total_cost_ms)
