"""Explicit prefetch lists: the ones ``ok.fsdp`` sets, the ones in force, and the bound they give.

FSDP2 keeps, per ``fully_shard``-ed module, the modules whose all-gathers it issues right after
its own, in forward (``set_modules_to_forward_prefetch``) and in backward
(``set_modules_to_backward_prefetch``; an empty backward list means FSDP2's implicit one: the
module that ran its forward just before). ``ok.fsdp(prefetch=d)`` sets them to the next ``d``
blocks (``overlapkit.fsdp.prefetch``), but a script may set its own afterwards (pytorch/examples'
FSDP2 example with ``--explicit-prefetching``: two blocks ahead), which replaces ``ok.fsdp``'s.
``lists_in_force`` reads what FSDP2 will do, and ``unsharded_bound`` the most blocks those lists
keep unsharded at once, which is what ``ok.fsdp_stats`` bounds its measured peaks by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.fsdp import FSDPModule

Targets = tuple[int, ...]
"""Block indices (forward order) whose all-gathers a module issues."""


@dataclass(frozen=True, slots=True)
class PrefetchLists:
    """The explicit prefetch targets of the root and of each block, as block indices."""

    forward: tuple[Targets, ...]
    """Per block, in forward order: the blocks it prefetches in forward."""
    backward: tuple[Targets, ...]
    """Per block: the blocks it prefetches in backward (empty: FSDP2's implicit previous one)."""
    root_forward: Targets
    root_backward: Targets


def ok_fsdp_lists(blocks: int, depth: int) -> PrefetchLists:
    """The lists ``ok.fsdp(prefetch=depth)`` sets on ``blocks`` blocks.

    Forward: block i prefetches i+1 .. i+depth and the root blocks 0 .. depth-1. Backward: block
    i prefetches i-1 .. i-depth and the root (whose pre-backward runs first) the last ``depth``
    blocks. ``depth=0`` sets none (FSDP2's default behaviour).
    """
    order = range(blocks)
    return PrefetchLists(
        forward=tuple(tuple(order[i + 1 : i + 1 + depth]) for i in order),
        backward=tuple(tuple(order[max(0, i - depth) : i][::-1]) for i in order),
        root_forward=tuple(order[:depth]),
        root_backward=tuple(order[::-1][:depth]),
    )


def apply_lists(root: FSDPModule, blocks: Sequence[FSDPModule], lists: PrefetchLists) -> None:
    """Set ``lists`` on FSDP2 (every list, empty ones included, replacing what was there)."""
    for block, forward, backward in zip(blocks, lists.forward, lists.backward, strict=True):
        block.set_modules_to_forward_prefetch([blocks[j] for j in forward])
        block.set_modules_to_backward_prefetch([blocks[j] for j in backward])
    root.set_modules_to_forward_prefetch([blocks[j] for j in lists.root_forward])
    root.set_modules_to_backward_prefetch([blocks[j] for j in lists.root_backward])


def lists_in_force(root: FSDPModule, blocks: Sequence[FSDPModule]) -> PrefetchLists:
    """The lists FSDP2 holds now, as block indices (targets that are not blocks are left out).

    FSDP2 has setters for them and no getter: they are read from its per-module state
    (``FSDPState._states_to_forward_prefetch`` / ``_states_to_backward_prefetch``, the same in
    torch 2.11 and 2.13), here only.
    """
    index = {id(block._get_fsdp_state()): i for i, block in enumerate(blocks)}

    def targets(module: FSDPModule, attribute: str) -> Targets:
        states = getattr(module._get_fsdp_state(), attribute)
        return tuple(index[id(s)] for s in states if id(s) in index)

    return PrefetchLists(
        forward=tuple(targets(b, "_states_to_forward_prefetch") for b in blocks),
        backward=tuple(targets(b, "_states_to_backward_prefetch") for b in blocks),
        root_forward=targets(root, "_states_to_forward_prefetch"),
        root_backward=targets(root, "_states_to_backward_prefetch"),
    )


def unsharded_bound(lists: PrefetchLists, *, reshard_after_forward: bool) -> tuple[int, int]:
    """The most blocks whose parameters are unsharded at once, in forward and in backward.

    Follows FSDP2's order of one step: the root's prefetches, then per block (forward order,
    then reversed in backward) its own all-gather, its prefetches, its compute, and its reshard
    (after forward only with ``reshard_after_forward``; always after backward). A block is
    counted from the all-gather that unshards it to its reshard, as ``ok.fsdp_stats`` measures.

    Args:
        lists (PrefetchLists): the lists in force.
        reshard_after_forward (bool): whether blocks free their unsharded parameters after
            their forward (``keywords.frees_after_forward``).

    Returns:
        tuple[int, int]: (forward, backward) blocks.
    """
    blocks = len(lists.forward)
    live: set[int] = set(lists.root_forward)
    forward_peak = 0
    for i in range(blocks):
        live |= {i, *lists.forward[i]}
        forward_peak = max(forward_peak, len(live))
        if reshard_after_forward:
            live.discard(i)
    # FSDP2's implicit backward prefetch: the module whose forward ran just before (for the
    # root, which runs its forward last, the last block).
    implicit = [(i - 1,) if i > 0 else () for i in range(blocks + 1)]
    live |= set(lists.root_backward or implicit[blocks])
    backward_peak = 0
    for i in reversed(range(blocks)):
        live |= {i, *(lists.backward[i] or implicit[i])}
        backward_peak = max(backward_peak, len(live))
        live.discard(i)
    return forward_peak, backward_peak


def _rows(lists: PrefetchLists, direction: str) -> tuple[Targets, ...]:
    """The root's targets, then each block's, in ``direction`` (``"forward"``/``"backward"``)."""
    root = lists.root_forward if direction == "forward" else lists.root_backward
    return (root, *getattr(lists, direction))


def describe_replacement(
    own: PrefetchLists, in_force: PrefetchLists, block_names: Sequence[str]
) -> str:
    """Where ``in_force`` differs from ``own``, in words: per direction, the setter, the first
    module that differs, its targets and ``ok.fsdp``'s, and how many more differ."""
    parts = []
    for direction in ("forward", "backward"):
        own_rows, force_rows = _rows(own, direction), _rows(in_force, direction)
        differing = [i for i, row in enumerate(force_rows) if row != own_rows[i]]
        if not differing:
            continue
        first = differing[0]
        module = "the root" if first == 0 else repr(block_names[first - 1])
        more = f" and {len(differing) - 1} more" if len(differing) > 1 else ""
        parts.append(
            f"set_modules_to_{direction}_prefetch: {module} prefetches "
            f"{[block_names[j] for j in force_rows[first]]} (ok.fsdp set "
            f"{[block_names[j] for j in own_rows[first]]}){more}"
        )
    return "; ".join(parts)
