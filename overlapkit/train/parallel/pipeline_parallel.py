"""Pipeline parallelism for the training loop: stages, torch's schedule, the tied weight, clipping.

``apply_pipeline`` splits the GPT into this rank's stages (``pipeline_stages``), wraps each with the
``parallel`` group's factory over the ``dp`` group or mesh, and builds the
``torch.distributed.pipelining`` schedule over the ``pp`` group. Per step the schedule runs the
``train.grad_accum`` micro-batches; each micro-batch loss is divided by their count, as the loop
divides it without a pipeline (``scale_grads=False``), so the gradients are the same sums.

Data parallelism inside a stage (every stage is a ``split_backward.SplitBackwardStage``):

- ``ok.ddp``: torch's ``PipelineStage`` starts DDP's reduction itself on the stage's last
  backward; the whole schedule runs inside ``no_sync`` (``Pipeline.forward_backward`` says why).
- ``ok.GradBucketer``: ``PipelineStage`` knows only DDP and FSDP, so the stage runs every
  backward but its last inside ``bucketer.no_sync()``; ``finish_backward`` waits.
- ``ok.fsdp``: the schedule runs FSDP2's post-backward itself, after the last micro-batch and
  outside autograd (``PipelineStage.perform_reduce_grad``), where ``ok.fsdp``'s asynchronous
  reduce-scatter could not queue its autograd callback; the stage is wrapped with
  ``overlap_reduce_scatter=False`` (FSDP2's own reduce-scatter; no backward is left to overlap).

Under the zero-bubble schedules (a split backward) the stage's last backward is a weight step:
``SplitBackwardStage`` runs it through autograd's accumulators, so ``ok.ddp``'s and
``ok.GradBucketer``'s buckets launch inside it as they complete; ``ok.fsdp`` still reduces at the
schedule's ``REDUCE_GRAD``, right after it.

**The tied embedding and head** (gpt_tiny's ``lm_head.weight is wte.weight``) live on the first
and the last stage (pipeline ranks 0 and ``p - 1``; both on rank 0 under a V schedule). As
Megatron-LM does, the last stage gets its own copy (equal at start), and after backward the two
gradients are summed: by one all-reduce between the first and last stage's ranks (its
"embedding group"), or on rank 0 itself under a V schedule. Both copies then see the same
gradient and take the same optimizer update, so they stay equal.

**Clipping**: the global norm over every stage (and every dp/tp shard): each rank's norm over its
stages (the head's copy not counted twice), squared, summed over the ``pp`` group (as torchtitan's
``clip_grad_norm_`` reduces it over the pp mesh), then every gradient scaled alike.

**The loss** exists on the last stage only; it is broadcast over the ``pp`` group from the last
stage's rank (``pipeline_stages.last_stage_rank``), so rank 0 shows it and the summary records it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from overlapkit.ddp import GradBucketer
from overlapkit.fsdp import zero_stage
from overlapkit.group.dim_labels import comm_dim
from overlapkit.group.process_group import inherit_timeout
from overlapkit.inlayer.sequence_parallel import SequenceParallel
from overlapkit.layout.overlapkit_train import schedule_named
from overlapkit.train.models.gpt import GPT
from overlapkit.train.parallel.mesh import Layout, PlanConfig
from overlapkit.train.parallel.pipeline_stages import (
    last_stage_rank,
    local_stages,
    resolve_schedule,
    schedule_class,
    split_stage,
    stage_layers,
)
from overlapkit.train.parallel.split_backward import SplitBackwardStage
from overlapkit.train.parallel.wrappers import (
    Parallelized,
    grad_norm,
    group_kwargs,
    scale_grads,
    tensor_parallel,
)

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class TiedGradients:
    """This rank's copies of the tied embedding and head weight, and who holds the others.

    Attributes:
        params: ``wte.weight`` on the first stage's rank, ``lm_head.weight`` on the last's;
            both on pipeline rank 0 under a V schedule.
        group: the first and the last stage's ranks of this pipeline; None when this rank
            holds both copies (a V schedule: summed locally).
    """

    params: tuple[nn.Parameter, ...]
    group: dist.ProcessGroup | None

    def sum(self) -> None:
        """Make every copy's gradient the sum of both copies' (after the data-parallel
        reduction)."""
        grads = [_local(p.grad) for p in self.params]
        if self.group is not None:
            dist.all_reduce(grads[0], group=self.group)
            return
        total = torch.stack(grads).sum(dim=0)
        for grad in grads:
            grad.copy_(total)


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _embedding_group(layout: Layout) -> dist.ProcessGroup | None:
    """The first and last ``pp`` rank of this rank's pipeline; None for the ranks between, and
    under a V schedule (rank 0 holds both stages).

    A collective: every rank creates every pipeline's pair, in the same order.
    """
    if schedule_named(layout.plan.schedule).v_shape:
        return None
    if layout.plan.sizes.pp == 2:
        return layout.pp_mesh.get_group()
    mine = None
    for ranks in layout.placement.groups("pp"):
        pair = [ranks[0], ranks[-1]]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = inherit_timeout(group)
    return mine


def clip_pipeline_grad_norm(
    params: list[nn.Parameter],
    max_norm: float,
    *,
    group: dist.ProcessGroup,
    uncounted: tuple[nn.Parameter, ...] = (),
) -> torch.Tensor:
    """Clip the gradients of every stage to the global 2-norm ``max_norm``; returns that norm.

    Args:
        params: this rank's parameters (all its stages).
        max_norm (float): ``train.clip_grad_norm``.
        group: the ``pp`` group: the norm squared is summed over it.
        uncounted: parameters whose gradient another stage already counts (the head's copy
            of the tied embedding); they are clipped but not counted.
    """
    skip = {id(p) for p in uncounted}
    with_grad = [p for p in params if p.grad is not None]
    local = grad_norm(p.grad for p in with_grad if id(p) not in skip)
    squared = local.to(with_grad[0].grad.device).square()
    dist.all_reduce(squared, group=group)
    total = squared.sqrt()
    scale_grads(with_grad, max_norm, total.item())
    return total


@dataclass(slots=True)
class Pipeline:
    """This rank's stages, the schedule over them and what the step does around it."""

    schedule: object
    stages: list[PipelineStage]
    group: dist.ProcessGroup
    last_stage_rank: int
    """The ``pp`` coordinate of the rank holding the last stage (the loss)."""
    bucketers: tuple[GradBucketer, ...]
    ddps: tuple[DistributedDataParallel, ...]
    tied: TiedGradients | None
    params: list[nn.Parameter]
    """This rank's parameters, of all its stages."""
    uncounted: tuple[nn.Parameter, ...]
    """The head's copy of the tied embedding (the first stage counts the weight in the norm)."""
    tp: SequenceParallel | None = None
    """The blocks' sequence parallelism, whose replicated gradients are summed over tp."""

    @property
    def has_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Run the schedule over the step's micro-batches; the mean loss, on every ``pp`` rank."""
        inputs = torch.cat([b[0] for b in batches]) if self.has_first else None
        losses: list[torch.Tensor] = []
        kwargs = {}
        if self.has_last:
            kwargs = dict(target=torch.cat([b[1] for b in batches]), losses=losses)
        args = (inputs,) if inputs is not None else ()
        with contextlib.ExitStack() as stack:
            # PipelineStage starts DDP's reduction itself on a stage's last backward
            # (prepare_for_backward). Outside no_sync, the forward of the schedule's metadata
            # inference (first step) would leave DDP expecting a backward that never comes, and
            # the first micro-batch's backward would then reduce (and, interleaved, record the
            # bucket order twice: "rebuilt parameter indices size is not same").
            for ddp in self.ddps:
                stack.enter_context(ddp.no_sync())
            # The schedule's sends and receives are pp's in the report's dims; the collectives
            # the stages' wrappers and tp issue inside carry their own, innermost, labels.
            stack.enter_context(comm_dim("pp"))
            self.schedule.step(*args, return_outputs=False, **kwargs)
        device = batches[0][0].device
        loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=device)
        with comm_dim("pp"):
            dist.broadcast(loss, group=self.group, group_src=self.last_stage_rank)
        return loss

    def finish_backward(self) -> None:
        for bucketer in self.bucketers:
            bucketer.wait()
        if self.tied is not None:
            self.tied.sum()
        if self.tp is not None:
            self.tp.reduce_grads()

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, max_norm: float | None
    ) -> torch.Tensor | None:
        """Clip over every stage (``max_norm`` None: no clipping), step; the norm or None."""
        norm = None
        if max_norm is not None:
            norm = clip_pipeline_grad_norm(
                self.params, max_norm, group=self.group, uncounted=self.uncounted
            )
        optimizer.step()
        return norm


