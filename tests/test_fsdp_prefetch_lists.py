"""Explicit prefetch lists and the bound they give (``overlapkit.fsdp.prefetch_lists``; no
processes). The bound is checked against the closed form docs/fsdp.md states for ``ok.fsdp``'s
own lists, and against the peaks measured on 2 gloo ranks in ``tests/test_fsdp_scripts.py``
(the FSDP2 example's own lists) and ``tests/test_fsdp_overlap.py``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from overlapkit.fsdp.prefetch_lists import (
    PrefetchLists,
    describe_replacement,
    ok_fsdp_lists,
    unsharded_bound,
)

NAMES = tuple(f"layers.{i}" for i in range(6))


def _example_lists(blocks: int, ahead: int, own: PrefetchLists) -> PrefetchLists:
    """pytorch/examples' FSDP2 ``--explicit-prefetching`` set over ``own``: each layer with
    ``ahead`` layers left (forward) or behind (backward) gets them; the others keep ``own``."""
    forward = tuple(
        tuple(range(i + 1, i + 1 + ahead)) if i + ahead < blocks else own.forward[i]
        for i in range(blocks)
    )
    backward = tuple(
        tuple(range(i - 1, i - 1 - ahead, -1)) if i >= ahead else own.backward[i]
        for i in range(blocks)
    )
    return PrefetchLists(forward, backward, own.root_forward, own.root_backward)


def test_ok_fsdp_prefetches_the_next_blocks_forward_and_the_previous_ones_backward():
    lists = ok_fsdp_lists(4, 2)
    assert lists.forward == ((1, 2), (2, 3), (3,), ())
    assert lists.backward == ((), (0,), (1, 0), (2, 1))
    assert (lists.root_forward, lists.root_backward) == ((0, 1), (3, 2))
    assert ok_fsdp_lists(4, 0) == PrefetchLists(((),) * 4, ((),) * 4, (), ())


@given(blocks=st.integers(1, 12), depth=st.sampled_from((0, 1, 2)))
def test_ok_fsdps_own_lists_give_one_plus_prefetch_where_there_are_enough_blocks(blocks, depth):
    forward, backward = unsharded_bound(ok_fsdp_lists(blocks, depth), reshard_after_forward=True)
    # docs/fsdp.md: forward <= 1 + prefetch, backward <= 1 + max(prefetch, 1) (FSDP2's implicit
    # one-block backward prefetch); reached when more blocks follow the computing one.
    assert forward <= 1 + depth and backward <= 1 + max(depth, 1)
    if blocks > depth:
        assert forward == 1 + depth
    if blocks > max(depth, 1):
        assert backward == 1 + max(depth, 1)


@given(blocks=st.integers(1, 12), depth=st.sampled_from((0, 1, 2)))
def test_blocks_kept_after_forward_are_all_unsharded_at_the_end_of_it(blocks, depth):
    lists = ok_fsdp_lists(blocks, depth)
    assert unsharded_bound(lists, reshard_after_forward=False) == (blocks, blocks)


def test_the_fsdp2_examples_own_lists_keep_three_blocks_over_ok_fsdps_prefetch_1():
    own = ok_fsdp_lists(4, 1)
    example = _example_lists(4, 2, own)
    assert unsharded_bound(own, reshard_after_forward=True) == (2, 2)
    assert unsharded_bound(example, reshard_after_forward=True) == (3, 3)


def test_a_replacement_is_described_with_the_setter_the_module_and_both_lists():
    own = ok_fsdp_lists(4, 1)
    text = describe_replacement(own, _example_lists(4, 2, own), NAMES)
    assert text == (
        "set_modules_to_forward_prefetch: 'layers.0' prefetches ['layers.1', 'layers.2'] "
        "(ok.fsdp set ['layers.1']) and 1 more; "
        "set_modules_to_backward_prefetch: 'layers.2' prefetches ['layers.1', 'layers.0'] "
        "(ok.fsdp set ['layers.1']) and 1 more"
    )
    root_only = PrefetchLists(own.forward, own.backward, (), own.root_backward)
    assert describe_replacement(own, root_only, NAMES) == (
        "set_modules_to_forward_prefetch: the root prefetches [] (ok.fsdp set ['layers.0'])"
    )


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_lists_that_are_ok_fsdps_describe_no_replacement(depth):
    own = ok_fsdp_lists(5, depth)
    assert describe_replacement(own, own, NAMES) == ""
