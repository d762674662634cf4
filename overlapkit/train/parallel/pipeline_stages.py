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

The schedules are torch's (``torch.distributed.pipelining``); what each needs of the layout is
checked here before any worker starts (``check_pipeline``), with the config keys in the message.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.pipelining.schedules import get_schedule_class

from overlapkit.train.models.gpt import GPT, GPTConfig

SINGLE_STAGE = ("1F1B", "GPipe")
"""One stage per rank (``virtual_stages`` 1)."""
MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS")
"""``virtual_stages`` stages per rank: rank ``r`` holds ``r, r + p, ...``."""
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Schedules that split backward into input and weight passes; refused (``check_pipeline``)."""
SCHEDULES = SINGLE_STAGE + MULTI_STAGE + ZERO_BUBBLE
HOOK_REDUCERS = ("overlapkit.ddp", "overlapkit.GradBucketer")
"""Wrappers that reduce gradients from autograd hooks."""
REDUCERS = (*HOOK_REDUCERS, "overlapkit.fsdp")
_GPT_PARTS = ("wte", "wpe", "blocks", "ln_f", "lm_head")


def resolve_schedule(name: str) -> str:
    """The schedule's spelling in ``SCHEDULES`` (case-insensitive, as torch's lookup).

    Raises:
        ValueError: not one of ``SCHEDULES``; names the config key and the valid names.
    """
    for known in SCHEDULES:
        if str(name).lower() == known.lower():
            return known
    raise ValueError(
        f"parallel.plan.schedule={name!r} is not a torch.distributed.pipelining schedule; "
        f"valid: {', '.join(SCHEDULES)}"
    )


def schedule_class(name: str) -> type:
    """torch's schedule class for ``name`` (``Schedule1F1B`` for ``1F1B``)."""
    return get_schedule_class(resolve_schedule(name))


def local_stages(pp_rank: int, pp: int, virtual_stages: int) -> tuple[int, ...]:
    """The stage indices pipeline rank ``pp_rank`` (its ``pp`` coordinate) holds, increasing."""
    return tuple(pp_rank + i * pp for i in range(virtual_stages))


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
    stages = plan.pp * plan.virtual_stages
    runs = (stage_layers(len(blocks), stages, stage) for stage in range(stages))
    return [blocks[run.start : run.stop] for run in runs]


def bubble_share(pp: int, virtual_stages: int, micro_batches: int) -> float:
    """The share of a step a stage idles in the schedule's fill and drain: ``(p-1) / (v m + p-1)``.

    The planner's step is ``(m + (p - 1) / v) x t_micro_batch`` (1F1B and interleaved 1F1B,
    Narayanan et al. 2021, arXiv 2104.04473, section 2.2), of which ``(p - 1) / v`` micro-batch
    times are the bubble.
    """
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)