def _stage_kwargs(factory: Callable[..., object], layout: Layout, stage: GPT) -> dict:
    """The factory's group or mesh, and for ``ok.fsdp`` the stage's blocks, blocking reduce."""
    kwargs = group_kwargs(factory, layout)
    accepted = inspect.signature(factory).parameters
    if "blocks" in accepted and "overlap_reduce_scatter" in accepted:
        present = [b for b in stage.blocks if not isinstance(b, nn.Identity)]
        kwargs |= dict(blocks=present, overlap_reduce_scatter=False)
    return kwargs


def apply_pipeline(
    model: GPT,
    factory: Callable[..., object],
    layout: Layout,
    *,
    loss_fn: LossFn,
    micro_batches: int,
    device: torch.device,
) -> Parallelized:
    """Split ``model`` into this rank's stages, wrap them with ``factory``, build the schedule.

    Args:
        model (GPT): the full model, on its device (the same weights on every rank); its
            modules are shared with the stages, its tied head untied.
        factory (Callable): the instantiated ``parallel`` group (``ok.ddp``, ``ok.GradBucketer``
            or ``ok.fsdp``), called once per local stage with the ``dp`` group or mesh.
        layout (Layout): the planner's groups, with ``pp > 1`` (``check_pipeline`` passed).
        loss_fn (Callable): ``(logits, targets) -> mean loss`` of one micro-batch.
        micro_batches (int): ``train.grad_accum``.
        device (torch.device): this rank's device.

    Returns:
        Parallelized: ``model`` is this rank's stages as one GPT (unsplit names; what the
        optimizer and the checkpoint see); ``forward_backward`` runs the schedule and
        ``optimizer_step`` clips over every stage.
    """
    plan = layout.plan
    schedule_name = resolve_schedule(plan.schedule)
    pp_rank = layout.pp_mesh.get_local_rank()
    num_stages = plan.sizes.pp * plan.sizes.virtual_stages
    n_layer = len(model.blocks)
    tp = tensor_parallel(model, layout)
    tied = _untie_head(model)
    schedule = schedule_named(schedule_name)
    mine = local_stages(pp_rank, plan.sizes.pp, plan.sizes.virtual_stages, v_shape=schedule.v_shape)
    last = num_stages - 1
    layers = {s: stage_layers(n_layer, num_stages, s) for s in mine}
    local = split_stage(
        model, {i for r in layers.values() for i in r}, first=0 in mine, last=last in mine
    )
    stages, bucketers, what = [], [], None
    for index in mine:
        view = split_stage(model, layers[index], first=index == 0, last=index == last)
        wrapped = factory(view, **_stage_kwargs(factory, layout, view))
        common = dict(stage_index=index, num_stages=num_stages, device=device)
        stage, what = _stage_of(view, wrapped, factory, group=layout.pp_mesh.get_group(), **common)
        stages.append(stage)
        if isinstance(wrapped, GradBucketer):
            bucketers.append(wrapped)
    runner = _schedule(schedule_name, stages, loss_fn, micro_batches)
    tie, uncounted = _tied_gradients(layout, local) if tied else (None, ())
    pipeline = Pipeline(
        schedule=runner,
        stages=stages,
        group=layout.pp_mesh.get_group(),
        last_stage_rank=last_stage_rank(plan),
        bucketers=tuple(bucketers),
        ddps=tuple(s.submod for s in stages if isinstance(s.submod, DistributedDataParallel)),
        tied=tie,
        params=list(local.parameters()),
        uncounted=uncounted,
        tp=tp,
    )
    logger.info(
        "pipeline rank %d holds stage(s) %s of %d: blocks %s",
        pp_rank,
        ", ".join(map(str, mine)),
        num_stages,
        ", ".join(f"{layers[s].start}..{layers[s].stop - 1}" for s in mine),
    )
    return Parallelized(
        local,
        contextlib.nullcontext,
        pipeline.finish_backward,
        not bucketers,
        _describe(schedule_name, plan, n_layer, micro_batches, what, tp),
        optimizer_step=pipeline.optimizer_step,
        bucketers=tuple(bucketers),
        bucketer_keys=tuple(f"stage{s}" for s in mine) if bucketers else (),
        forward_backward=pipeline.forward_backward,
    )


