"""Interval arithmetic on the time axis: union, subtraction, intersection, clipping.

An interval is a ``(start, end)`` pair of floats with ``start <= end`` (microseconds in traces,
but nothing here depends on the unit). A *disjoint list* is sorted by start with no two intervals
overlapping or touching; ``union`` produces one, and the other functions expect them. All functions
are pure and run in O(n log n) or better, so they test without processes or traces.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge overlapping or touching intervals into a sorted disjoint list.

    Empty intervals (``start == end``) vanish; an interval with ``end < start`` is a caller bug.

    Raises:
        ValueError: an interval ends before it starts (names the interval).
    """
    items = sorted(intervals)
    merged: list[Interval] = []
    for start, end in items:
        if end < start:
            raise ValueError(f"interval ({start}, {end}) ends before it starts")
        if end == start:
            continue
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def total(disjoint: Iterable[Interval]) -> float:
    """Summed length of a disjoint list."""
    return sum(end - start for start, end in disjoint)


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts of ``a`` not covered by ``b`` (``a ∖ b``); both are disjoint lists."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        # Intervals of ``b`` ending before ``start`` can never cut a later interval of ``a``.
        while j < len(b) and b[j][1] <= start:
            j += 1
        cursor = start
        k = j
        while k < len(b) and b[k][0] < end:
            cut_start, cut_end = b[k]
            if cut_start > cursor:
                out.append((cursor, cut_start))
            cursor = max(cursor, cut_end)
            if cursor >= end:
                break
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts covered by both ``a`` and ``b``; both are disjoint lists."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start = max(a[i][0], b[j][0])
        end = min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def contains(disjoint: list[Interval], t: float) -> bool:
    """Whether time ``t`` lies in one of the intervals, taken as half-open ``[start, end)``."""
    i = bisect.bisect_right(disjoint, t, key=lambda iv: iv[0]) - 1
    return i >= 0 and t < disjoint[i][1]


def clip(disjoint: list[Interval], lo: float, hi: float) -> list[Interval]:
    """The part of a disjoint list inside ``[lo, hi]``, found by bisection (O(log n + k))."""
    if hi <= lo or not disjoint:
        return []
    # In a disjoint list the ends are sorted too, so the first interval ending after ``lo``
    # can be found by bisecting on the ends.
    first = bisect.bisect_right(disjoint, lo, key=lambda iv: iv[1])
    out: list[Interval] = []
    for start, end in disjoint[first:]:
        if start >= hi:
            break
        out.append((max(start, lo), min(end, hi)))
    return [iv for iv in out if iv[0] < iv[1]]
