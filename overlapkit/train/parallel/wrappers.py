"""Apply the ``parallel`` config group: call its factory on the model, adapt what comes back.

The group's ``_target_`` is the public API itself (``overlapkit.ddp``, ``overlapkit.GradBucketer``,
``overlapkit.fsdp``) with ``_partial_: true``, so the YAML says exactly which call is made; the
factory gets its group or mesh from the planner's layout (``overlapkit.train.parallel.mesh``): a
``process_group`` keyword gets the ``dp`` group, a ``mesh`` keyword the ``dp`` mesh (2-D for HSDP).
What the call returns differs (a DDP module, a bucketer beside the model, an FSDP2 module); the
loop needs the same three things from each: the module to run, how to skip gradient reduction
on the micro-batches before the last one, and what to do after the last backward.

Two layouts are prepared here before the factory runs:

- **tensor parallel** (``parallel.plan.tp > 1``): every block sequence-parallel over the ``tp``
  mesh axis (``tensor_parallel.apply_tensor_parallel``); ``ok.GradBucketer`` then averages the
  DTensor shards over ``dp``, and after its last all-reduce the blocks' replicated parameters get
  their gradients summed over ``tp``. (DDP does not take DTensor parameters, and FSDP2 over a TP
  mesh would need 2-D shards that ``ok.fsdp``'s gloo comms do not handle.)
- **expert parallel** (``parallel.plan.ep > 1``): the MoE experts are sharded over ``ep``; the
  factory is called twice, for the parameters outside the experts (replicated over
  ``dp x ep``) and for the experts (replicated over ``dp`` only).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from overlapkit.ddp import GradBucketer
from overlapkit.fsdp import no_sync as fsdp_no_sync
from overlapkit.fsdp import step_by_block, zero_stage
from overlapkit.inlayer.sequence_parallel import SequenceParallel
from overlapkit.train.models.moe import MoE, shard_experts
from overlapkit.train.parallel.mesh import Layout, PlanConfig
from overlapkit.train.parallel.tensor_parallel import apply_tensor_parallel

logger = logging.getLogger(__name__)

RUN_OPTIMIZER = "optim"
"""``parallel.optimizer: optim``: the factory gets the run's optimizer (bucketer_overlap)."""
BY_BLOCK = "by_block"
"""``parallel.optimizer_step: by_block`` (fsdp_overlap): ``step_by_block`` replaces the step."""


def _nothing() -> None:
    return None


@dataclass(frozen=True, slots=True)
class Parallelized:
    """The model as the loop drives it."""

    model: nn.Module
    """Run forward on this; its ``parameters()`` go to the optimizer."""
    no_sync: Callable[[], AbstractContextManager]
    """Backwards inside accumulate locally (every micro-batch of a step but the last)."""
    finish_backward: Callable[[], None]
    """Called after the last backward of a step, before clipping and the optimizer."""
    zero_grad_to_none: bool
    """Whether ``optimizer.zero_grad`` may free gradients (the bucketer keeps them as views)."""
    description: str
    optimizer: torch.optim.Optimizer | None = None
    """The optimizer that ``finish_backward`` steps itself (per-bucket updates, clipping folded
    in); the loop then neither clips nor calls ``optimizer.step()``. None: the loop does both."""
    grad_norm: Callable[[], float | None] = _nothing
    """With ``optimizer``: the step's gradient norm before clipping (None when not clipping)."""
    settle: Callable[[], None] = _nothing
    """Makes every parameter final (applies pending per-bucket updates)."""
    optimizer_step: Callable[[torch.optim.Optimizer, float | None], torch.Tensor | None] | None = (
        None
    )
    """Called instead of clipping and ``optimizer.step()``: ``optimizer_step(optimizer,
    max_norm)`` clips to ``max_norm`` (None: no clipping), steps, and returns the norm before
    clipping (None without clipping). ``step_by_block`` for ``fsdp_overlap``."""
    bucketers: tuple[GradBucketer, ...] = ()
    """The bucketers, whose bucket layouts checkpoints save and restore."""
    bucketer_keys: tuple[str, ...] = ()
    """The bucketers' checkpoint keys; empty: their index. Pipeline stages key theirs by stage:
    ranks of different stages hold different layouts, and DCP keeps one value per key."""
    forward_backward: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], torch.Tensor] | None = (
        None
    )
    """Runs forward and backward of all the step's ``(inputs, targets)`` micro-batches itself and
    returns the mean loss (a pipeline schedule); None: the loop runs them one by one."""


