"""The array interval arithmetic equals the list one (``intervals``) on random intervals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from overlapkit.profiling import interval_arrays as ia
from overlapkit.profiling import intervals

spans = st.lists(
    st.tuples(st.integers(0, 200), st.integers(0, 40)).map(
        lambda t: (float(t[0]), float(t[0] + t[1]))
    ),
    max_size=30,
)


def _arrays(items):
    return np.array([s for s, _ in items], float), np.array([e for _, e in items], float)


@given(groups=st.lists(spans, min_size=1, max_size=5))
def test_grouped_union_is_each_groups_union(groups):
    g = np.concatenate([np.full(len(items), k) for k, items in enumerate(groups)]).astype(np.int64)
    s, e = _arrays([iv for items in groups for iv in items])
    out_g, out_s, out_e = ia.grouped_union(g, s, e)
    for k, items in enumerate(groups):
        mine = out_g == k
        assert list(zip(out_s[mine], out_e[mine], strict=True)) == intervals.union(items)


@given(a=spans, lo=st.integers(-10, 250), width=st.integers(0, 100))
def test_covered_is_the_length_of_the_clipped_union(a, lo, width):
    s, e = ia.union(*_arrays(a))
    cover = ia.Coverage(s, e)
    expected = intervals.total(intervals.clip(intervals.union(a), lo, lo + width))
    assert cover.covered(np.array([lo], float), np.array([lo + width], float))[0] == pytest.approx(
        expected
    )


@given(a=spans, b=spans)
def test_subtract_equals_the_list_subtract(a, b):
    ua, ub = intervals.union(a), intervals.union(b)
    s, e = ia.subtract(*_arrays(ua), *_arrays(ub))
    assert list(zip(s.tolist(), e.tolist(), strict=True)) == intervals.subtract(ua, ub)


@given(a=spans, t=st.lists(st.integers(-5, 250), max_size=10))
def test_contains_and_last_end_before_agree_with_the_lists(a, t):
    u = intervals.union(a)
    s, e = _arrays(u)
    times = np.array(t, float)
    assert ia.contains(s, e, times).tolist() == [intervals.contains(u, x) for x in t]
    ends = ia.Coverage(s, e).last_end_before(times, np.full(len(t), -1.0))
    expected = [
        max((end for start, end in u if start < x), key=lambda v: v, default=-1.0) for x in t
    ]
    # The last interval starting before t is the one with the largest start < t.
    expected = [next((end for start, end in reversed(u) if start < x), -1.0) for x in t]
    assert ends.tolist() == expected
