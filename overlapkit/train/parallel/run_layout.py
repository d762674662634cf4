"""A run's layout in the one description (``TrainingLayout``), judged by what overlapkit-train runs.

``run_layout`` reads the layout out of a run's config: the sizes (``parallel.plan``), the sharding
its wrapper runs (``parallel._target_`` and ``parallel.zero``, as the table's ``sharding_of``
says), the micro-batching (``train.batch_size`` sequences per micro-batch per rank,
``train.grad_accum`` micro-batches per step) and the recomputation (``train.recompute``,
``train.recompute_layers``). ``check_layout`` raises the first refusal of
``overlapkit.layout.overlapkit_train``'s table, the one the auto-planner's search reads, before
any worker starts; ``check_parallel`` makes every check of the ``parallel`` group, the table's
and those of what it does not describe (the world, the model, the wrapper's options). A wrapper
outside the table has no layout; its sizes are refused by ``mesh.check_plan`` (the wrappers that
run them) and ``pipeline_stages.check_pipeline``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from overlapkit.fsdp.zero import resolve_reshard_after_forward
from overlapkit.layout import TrainingLayout
from overlapkit.layout.overlapkit_train import (
    FSDP,
    Job,
    config_refusal,
    schedule_named,
    sharding_of,
)
from overlapkit.train.parallel.context_parallel import check_sequence_split
from overlapkit.train.parallel.mesh import PlanConfig, check_ep_chunks, check_plan
from overlapkit.train.parallel.pipeline_stages import check_pipeline
from overlapkit.train.parallel.recompute import check_recompute_fits
from overlapkit.train.parallel.tensor_parallel import check_tensor_parallel
from overlapkit.train.parallel.wrappers import check_run_optimizer


def run_layout(
    plan: PlanConfig, factory_cfg: Mapping[str, Any], train: Any, *, world_size: int
) -> TrainingLayout | None:
    """The run's layout; None for a wrapper the table has no sharding for.

    Args:
        plan (PlanConfig): ``parallel.plan``.
        factory_cfg (Mapping): the ``parallel`` group without ``plan``.
        train: the ``train`` group (a ``TrainConfig`` or its config): ``batch_size``, the
            micro-batch per rank, ``grad_accum``, the micro-batches per step, ``recompute`` and
            ``recompute_layers``.
        world_size (int): the job's ranks.

    Raises:
        ValueError / TypeError: what ``TrainingLayout`` refuses of it (``check_job`` refuses
            it first, by config key).
    """
    sizes, dp = plan.sizes, plan.dp(world_size)
    sharding = sharding_of(
        factory_cfg.get("_target_"), zero=factory_cfg.get("zero"), dp_shard=sizes.dp_shard, dp=dp
    )
    if sharding is None:
        return None
    full = train.recompute == "full"
    # The layout names the zero-bubble schedules; 1F1B and interleaved 1F1B are its default.
    schedule = schedule_named(plan.schedule) if (sizes.pp or 1) > 1 else None
    return TrainingLayout(
        **sizes.given() | {"dp": dp, "dp_shard": sizes.dp_shard if sharding == "hsdp" else None},
        micro_batch=train.batch_size,
        num_micro_batches=train.grad_accum,
        recompute=train.recompute,
        recompute_layers=train.recompute_layers if full else None,
        sharding=sharding,
        schedule=schedule.name if schedule is not None and schedule.split_backward else None,
    )


def run_job(
    plan: PlanConfig,
    factory_cfg: Mapping[str, Any],
    train: Any,
    *,
    world_size: int,
    layers: int | None,
) -> Job | None:
    """The run as the table judges it: ``run_layout`` of ``train`` (the ``TrainConfig``) on its
    schedule, with the model's ``layers`` (None: a model without blocks) and ``ok.fsdp``'s shard
    group; None where there is no layout.

    Raises:
        ValueError: a schedule torch does not have (as ``schedule_named``).
    """
    layout = run_layout(plan, factory_cfg, train, world_size=world_size)
    if layout is None:
        return None
    return Job(
        layout=layout,
        schedule=schedule_named(plan.schedule),
        layers=layers,
        shard_group=plan.sizes.dp_shard,
    )


def check_layout(
    plan: PlanConfig,
    factory_cfg: Mapping[str, Any],
    train: Any,
    *,
    world_size: int,
    model_config: Any,
) -> None:
    """Refuse what overlapkit-train does not run of the run's layout, before launch.

    Raises:
        ValueError: the table's first refusal (``overlapkit.layout.overlapkit_train.REFUSED``),
            one line naming the config keys.
    """
    layers = getattr(model_config, "n_layer", None)
    job = run_job(plan, factory_cfg, train, world_size=world_size, layers=layers)
    refusal = None if job is None else config_refusal(job)
    if refusal is not None:
        raise ValueError(refusal)


def check_parallel(
    plan: PlanConfig,
    factory_cfg: Mapping[str, Any],
    train: Any,
    *,
    world_size: int,
    model_config: Any,
    seq_len: int | None,
) -> None:
    """Every check of the ``parallel`` group before launch, each refusal one line naming its
    config key: the sizes against the world, the model and the wrapper (``check_plan``), the
    sequence split, the wrapper's options, the pipeline's schedule, the recomputation, and what
    overlapkit-train does not run (``check_layout``).

    Args:
        plan (PlanConfig): ``parallel.plan``.
        factory_cfg (Mapping): the ``parallel`` group without ``plan``.
        train: the ``TrainConfig``.
        world_size (int): ``launcher.nnodes x launcher.nproc_per_node``.
        model_config: the model's config.
        seq_len (int | None): the data's sequence length (None: the data has no sequences).

    Raises:
        ValueError / TypeError: the first refusal.
    """
    target = factory_cfg.get("_target_")
    check_plan(plan, world_size=world_size, model_config=model_config, target=target)
    check_sequence_split(plan.sizes.cp, seq_len)
    check_ep_chunks(plan, batch_size=train.batch_size, seq_len=seq_len)
    check_tensor_parallel(plan, batch_size=train.batch_size, seq_len=seq_len)
    if target == FSDP.target:  # zero=, before the workers build it
        resolve_reshard_after_forward(
            factory_cfg.get("zero"), factory_cfg.get("reshard_after_forward")
        )
    check_run_optimizer(factory_cfg, plan=plan)
    check_pipeline(plan, model_config=model_config, factory_cfg=factory_cfg)
    check_recompute_fits(
        train.recompute,
        train.recompute_layers,
        blocks_per_stage=model_config.n_layer // (plan.sizes.pp * plan.sizes.virtual_stages),
        has_attention=hasattr(model_config, "n_head"),
    )
    check_layout(plan, factory_cfg, train, world_size=world_size, model_config=model_config)