def check_run_optimizer(factory_cfg: Mapping[str, object], *, plan: PlanConfig) -> None:
    """Refuse what per-bucket updates (``parallel.optimizer: optim``) cannot do; names the keys.

    ``train.clip_grad_norm`` is folded into the per-bucket step (``bucketer.step(
    clip_grad_norm=...)``, exactly ``clip_grad_norm_``), so it is not refused.

    Raises:
        ValueError: the target is not ``overlapkit.GradBucketer``, or ``parallel.plan.tp`` /
            ``parallel.plan.ep`` is above 1.
    """
    if factory_cfg.get("optimizer") != RUN_OPTIMIZER:
        return
    target = factory_cfg.get("_target_")
    if target != "overlapkit.GradBucketer":
        raise ValueError(
            f"parallel.optimizer={RUN_OPTIMIZER} (per-bucket optimizer updates) needs "
            f"parallel._target_ overlapkit.GradBucketer, got {target!r}"
        )
    tp, ep = plan.sizes.tp, plan.sizes.ep
    if tp > 1 or ep > 1:
        raise ValueError(
            f"parallel.optimizer={RUN_OPTIMIZER} (per-bucket optimizer updates) works with plain "
            f"data parallelism only, got parallel.plan.tp={tp}, parallel.plan.ep={ep}"
        )


def apply_parallel(
    model: nn.Module,
    factory: Callable[..., object],
    layout: Layout | None = None,
    *,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    clip_grad_norm: float | None = None,
) -> Parallelized:
    """Prepare ``model`` for ``layout`` (tensor or expert parallel), call ``factory``, adapt it.

    Args:
        model (nn.Module): the local model, on its device (the full model on every rank).
        factory (Callable): the instantiated ``parallel`` group (a partial of ``ok.ddp``,
            ``ok.GradBucketer``, ``ok.fsdp`` or any function returning one of those or a module).
        layout (Layout): the planner's groups; None means plain data parallelism over the world.
        make_optimizer (Callable): builds the run's optimizer from parameters; used when the
            factory asks for it (``optimizer=optim``, ``parallel=bucketer_overlap``).
        clip_grad_norm (float | None): ``train.clip_grad_norm``, which per-bucket updates fold
            into their step; the loop clips itself otherwise.

    Returns:
        Parallelized: the module to run and its synchronisation controls.

    Raises:
        TypeError: the factory returned something that is neither a module nor a bucketer.
    """
    layout = layout if layout is not None else Layout(PlanConfig())
    tp = tensor_parallel(model, layout)
    if layout.plan.sizes.ep > 1:
        return _expert_parallel(model, factory, layout)
    factory, optimizer = _bind_run_optimizer(factory, model, make_optimizer)
    factory, by_block = _take_by_block(factory)
    result = factory(model, **group_kwargs(factory, layout))
    if tp is not None and not isinstance(result, GradBucketer):
        raise TypeError(
            f"parallel.plan.tp needs parallel._target_ overlapkit.GradBucketer; {factory!r} "
            f"returned {type(result).__name__}"
        )
    match result:
        case DistributedDataParallel():
            return Parallelized(result, result.no_sync, _nothing, True, "ok.ddp")
        case GradBucketer():
            return _bucketed(model, result, optimizer, clip_grad_norm, tp)
        case FSDPModule():
            return _sharded(result, layout, by_block)
        case nn.Module():
            # An unknown wrapper: it reduces gradients as it sees fit, on every backward.
            logger.warning(
                "parallel: %s is not ok.ddp, ok.GradBucketer or ok.fsdp; gradient accumulation "
                "will reduce on every micro-batch",
                type(result).__name__,
            )
            return Parallelized(
                result, contextlib.nullcontext, _nothing, True, type(result).__name__
            )
        case _:
            raise TypeError(
                f"parallel: the factory {factory!r} returned {type(result).__name__}; expected an "
                "nn.Module (ok.ddp, ok.fsdp) or an ok.GradBucketer"
            )