def _untie_head(model: GPT) -> bool:
    """Give the head its own copy of a tied embedding weight (equal at start, as Megatron-LM
    does: the last stage holds it); whether it was tied."""
    tied = model.lm_head.weight is model.wte.weight
    if tied:
        model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    return tied


def _stage_of(
    view: GPT, wrapped: object, factory: Callable[..., object], **stage_kwargs: object
) -> tuple[PipelineStage, str]:
    """The ``PipelineStage`` for one stage ``view`` that ``factory`` wrapped, and the wrapper's
    name for the description.

    Raises:
        TypeError: the factory returned something other than ``ok.ddp``, ``ok.GradBucketer``
            or ``ok.fsdp``'s result, naming ``parallel.plan.pp``.
    """
    match wrapped:
        case GradBucketer():
            return SplitBackwardStage(view, bucketer=wrapped, **stage_kwargs), "ok.GradBucketer"
        case DistributedDataParallel():
            return SplitBackwardStage(wrapped, **stage_kwargs), "ok.ddp"
        case FSDPModule():
            zero = zero_stage(wrapped)
            what = "ok.fsdp" if zero is None else f"ok.fsdp ZeRO-{zero}"
            return SplitBackwardStage(wrapped, **stage_kwargs), what
        case _:
            raise TypeError(
                f"parallel.plan.pp: the factory {factory!r} returned "
                f"{type(wrapped).__name__}; expected ok.ddp, ok.GradBucketer or ok.fsdp's"
            )


