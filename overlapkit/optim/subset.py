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
from collections.abc import Callable, Iterable, Mapping
from itertools import chain

import torch
from torch.optim import optimizer as optimizer_module


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


def _unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], object]:
    """The class's ``step`` without the wrapper ``Optimizer.__init__`` puts around it.

    ``Optimizer._patch_step_function`` wraps each class's ``step`` once in
    ``profile_hook_step`` (``functools.wraps``, marked ``hooked``), which runs the global and the
    instance's step pre/post hooks around the update. Inside the wrapper is the class's own
    ``step`` (with its ``no_grad`` decorator), which is what a subset update must run: the hooks
    belong to the whole step and run once (``run_step_pre_hooks`` / ``run_step_post_hooks``).
    """
    step = type(optimizer).step
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def step_hooks(
    optimizer: torch.optim.Optimizer, *, skip: Iterable[int] = ()
) -> tuple[list[Callable], list[Callable]]:
    """The step pre- and post-hooks ``optimizer.step()`` would run, in its order.

    Pre: the global ones (``torch.optim.optimizer.register_optimizer_step_pre_hook``), then the
    instance's; post: the instance's, then the global ones (``profile_hook_step``'s order).
    ``skip``: handle ids of the instance's own hooks to leave out.
    """
    skipped = set(skip)

    def mine(hooks: Mapping[int, Callable]) -> list[Callable]:
        return [hook for key, hook in hooks.items() if key not in skipped]

    pre = list(
        chain(
            optimizer_module._global_optimizer_pre_hooks.values(),
            mine(optimizer._optimizer_step_pre_hooks),
        )
    )
    post = list(
        chain(
            mine(optimizer._optimizer_step_post_hooks),
            optimizer_module._global_optimizer_post_hooks.values(),
        )
    )
    return pre, post


def run_step_hooks(optimizer: torch.optim.Optimizer, hooks: Iterable[Callable]) -> None:
    """Call ``hook(optimizer, (), {})`` for each, as ``optimizer.step()`` calls them."""
    for hook in hooks:
        hook(optimizer, (), {})


def step_subset(
    optimizer: torch.optim.Optimizer,
    params: Iterable[torch.Tensor],
    *,
    hyper: list[dict] | None = None,
    groups: dict[int, int] | None = None,
    flags: Mapping[str, torch.Tensor | None] | None = None,
) -> None:
    """Run the optimizer class's ``step`` on ``params`` only (those with a gradient).

    Args:
        optimizer (torch.optim.Optimizer): the user's optimizer; its state is updated in place.
        params (Iterable[Tensor]): parameters of ``optimizer`` to update.
        hyper (list[dict] | None): per param group, the hyper-parameters to use
            (``hyper_parameters`` taken earlier); None means the groups' current values.
        groups (dict | None): ``group_of(optimizer)``, if already at hand.
        flags (Mapping | None): attributes to set on the view for this update, such as the
            ``grad_scale`` / ``found_inf`` that ``GradScaler.step`` hands a fused optimizer.

    No step hook runs (neither the optimizer's nor the global ones; see ``_unhooked_step``), and
    the class's ``step`` is called, so an LR scheduler's instance wrapper of ``optimizer.step``
    (which counts calls) is not involved either.
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
    for name, value in (flags or {}).items():
        setattr(view, name, value)
    _unhooked_step(optimizer)(view)


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Record that ``optimizer`` has stepped, for the LR scheduler attached to it.

    An ``LRScheduler`` wraps its optimizer's ``step`` to set ``optimizer._opt_called`` and warns
    when ``scheduler.step()`` runs before any optimizer step. ``step_subset`` calls the class's
    ``step`` on views, past that wrapper, so a scheduler that steps the updates of one
    ``step()`` calls this once for them (``torch.optim.lr_scheduler``, torch 2.13).
    """
    optimizer._opt_called = True