def _bind_run_optimizer(
    factory: Callable[..., object],
    model: nn.Module,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None,
) -> tuple[Callable[..., object], torch.optim.Optimizer | None]:
    """For ``parallel.optimizer: optim`` (per-bucket updates): the run's optimizer, built here
    and bound to the factory; otherwise the factory as given and None."""
    if not (
        isinstance(factory, functools.partial)
        and factory.keywords.get("optimizer") == RUN_OPTIMIZER
    ):
        return factory, None
    if make_optimizer is None:
        raise ValueError(f"parallel.optimizer={RUN_OPTIMIZER}: apply_parallel needs make_optimizer")
    optimizer = make_optimizer(model.parameters())
    return functools.partial(factory, optimizer=optimizer), optimizer


def _take_by_block(factory: Callable[..., object]) -> tuple[Callable[..., object], bool]:
    """The factory without ``optimizer_step: by_block`` (the loop's choice, not ``ok.fsdp``'s
    argument), and whether it was there."""
    by_block = isinstance(factory, functools.partial) and (
        factory.keywords.get("optimizer_step") == BY_BLOCK
    )
    if not by_block:
        return factory, False
    keywords = {k: v for k, v in factory.keywords.items() if k != "optimizer_step"}
    return functools.partial(factory.func, *factory.args, **keywords), True


def tensor_parallel(model: nn.Module, layout: Layout) -> SequenceParallel | None:
    """``model``'s blocks sequence-parallel over ``tp`` as ``parallel.plan`` says (None: tp 1)."""
    plan = layout.plan
    if plan.sizes.tp == 1:
        return None
    return apply_tensor_parallel(
        model, layout.tp_mesh, tp_comm=plan.tp_comm, tp_chunks=plan.tp_chunks
    )


def _bucketed(
    model: nn.Module,
    bucketer: GradBucketer,
    optimizer: torch.optim.Optimizer | None,
    clip_grad_norm: float | None,
    tp: SequenceParallel | None,
) -> Parallelized:
    """``ok.GradBucketer``'s controls; with ``optimizer``, per-bucket updates that clip; with
    ``tp``, the blocks' replicated gradients summed over tp after the bucketer's reduction."""
    what = f"ok.GradBucketer ({bucketer.num_buckets} buckets)"
    if tp is not None:
        what += f" over dp, {tp.description}"
    if optimizer is None:
        finish = bucketer.wait if tp is None else _then(bucketer.wait, tp.reduce_grads)
        return Parallelized(model, bucketer.no_sync, finish, False, what, bucketers=(bucketer,))
    return Parallelized(
        model,
        bucketer.no_sync,
        functools.partial(bucketer.step, clip_grad_norm=clip_grad_norm),
        True,
        what + ", per-bucket optimizer updates",
        optimizer=optimizer,
        grad_norm=_nothing if clip_grad_norm is None else lambda: bucketer.total_norm().item(),
        settle=bucketer.synchronize,
        bucketers=(bucketer,),
    )


def _sharded(model: FSDPModule, layout: Layout, by_block: bool) -> Parallelized:
    """``ok.fsdp``'s controls; ``by_block``: the optimizer steps block by block."""
    what = "ok.fsdp" + (" (HSDP)" if layout.plan.sizes.dp_shard is not None else "")
    zero = zero_stage(model)
    what += f" ZeRO-{zero}" if zero is not None else ""
    return Parallelized(
        model,
        lambda: fsdp_no_sync(model),
        _nothing,
        True,
        what + (", optimizer step by block" if by_block else ""),
        optimizer_step=functools.partial(_clipped_block_step, model) if by_block else None,
    )