def pipeline_record(plan: Any, micro_batches: int) -> dict | None:
    """The schedule and the planner's bubble share of a step (``summary.json``'s ``pipeline``);
    None without pipeline parallelism."""
    if plan.pp == 1:
        return None
    return {
        "schedule": resolve_schedule(plan.schedule),
        "pp": plan.pp,
        "virtual_stages": plan.virtual_stages,
        "micro_batches": micro_batches,
        "planned_bubble_share": bubble_share(plan.pp, plan.virtual_stages, micro_batches),
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


def check_pipeline(
    plan: Any, *, model_config: Any, grad_accum: int, factory_cfg: Mapping[str, Any]
) -> None:
    """Refuse a pipeline layout that cannot run, before any worker starts; names the config keys.

    Args:
        plan: the ``parallel.plan`` section (``PlanConfig``).
        model_config: the model's config (a ``GPTConfig`` for a pipeline).
        grad_accum (int): ``train.grad_accum``, the micro-batches per step.
        factory_cfg (Mapping): the ``parallel`` group without ``plan``.

    Raises:
        ValueError: a schedule torch does not have; ``virtual_stages`` without ``pp`` or of the
            wrong count for the schedule; a model that is not a GPT; stages not dividing
            ``n_layer``; too few micro-batches for the schedule; ``ep``; a wrapper other than
            ``ok.ddp``, ``ok.GradBucketer``, ``ok.fsdp``; a zero-bubble schedule (with any of
            them); ``ep`` or ``cp`` with ``pp``; ZeRO-2; per-bucket or per-block optimizer
            updates.
    """
    schedule = resolve_schedule(plan.schedule)
    pp, v = plan.pp, plan.virtual_stages
    if pp == 1:
        if v != 1:
            raise ValueError(
                f"parallel.plan.virtual_stages={v} needs pipeline parallelism "
                "(parallel.plan.pp > 1)"
            )
        return
    where = f"parallel.plan.schedule={schedule}"
    target = factory_cfg.get("_target_")
    if schedule in ZERO_BUBBLE:
        why = (
            f"writes weight gradients by hand (split backward), so the hooks of "
            f"parallel._target_={target} never see them"
            if target in HOOK_REDUCERS
            else "splits backward into input and weight passes, and with FSDP2's post-backward "
            "the gradients differ from one process's (measured with torch 2.13 on gloo)"
        )
        raise ValueError(
            f"{where} {why}; use a schedule without zero bubble: "
            f"{', '.join(SINGLE_STAGE + MULTI_STAGE)}"
        )
    if schedule in SINGLE_STAGE and v != 1:
        raise ValueError(
            f"{where} runs one stage per rank, got parallel.plan.virtual_stages={v}; use "
            f"{' or '.join(MULTI_STAGE)} for several"
        )
    if not isinstance(model_config, GPTConfig):
        raise ValueError(
            f"parallel.plan.pp={pp} splits a GPT into stages (model=gpt_tiny); "
            f"{type(model_config).__name__} is not one"
        )
    stages = pp * v
    if model_config.n_layer % stages:
        raise ValueError(
            f"parallel.plan.pp x parallel.plan.virtual_stages = {pp} x {v} = {stages} stages "
            f"must divide model.config.n_layer ({model_config.n_layer}) for {where}"
        )
    _check_micro_batches(schedule, pp, grad_accum)
    for axis, why in (
        ("ep", "expert parallelism inside pipeline stages is not supported"),
        ("cp", "the pipeline's stages pass whole sequences, not a context-parallel shard"),
    ):
        if getattr(plan, axis) > 1:
            raise ValueError(
                f"parallel.plan.pp={pp} with parallel.plan.{axis}={getattr(plan, axis)}: {why}; "
                "use one of them"
            )
    if target not in REDUCERS:
        raise ValueError(
            f"parallel.plan.pp={pp} needs parallel._target_ {', '.join(REDUCERS)} (the "
            f"pipeline wraps each stage), got {target}"
        )
    if factory_cfg.get("zero") == 2:
        raise ValueError(
            f"parallel.zero=2 (ZeRO-2) with parallel.plan.pp={pp}: torch's PipelineStage defers "
            "FSDP2's gradient reduction to after the stage's last micro-batch, so the "
            "reduce-scatter of every micro-batch ZeRO-2 promises cannot happen; use "
            "parallel=zero1, which has the traffic a pipeline gives"
        )
    for key, value in (("optimizer", "optim"), ("optimizer_step", "by_block")):
        if factory_cfg.get(key) == value:
            raise ValueError(
                f"parallel.{key}={value} (optimizer updates overlapped with the reduction) with "
                f"parallel.plan.pp={pp}: a clipped update needs every stage's gradient norm "
                "before any update, which those updates do not wait for; use parallel=pp_dp, "
                "ddp, bucketer or fsdp"
            )


def _check_micro_batches(schedule: str, pp: int, micro_batches: int) -> None:
    """What torch's schedules require of the micro-batch count, as config keys."""
    where = f"parallel.plan.schedule={schedule}"
    if schedule == "1F1B" and micro_batches < pp:
        raise ValueError(
            f"train.grad_accum={micro_batches} micro-batches per step is fewer than the "
            f"{pp} stages {where} keeps in flight; set train.grad_accum >= {pp}"
        )
    if schedule == "Interleaved1F1B":
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            raise ValueError(
                f"train.grad_accum={micro_batches} micro-batches do not split into {rounds} "
                f"equal rounds (train.grad_accum // parallel.plan.pp) for {where}; use a "
                f"multiple of {pp}, or fewer than {2 * pp}"
            )
