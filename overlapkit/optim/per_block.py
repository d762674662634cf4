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
from overlapkit.optim.subset import group_of, hyper_parameters, mark_stepped, step_subset


def step_by_sets(blocks: BlockSet, optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` over ``blocks.parameter_sets()``, one set after the other.

    After each set's update ``blocks.updated(index)`` runs, after the last
    ``blocks.all_updated()``; the optimizer's own step hooks do not run. Parameters of a set
    that the optimizer does not hold are left alone.

    Args:
        blocks (BlockSet): the sets, in update order.
        optimizer (torch.optim.Optimizer): the user's optimizer; its state is updated in place.
    """
    groups = group_of(optimizer)
    hyper = hyper_parameters(optimizer)
    for index, params in enumerate(blocks.parameter_sets()):
        step_subset(optimizer, [p for p in params if id(p) in groups], hyper=hyper, groups=groups)
        blocks.updated(index)
    mark_stepped(optimizer)
    blocks.all_updated()