def _clipped_block_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None
) -> torch.Tensor | None:
    return step_by_block(model, optimizer, clip_grad_norm=max_norm)


def group_kwargs(factory: Callable[..., object], layout: Layout) -> dict[str, object]:
    """The planner's data-parallel group or mesh, under the keyword the factory takes."""
    if layout.mesh is None:
        return {}
    try:
        accepted = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a callable without a signature: it takes no group
        return {}
    if "mesh" in accepted:
        return {"mesh": layout.dp_mesh}
    if "process_group" in accepted:
        return {"process_group": layout.dp_group}
    return {}


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        second()

    return both


def _owning_modules(root: nn.Module, exclude: nn.Module) -> nn.ModuleList:
    """The modules of ``root`` that own parameters directly, outside ``exclude``, as a list.

    A bucketer built on the list reduces exactly those parameters. The list keeps the model's
    registration order, so the bucketer's first layout (reverse registration order) is the
    order gradients become ready in, as for the whole model: a resumed run then reduces with the
    same layout as an uninterrupted one (the ring's summation order follows the layout).
    """
    excluded = {id(m) for m in exclude.modules()}
    return nn.ModuleList(
        m
        for m in root.modules()
        if id(m) not in excluded and next(m.parameters(recurse=False), None) is not None
    )


def _expert_parallel(
    model: nn.Module, factory: Callable[..., object], layout: Layout
) -> Parallelized:
    layers: list[MoE] = shard_experts(model, layout.ep_mesh, chunks=layout.plan.ep_chunks)
    experts = nn.ModuleList(layer.experts for layer in layers)
    dense = factory(_owning_modules(model, experts), process_group=layout.dense_group)
    sharded = factory(experts, process_group=layout.dp_group)
    if not (isinstance(dense, GradBucketer) and isinstance(sharded, GradBucketer)):
        raise TypeError(
            f"parallel.plan.ep needs parallel._target_ overlapkit.GradBucketer, whose call "
            f"returns a bucketer; {factory!r} returned {type(dense).__name__}"
        )
    ep = layout.plan.sizes.ep
    expert_params = list(experts.parameters())

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        with dense.no_sync(), sharded.no_sync():
            yield

    def finish_backward() -> None:
        dense.wait()
        sharded.wait()
        # An expert's gradient sums the losses of its ep group's ranks; averaged over dp it is
        # still ep times the mean over the dp x ep replicas that the dense parameters get.
        for param in expert_params:
            param.grad.div_(ep)

    return Parallelized(
        model,
        no_sync,
        finish_backward,
        False,
        f"ok.GradBucketer over dp x ep ({dense.num_buckets} buckets) + experts over dp "
        f"({sharded.num_buckets} buckets), ep={ep}",
        bucketers=(dense, sharded),
    )


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> float:
    """Clip the gradients' global 2-norm to ``max_norm``; returns the norm before clipping.

    Works when plain tensors and DTensors of several meshes or placements mix (tensor or
    expert parallelism), which ``torch.nn.utils.clip_grad_norm_`` refuses: the norm of each
    kind is taken on its own (a DTensor norm reduced over its mesh) and combined.
    """
    params = [p for p in parameters if p.grad is not None]
    if len(_by_kind([p.grad for p in params])) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
    total = grad_norm([p.grad for p in params]).item()
    scale_grads(params, max_norm, total)
    return total


def _by_kind(grads: Iterable[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    kinds: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        kinds.setdefault(key, []).append(grad)
    return kinds


def grad_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads`` (plain tensors and DTensors of several meshes mixed), 0-dim plain.

    Each kind's norm is taken on its own (a DTensor's reduced over its mesh) and the kinds'
    norms are combined.
    """
    norms = []
    for members in _by_kind(grads).values():
        norm = torch.nn.utils.get_total_norm(members)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(norms))


def scale_grads(params: Iterable[nn.Parameter], max_norm: float, total_norm: float) -> None:
    """Scale the gradients by ``max_norm / (total_norm + 1e-6)`` when that is below 1 (torch's
    rule in ``clip_grad_norm_``)."""
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
