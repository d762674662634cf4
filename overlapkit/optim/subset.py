"""A torch.optim optimizer stepped on a subset of its parameters, with the same bits.

``GradBucketer(optimizer=)`` updates one bucket at a time and ``overlapkit.fsdp.step_by_block``
one FSDP block at a time, both with the user's unmodified optimizer: its class's ``step`` runs on a
shallow view whose ``param_groups`` hold only the subset and whose ``state`` *is* the optimizer's
``state`` (shared by parameter key). Every torch.optim update of one parameter depends only on
that parameter, its gradient, its state and its group's hyper-parameters (the foreach and fused
kernels are element-wise per tensor), so stepping the subsets one after the other gives bitwise
what one ``optimizer.step()`` gives, and ``optimizer.state_dict()`` is the same object either way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch


def group_of(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """``id(param)`` -> the index of the param group holding it."""
    return {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}


def hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group without its ``params``; tensors (a tensor ``lr``) are copied, so a
    scheduler stepping the optimizer afterwards does not change them."""
    return [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]


def step_subset(
    optimizer: torch.optim.Optimizer,
    params: Iterable[torch.Tensor],
    *,
    hyper: list[dict] | None = None,
    groups: dict[int, int] | None = None,
) -> None:
    """Run ``type(optimizer).step`` on ``params`` only (those with a gradient).

    Args:
        optimizer (torch.optim.Optimizer): the user's optimizer; its state is updated in place.
        params (Iterable[Tensor]): parameters of ``optimizer`` to update.
        hyper (list[dict] | None): per param group, the hyper-parameters to use
            (``hyper_parameters`` taken earlier); None means the groups' current values.
        groups (dict | None): ``group_of(optimizer)``, if already at hand.

    The view has no step hooks of its own (the optimizer's would run once per subset) and is
    called through the class, so an LR scheduler's instance wrapper of ``optimizer.step`` (which
    counts calls) is not involved.
    """
    groups = group_of(optimizer) if groups is None else groups
    hyper = hyper_parameters(optimizer) if hyper is None else hyper
    chosen: dict[int, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            chosen.setdefault(groups[id(p)], []).append(p)
    if not chosen:
        return
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.__dict__.pop("step", None)
    view.param_groups = [{**hyper[g], "params": ps} for g, ps in chosen.items()]
    view._optimizer_step_pre_hooks = OrderedDict()
    view._optimizer_step_post_hooks = OrderedDict()
    type(optimizer).step(view)


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Record that ``optimizer`` has stepped, for the LR scheduler attached to it.

    An ``LRScheduler`` wraps its optimizer's ``step`` to set ``optimizer._opt_called`` and warns
    when ``scheduler.step()`` runs before any optimizer step. ``step_subset`` calls the class's
    ``step`` on views, past that wrapper, so a scheduler that steps the updates of one
    ``step()`` calls this once for them (``torch.optim.lr_scheduler``, torch 2.13).
    """
    optimizer._opt_called = True
