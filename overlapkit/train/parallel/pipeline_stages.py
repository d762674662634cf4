"""Pipeline stages of a GPT: the schedule by name, which stages each rank holds, the split, checks.

``parallel.plan.pp = p`` and ``parallel.plan.virtual_stages = v`` make ``p x v`` stages of
``n_layer / (p x v)`` consecutive blocks each; the first stage also embeds, the last also applies
``ln_f`` and the head. Pipeline rank ``r`` holds stages ``r, r + p, ...`` (torch's "loop" style),
so the first stage is on pipeline rank 0 and the last on rank ``p - 1``. The micro-batches of a
step are the ``train.grad_accum`` micro-batches of ``train.batch_size`` sequences, as the planner
counts them.

A stage is a ``GPT`` that shares the full model's modules and lacks the others' (``split_stage``),
so its parameter names are the unsplit model's (``blocks.2.attn.q.weight`` on whichever stage runs
block 2): a DCP checkpoint names every tensor as an unsplit run does.

The V schedules (``ZBVZeroBubble``, ``DualPipeV``) place two stages per rank in a V instead:
rank ``r`` holds stages ``r`` and ``2 p - 1 - r``, so the first and the last stage are both on
pipeline rank 0 (``local_stages``, ``last_stage_rank``).

The schedules are torch's (``torch.distributed.pipelining``); which of them run, and what each
needs of the layout, is ``overlapkit.layout.overlapkit_train``'s table (``SCHEDULES``, ``REFUSED``:
``run_layout.check_layout`` raises its refusals), read by the auto-planner's search too.
``check_pipeline`` checks here what the table does not describe (the model, the wrapper's
options), with the config keys in the message.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.pipelining.schedules import get_schedule_class

from overlapkit.autoplan import pipeline_schedule
from overlapkit.layout import TrainingLayout
from overlapkit.layout.overlapkit_train import (
    schedule_named,
    wrapper_refusal,
)
from overlapkit.train.models.gpt import GPT, GPTConfig

_GPT_PARTS = ("wte", "wpe", "blocks", "ln_f", "lm_head")


def resolve_schedule(name: str) -> str:
    """The schedule's spelling in the table's ``SCHEDULES`` (case-insensitive, as torch's lookup).

    Raises:
        ValueError: not one of ``SCHEDULES``; names the config key and the valid names.
    """
    return schedule_named(name).name


def schedule_class(name: str) -> type:
    """torch's schedule class for ``name`` (``Schedule1F1B`` for ``1F1B``)."""
    return get_schedule_class(resolve_schedule(name))


def local_stages(
    pp_rank: int, pp: int, virtual_stages: int, *, v_shape: bool = False
) -> tuple[int, ...]:
    """The stage indices pipeline rank ``pp_rank`` (its ``pp`` coordinate) holds, increasing.

    Loop: ``r, r + pp, ...``; ``v_shape`` (two stages per rank): ``r`` and ``2 pp - 1 - r``,
    torch's ``generate_stage_to_rank_mapping(style="v")``.
    """
    if v_shape:
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + i * pp for i in range(virtual_stages))


def last_stage_rank(plan: Any) -> int:
    """The ``pp`` coordinate of the rank holding the last stage (the loss): ``pp - 1``, or 0 for
    a V schedule (the V turns back to rank 0)."""
    return 0 if schedule_named(plan.schedule).v_shape else plan.sizes.pp - 1


def stage_layers(n_layer: int, num_stages: int, stage: int) -> range:
    """The block indices of ``stage``: ``n_layer / num_stages`` consecutive ones."""
    per_stage = n_layer // num_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def stage_blocks(blocks: Sequence[nn.Module], plan: Any) -> list[Sequence[nn.Module]]:
    """``blocks`` cut into every stage's consecutive run (one run, all of them, without ``pp``).

    Args:
        blocks: the model's blocks in forward order.
        plan: the ``parallel.plan`` section (``PlanConfig``), checked by ``check_pipeline``.
    """
    stages = plan.sizes.pp * plan.sizes.virtual_stages
    runs = (stage_layers(len(blocks), stages, stage) for stage in range(stages))
    return [blocks[run.start : run.stop] for run in runs]


def bubble_share(pp: int, virtual_stages: int, micro_batches: int) -> float:
    """The share of a step a stage idles in the schedule's fill and drain: ``(p-1) / (v m + p-1)``.

    The planner's step is ``(m + (p - 1) / v) x t_micro_batch`` (1F1B and interleaved 1F1B,
    Narayanan et al. 2021, arXiv 2104.04473, section 2.2), of which ``(p - 1) / v`` micro-batch
    times are the bubble.
    """
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)


BALANCED = "F = I = W"
"""What a split backward's planned share assumes: a micro-batch's forward, input- and
weight-gradient steps take equal times (the zero-bubble paper's balanced case)."""