def _schedule(
    schedule_name: str, stages: list[PipelineStage], loss_fn: LossFn, micro_batches: int
) -> object:
    """torch's schedule ``schedule_name`` over this rank's stages, each micro-batch loss divided
    by their count (``scale_grads=False``: the gradients are the same sums as without pp)."""
    cls = schedule_class(schedule_name)
    return cls(
        stages[0] if issubclass(cls, PipelineScheduleSingle) else stages,
        n_microbatches=micro_batches,
        loss_fn=functools.partial(_per_micro_batch, loss_fn, micro_batches),
        scale_grads=False,
    )


def _tied_gradients(
    layout: Layout, local: GPT
) -> tuple[TiedGradients | None, tuple[nn.Parameter, ...]]:
    """For a tied embedding and head: this rank's copies and the group summing both copies'
    gradients (None between the first and last stage), and the head's copy, which the
    clipping norm leaves uncounted. A collective (``_embedding_group``)."""
    group = _embedding_group(layout)
    copies = tuple(m.weight for m in (local.wte, local.lm_head) if m is not None)
    tie = TiedGradients(copies, group) if copies else None
    uncounted = (local.lm_head.weight,) if local.lm_head is not None else ()
    return tie, uncounted


def _describe(
    schedule_name: str,
    plan: PlanConfig,
    n_layer: int,
    micro_batches: int,
    what: str,
    tp: SequenceParallel | None,
) -> str:
    num_stages = plan.sizes.pp * plan.sizes.virtual_stages
    blocks = n_layer // num_stages
    return (
        f"pipeline {schedule_name} pp={plan.sizes.pp}"
        + (f" v={plan.sizes.virtual_stages}" if plan.sizes.virtual_stages > 1 else "")
        + f" ({num_stages} stages of {blocks} block"
        + "s" * (blocks != 1)
        + f", {micro_batches} micro-batches), {what} over dp"
        + (f", {tp.description}" if tp is not None else "")
    )


def _per_micro_batch(
    loss_fn: LossFn, micro_batches: int, logits: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    return loss_fn(logits, targets) / micro_batches
