"""The optimizer applied set by set in the order the next forward needs the parameters.

``overlapkit.fsdp.step_by_block`` updates an ``ok.fsdp`` model's root, then each block, in
forward order, and starts each of the first blocks' next all-gather as soon as that block is
updated; this module holds that loop, over any ``BlockSet`` (``overlapkit.optim.protocols``).
Each set is updated by ``step_subset`` with the hyper-parameters taken before the first one, so
the result is bitwise what one ``optimizer.step()`` gives.
"""

from __future__ import annotations

import torch

from overlapkit.optim.protocols import BlockSet
from overlapkit.optim.subset import (
    group_of,
    hyper_parameters,
    mark_stepped,
    run_step_hooks,
    step_hooks,
    step_subset,
)


def step_by_sets(blocks: BlockSet, optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` over ``blocks.parameter_sets()``, one set after the other.

    After each set's update ``blocks.updated(index)`` runs, after the last
    ``blocks.all_updated()``. The step pre/post hooks (the optimizer's and the global ones) run
    once, before the first set and after the last, as around one ``optimizer.step()``.
    Parameters of a set that the optimizer does not hold are left alone.

    Args:
        blocks (BlockSet): the sets, in update order.
        optimizer (torch.optim.Optimizer): the user's optimizer; its state is updated in place.
    """
    pre_hooks, post_hooks = step_hooks(optimizer)
    run_step_hooks(optimizer, pre_hooks)
    groups = group_of(optimizer)
    hyper = hyper_parameters(optimizer)
    for index, params in enumerate(blocks.parameter_sets()):
        step_subset(optimizer, [p for p in params if id(p) in groups], hyper=hyper, groups=groups)
        blocks.updated(index)
    mark_stepped(optimizer)
    run_step_hooks(optimizer, post_hooks)
    blocks.all_updated()
