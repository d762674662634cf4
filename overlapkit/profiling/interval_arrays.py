"""Interval arithmetic on numpy arrays: unions per group, covered measure, for whole traces.

``intervals`` does the same on Python lists, one step at a time; this module does every step of
a trace in a few array operations (tested equal on random intervals,
``tests/test_interval_arrays.py``). Intervals are ``(start, end)`` with ``start <= end``;
a union merges overlapping or touching intervals and drops empty ones, as ``intervals.union``.
"""

from __future__ import annotations

import numpy as np


def grouped_union(
    group: np.ndarray, start: np.ndarray, end: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The union of the intervals of each group, as ``(group, start, end)`` sorted by group
    then start (each group's part a disjoint list).

    Args:
        group (np.ndarray): int group of each interval (a step index, a lane, ...).
        start, end (np.ndarray): the intervals.
    """
    keep = end > start
    group, start, end = group[keep], start[keep], end[keep]
    if len(start) == 0:
        return group, start, end
    order = np.lexsort((start, group))
    group, start, end = group[order], start[order], end[order]
    # Shift each group past the previous one so that one running maximum serves all groups;
    # the shift only orders, the values kept are the original ones.
    origin = start[0] if len(start) else 0.0
    span = float(end.max() - start.min()) + 1.0
    shifted_start = (start - origin) + group * span
    running_end = np.maximum.accumulate((end - origin) + group * span)
    opens = np.empty(len(start), dtype=bool)
    opens[0] = True
    opens[1:] = (shifted_start[1:] > running_end[:-1]) | (group[1:] != group[:-1])
    first = np.flatnonzero(opens)
    return group[first], start[first], np.maximum.reduceat(end, first)


def union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of all intervals, a disjoint list ``(start, end)``."""
    _, s, e = grouped_union(np.zeros(len(start), dtype=np.int64), start, end)
    return s, e


class Coverage:
    """How much of any span a disjoint list covers, for many spans at once.

    Args:
        start, end (np.ndarray): a disjoint list (as ``union`` returns).
    """

    def __init__(self, start: np.ndarray, end: np.ndarray):
        self.start = start
        self.end = end
        lengths = end - start
        self.before = np.concatenate(([0.0], np.cumsum(lengths)))[:-1] if len(start) else start

    def _upto(self, t: np.ndarray) -> np.ndarray:
        """Measure of the list below ``t``."""
        if len(self.start) == 0:
            return np.zeros(np.shape(t))
        k = np.searchsorted(self.start, t, side="right") - 1
        inside = k >= 0
        kk = np.where(inside, k, 0)
        part = np.clip(t - self.start[kk], 0.0, self.end[kk] - self.start[kk])
        return np.where(inside, self.before[kk] + part, 0.0)

    def covered(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """For each span ``[lo, hi]``, the measure of the list inside it (0 where hi <= lo)."""
        return np.maximum(self._upto(hi) - self._upto(lo), 0.0)

    def last_end_before(self, t: np.ndarray, default: np.ndarray) -> np.ndarray:
        """The end of the last interval starting before ``t`` (``default`` where none does)."""
        if len(self.start) == 0:
            return default
        k = np.searchsorted(self.start, t, side="left") - 1
        return np.where(k >= 0, self.end[np.maximum(k, 0)], default)


def contains(start: np.ndarray, end: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Whether each time in ``t`` lies in the disjoint list, taken as half-open intervals."""
    if len(start) == 0:
        return np.zeros(len(t), dtype=bool)
    k = np.searchsorted(start, t, side="right") - 1
    return (k >= 0) & (t < end[np.maximum(k, 0)])


def subtract(a_start, a_end, b_start, b_end) -> tuple[np.ndarray, np.ndarray]:
    """``a ∖ b`` for two disjoint lists, as a disjoint list."""
    if len(b_start) == 0 or len(a_start) == 0:
        return a_start, a_end
    # Cut points: every boundary of a and b; keep the elementary pieces inside a and not in b.
    points = np.unique(np.concatenate((a_start, a_end, b_start, b_end)))
    lo, hi = points[:-1], points[1:]
    mid = (lo + hi) / 2
    keep = contains(a_start, a_end, mid) & ~contains(b_start, b_end, mid)
    return union(lo[keep], hi[keep])
