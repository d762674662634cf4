"""One step of overlapkit-train: the model set up for its layout, and the optimizer step.

``wrap_model`` applies, in the loop's order, every dimension of a run's layout to the model
(context parallelism, recomputation, the pipeline or the ``parallel`` group's wrapper);
``train_step`` runs one optimizer step of ``train.grad_accum`` micro-batches on it. The loop
(``overlapkit.train.run.loop.train``) calls both; so does ``bench.planner_ranking``, which times the
step of every layout exactly as a run takes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn

from overlapkit.train.parallel.context_parallel import (
    WHOLE_SEQUENCES,
    SequenceSplit,
    WholeSequences,
    split_sequences,
)
from overlapkit.train.parallel.mesh import Layout, PlanConfig
from overlapkit.train.parallel.pipeline_parallel import apply_pipeline
from overlapkit.train.parallel.pipeline_stages import check_pipeline, stage_blocks
from overlapkit.train.parallel.recompute import apply_recompute
from overlapkit.train.parallel.run_layout import check_layout
from overlapkit.train.parallel.wrappers import (
    Parallelized,
    apply_parallel,
    check_run_optimizer,
    clip_grad_norm,
)
from overlapkit.train.run.data import BatchStream, DataSource


class Phases(Protocol):
    """Times the step's phases (``ok.LiveMonitor`` offers it): ``data``, ``forward``,
    ``backward``, ``sync`` (the wrapper's end of backward), ``optimizer``."""

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]: ...


class _Untimed:
    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


UNTIMED: Phases = _Untimed()
"""Phases that time nothing (a step without a live monitor)."""


class StepConfig(Protocol):
    """What a step reads of the ``train`` group (``loop.TrainConfig`` offers it)."""

    grad_accum: int
    """Micro-batches per optimizer step."""
    clip_grad_norm: float | None
    """Clip the global gradient norm to this; None: no clipping."""
    recompute: str
    """``none``, ``selective`` or ``full`` (``overlapkit.train.parallel.recompute``)."""
    recompute_layers: int | None
    """With ``full``: blocks of each stage recomputed; None: all."""


def _grad_norm(par: Parallelized, max_norm: float | None) -> float | None:
    if max_norm is None:
        return None
    return clip_grad_norm(par.model.parameters(), max_norm)


def wrap_model(
    model: nn.Module,
    plan: PlanConfig,
    factory_cfg: Mapping[str, Any],
    layout: Layout,
    cfg: StepConfig,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    device: torch.device,
) -> tuple[Parallelized, WholeSequences | SequenceSplit, list[int]]:
    """``model`` set up, in place, as overlapkit-train runs ``layout``; a collective.

    In this order: the sequences split over ``cp`` (``split_sequences``), each pipeline stage's
    blocks recomputed as ``cfg.recompute`` says (``apply_recompute``), the combination checked,
    then the stages and their schedule (``apply_pipeline``, with ``pp > 1``) or the ``parallel``
    group's wrapper (``apply_parallel``).

    Args:
        model (nn.Module): the full model on ``device``, the same weights on every rank.
        plan (PlanConfig): ``parallel.plan``; ``layout`` was built from it.
        factory_cfg (Mapping): the ``parallel`` group without ``plan`` (instantiated here).
        layout (Layout): the run's groups (``build_layout``).
        cfg (StepConfig): the ``train`` group (``grad_accum``, ``recompute``, clipping).
        loss_fn (Callable): the data source's ``(output, targets) -> mean loss``.
        make_optimizer (Callable): the ``optim.optimizer`` partial.
        device (torch.device): this rank's device.

    Returns:
        tuple: the model as the step drives it, how each micro-batch's sequences are split,
        and the indices of the recomputed blocks.

    Raises:
        ValueError: a combination the loop refuses (``check_run_optimizer``,
            ``check_pipeline``, ``check_layout``), named by its config keys.
    """
    split = split_sequences(model, layout.cp_mesh, device)
    recomputed = [  # each pipeline stage's first train.recompute_layers blocks
        index
        for blocks in stage_blocks(getattr(model, "blocks", ()), plan)
        for index in apply_recompute(blocks, cfg.recompute, cfg.recompute_layers)
    ]
    check_run_optimizer(factory_cfg, plan=plan)
    check_pipeline(plan, model_config=model.config, factory_cfg=factory_cfg)
    world_size = dist.get_world_size()
    check_layout(plan, factory_cfg, cfg, world_size=world_size, model_config=model.config)
    if plan.sizes.pp > 1:
        par = apply_pipeline(
            model,
            instantiate(factory_cfg),
            layout,
            loss_fn=loss_fn,
            micro_batches=cfg.grad_accum,
            device=device,
        )
    else:
        par = apply_parallel(
            model,
            instantiate(factory_cfg),
            layout,
            make_optimizer=make_optimizer,
            clip_grad_norm=cfg.clip_grad_norm,
        )
    return par, split, recomputed


def train_step(
    par: Parallelized,
    optimizer: torch.optim.Optimizer,
    stream: BatchStream,
    source: DataSource,
    cfg: StepConfig,
    device: torch.device,
    split: WholeSequences | SequenceSplit = WHOLE_SEQUENCES,
    phases: Phases = UNTIMED,
) -> tuple[float, float | None]:
    """One optimizer step of overlapkit-train; returns (mean micro-batch loss, gradient norm
    before clipping).

    ``split`` gives each micro-batch's model inputs and targets (this rank's chunks under
    context parallelism) and averages the loss over the ranks that split the sequences;
    ``phases`` times the step's phases (a pipeline schedule's micro-batches are one
    ``forward`` phase, forward and backward together)."""
    with phases.phase("optimizer"):
        optimizer.zero_grad(set_to_none=par.zero_grad_to_none)
    if par.forward_backward is not None:  # a pipeline schedule runs the micro-batches
        with phases.phase("data"):
            batches = [tuple(t.to(device) for t in stream.next()) for _ in range(cfg.grad_accum)]
        with phases.phase("forward"):
            loss_sum = par.forward_backward(batches)
    else:
        loss_sum = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            with phases.phase("data"):
                inputs, targets = (t.to(device, non_blocking=True) for t in stream.next())
            last = micro == cfg.grad_accum - 1
            with (
                contextlib.nullcontext() if last else par.no_sync(),
                split.shard(inputs, targets) as (model_inputs, targets),
            ):
                with phases.phase("forward"):
                    loss = source.loss(par.model(*model_inputs), targets) / cfg.grad_accum
                with phases.phase("backward"):
                    loss.backward()
            loss_sum += loss.detach()
        with phases.phase("sync"):  # under cp, an all-reduce
            loss_sum = split.average_loss(loss_sum)
    with phases.phase("sync"):
        par.finish_backward()
    with phases.phase("optimizer"):
        return _optimizer_step(par, optimizer, cfg, loss_sum)


def _optimizer_step(
    par: Parallelized, optimizer: torch.optim.Optimizer, cfg: StepConfig, loss_sum: torch.Tensor
) -> tuple[float, float | None]:
    if par.optimizer is not None:  # the wrapper clips and applies the optimizer per bucket
        # Reading the norm waits for every bucket's all-reduce (not for the updates).
        return loss_sum.item(), par.grad_norm()
    if par.optimizer_step is not None:  # clips and steps (fsdp_overlap: step_by_block)
        norm = par.optimizer_step(optimizer, cfg.clip_grad_norm)
        return loss_sum.item(), None if norm is None else norm.item()
    grad_norm = _grad_norm(par, cfg.clip_grad_norm)
    optimizer.step()
    return loss_sum.item(), grad_norm