def split_bubble_share(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> float:
    """The share of a step a rank idles under a split-backward ``schedule`` at ``BALANCED``
    times: torch's shape as the auto-planner prices it (``autoplan.pipeline_schedule``; the
    planner itself uses the layout's own F, I and W). NaN where it does not price the shape
    (fewer micro-batches than the schedule fills)."""
    layout = TrainingLayout(
        pp=pp, virtual_stages=virtual_stages, num_micro_batches=micro_batches, schedule=schedule
    )
    if not pipeline_schedule.priced(schedule, layout):
        return math.nan
    bubble = pipeline_schedule.bubble_s(layout, pipeline_schedule.PassTimes(1.0, 1.0, 1.0))
    return bubble / (bubble + 3.0 * micro_batches)


def pipeline_record(plan: Any, micro_batches: int) -> dict | None:
    """The schedule and the planner's bubble share of a step (``summary.json``'s ``pipeline``):
    ``(p-1) / (v m + p-1)``, or under a split backward ``split_bubble_share`` (null where not
    priced), with ``planned_bubble_basis`` saying which; None without pipeline parallelism."""
    pp, virtual_stages = plan.sizes.pp, plan.sizes.virtual_stages
    if pp == 1:
        return None
    schedule = schedule_named(plan.schedule)
    if schedule.split_backward:
        share = split_bubble_share(schedule.name, pp, virtual_stages, micro_batches)
        basis = f"torch's {schedule.name} at {BALANCED}"
    else:
        share, basis = bubble_share(pp, virtual_stages, micro_batches), "(p-1)/(v m + p-1)"
    return {
        "schedule": schedule.name,
        "pp": pp,
        "virtual_stages": virtual_stages,
        "micro_batches": micro_batches,
        "planned_bubble_share": None if math.isnan(share) else share,
        "planned_bubble_basis": basis,
    }


def split_stage(model: GPT, layers: Collection[int], *, first: bool, last: bool) -> GPT:
    """A ``GPT`` that shares ``model``'s modules for ``layers`` (and the ends it holds), no others.

    The absent blocks are ``nn.Identity`` (their indices, and so every parameter's name, stay the
    unsplit model's); without ``first`` there are no embeddings (``wte``, ``wpe`` are None), without
    ``last`` no ``ln_f`` and head. Parts are registered in ``model``'s order.

    Raises:
        ValueError: ``model`` has other top-level parts than a GPT's.
    """
    parts = tuple(name for name, _ in model.named_children())
    if parts != _GPT_PARTS:
        raise ValueError(
            f"parallel.plan.pp splits a GPT ({', '.join(_GPT_PARTS)}); "
            f"{type(model).__name__} has {', '.join(parts)}"
        )
    stage = type(model).__new__(type(model))
    nn.Module.__init__(stage)
    stage.config = model.config
    stage.wte = model.wte if first else None
    stage.wpe = model.wpe if first else None
    stage.blocks = nn.ModuleList(
        block if i in layers else nn.Identity() for i, block in enumerate(model.blocks)
    )
    stage.ln_f = model.ln_f if last else None
    stage.lm_head = model.lm_head if last else None
    return stage


def check_pipeline(plan: Any, *, model_config: Any, factory_cfg: Mapping[str, Any]) -> None:
    """Refuse a pipeline that cannot run, before any worker starts; names the config keys.

    What the capability table judges of the layout (``pp`` with ``ep`` or ``cp``, ZeRO-2, the
    stage split, the micro-batches a schedule needs) is ``run_layout.check_layout``'s; these are
    the schedule's name and stages per rank, the model and the wrapper.

    Args:
        plan: the ``parallel.plan`` section (``PlanConfig``).
        model_config: the model's config (a ``GPTConfig`` for a pipeline).
        factory_cfg (Mapping): the ``parallel`` group without ``plan``.

    Raises:
        ValueError: a schedule torch does not have; ``virtual_stages`` without ``pp`` or of the
            wrong count for the schedule (a V schedule: 2); a model that is not a GPT; a
            wrapper other than ``ok.ddp``, ``ok.GradBucketer``, ``ok.fsdp``; DDP's
            ``find_unused_parameters`` under a split backward; per-bucket or per-block
            optimizer updates.
    """
    schedule = schedule_named(plan.schedule)
    pp, virtual_stages = plan.sizes.pp, plan.sizes.virtual_stages
    if pp == 1:
        if virtual_stages != 1:
            raise ValueError(
                f"parallel.plan.virtual_stages={virtual_stages} needs pipeline parallelism "
                "(parallel.plan.pp > 1)"
            )
        return
    target = factory_cfg.get("_target_")
    refusal = schedule.stages_refusal(virtual_stages) or wrapper_refusal("pp", pp, target)
    if refusal is not None:
        raise ValueError(refusal)
    if not isinstance(model_config, GPTConfig):
        raise ValueError(
            f"parallel.plan.pp={pp} splits a GPT into stages (model=gpt_tiny); "
            f"{type(model_config).__name__} is not one"
        )
    if schedule.split_backward and factory_cfg.get("find_unused_parameters"):
        raise ValueError(
            f"parallel.find_unused_parameters=true with parallel.plan.schedule={schedule.name}: "
            "its input-gradient step detaches the stage's outputs before the weight step, so DDP "
            "could not find the used parameters; every gpt_tiny parameter is used, leave it false"
        )
    for key, value in (("optimizer", "optim"), ("optimizer_step", "by_block")):
        if factory_cfg.get(key) == value:
            raise ValueError(
                f"parallel.{key}={value} (optimizer updates overlapped with the reduction) with "
                f"parallel.plan.pp={pp}: a clipped update needs every stage's gradient norm "
                "before any update, which those updates do not wait for; use parallel=pp_dp, "
                "ddp, bucketer or fsdp"
            )
