"""Interval arithmetic: examples with known answers, and properties against a brute-force grid."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlapkit.profiling import intervals


def test_union_merges_overlapping_and_touching_and_drops_empty():
    got = intervals.union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9), (6, 6.5)])
    assert got == [(0, 4), (5, 7)]


def test_union_of_nested_intervals_is_the_outer_one():
    assert intervals.union([(0, 100), (10, 90), (20, 30)]) == [(0, 100)]


def test_union_rejects_an_interval_that_ends_before_it_starts():
    with pytest.raises(ValueError, match=r"\(5, 3\) ends before it starts"):
        intervals.union([(5, 3)])


def test_subtract_cuts_holes_and_edges():
    a = [(0, 10), (20, 30)]
    b = [(2, 4), (8, 22), (29, 40)]
    assert intervals.subtract(a, b) == [(0, 2), (4, 8), (22, 29)]


def test_subtract_of_a_covered_interval_is_empty_and_of_nothing_is_itself():
    assert intervals.subtract([(3, 5)], [(0, 10)]) == []
    assert intervals.subtract([(3, 5)], []) == [(3, 5)]


def test_intersect_keeps_only_common_parts():
    assert intervals.intersect([(0, 10), (20, 30)], [(5, 25)]) == [(5, 10), (20, 25)]


def test_clip_cuts_to_the_window():
    assert intervals.clip([(0, 10), (20, 30), (40, 50)], 5, 45) == [(5, 10), (20, 30), (40, 45)]
    assert intervals.clip([(0, 10)], 10, 20) == []
    assert intervals.clip([(0, 10)], 5, 5) == []


def test_contains_is_half_open():
    disjoint = [(0, 10), (20, 30)]
    assert intervals.contains(disjoint, 0)
    assert not intervals.contains(disjoint, 10)
    assert intervals.contains(disjoint, 25)
    assert not intervals.contains(disjoint, -1)
    assert not intervals.contains([], 3)


# Property tests: integer endpoints on a small grid, checked cell by cell.
GRID = 40
_raw = st.lists(
    st.tuples(st.integers(0, GRID), st.integers(0, GRID)).map(lambda t: (min(t), max(t))),
    max_size=8,
)


def _cells(disjoint: list[tuple[float, float]]) -> set[int]:
    return {c for s, e in disjoint for c in range(int(s), int(e))}


@settings(max_examples=300, deadline=None)
@given(_raw)
def test_union_is_disjoint_sorted_and_covers_the_same_cells(raw):
    merged = intervals.union(raw)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(merged))
    assert _cells(merged) == _cells(raw)
    assert intervals.total(merged) == len(_cells(raw))


@settings(max_examples=300, deadline=None)
@given(_raw, _raw)
def test_subtract_and_intersect_match_set_difference_and_intersection(raw_a, raw_b):
    a, b = intervals.union(raw_a), intervals.union(raw_b)
    diff = intervals.subtract(a, b)
    both = intervals.intersect(a, b)
    assert _cells(diff) == _cells(a) - _cells(b)
    assert _cells(both) == _cells(a) & _cells(b)
    assert intervals.total(diff) + intervals.total(both) == intervals.total(a)
    assert intervals.union(diff) == diff


@settings(max_examples=300, deadline=None)
@given(_raw, st.integers(0, GRID), st.integers(0, GRID))
def test_clip_matches_intersection_with_the_window(raw, lo, hi):
    a = intervals.union(raw)
    window = [(lo, hi)] if lo < hi else []
    assert intervals.clip(a, lo, hi) == intervals.intersect(a, window)
