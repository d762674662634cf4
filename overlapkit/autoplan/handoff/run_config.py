"""How to run a chosen layout: ``overlapkit-train`` overrides (torchtitan's arguments are
``autoplan.handoff.torchtitan``'s), and the layout priced as another framework runs it.

overlapkit-train runs what ``overlapkit.layout.overlapkit_train``'s table does not refuse
(``autoplan.framework.OVERLAPKIT_TRAIN.refusal``). ``train_overrides`` spells a layout with its
config groups:

=====================  ===============================================================
the layout             the overrides
=====================  ===============================================================
ep > 1                 ``parallel=ep_dp parallel.plan.ep=E`` (``ok.GradBucketer``)
tp > 1                 ``parallel=tp_dp parallel.plan.tp=T`` (``ok.GradBucketer``)
otherwise, by sharding ``parallel=ddp``, ``fsdp``, ``zero1``, ``zero2``, ``hsdp
                       parallel.plan.dp_shard=Z``; pp with ddp ``parallel=pp_dp``, cp with
                       ddp ``parallel=cp_dp``
pp > 1                 ``parallel.plan.pp=P`` (the schedule the planner prices: the
                       layout's own with ``parallel.plan.virtual_stages=v`` (a zero-bubble
                       one), ``Interleaved1F1B`` for v > 1, 1F1B otherwise)
cp > 1                 ``parallel.plan.cp=C``
=====================  ===============================================================

A plan key the chosen group does not set is added with ``++`` (add or override).
``train.batch_size`` is the micro-batch per rank and ``train.grad_accum`` the micro-batches; a
recomputing layout adds ``train.recompute`` and, for full recomputation of some layers,
``train.recompute_layers`` (layers of each pipeline stage).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from overlapkit.autoplan.framework import OVERLAPKIT_TRAIN, Framework
from overlapkit.autoplan.ok_plan import AutoPlan
from overlapkit.autoplan.pipeline_schedule import schedule_of
from overlapkit.autoplan.search import price
from overlapkit.layout import TrainingLayout

TRAIN_MODELS = ("gpt_tiny", "moe_tiny", "mlp")
"""overlapkit-train's model zoo (``conf/model``)."""
_GROUP_PLAN_KEYS = {
    "ep_dp": ("ep",),
    "tp_dp": ("tp",),
    "cp_dp": ("cp",),
    "pp_dp": ("pp", "schedule", "virtual_stages"),
    "hsdp": ("dp_shard",),
}
"""The ``parallel.plan`` keys each group's YAML sets (the others are added with ``++``)."""


def parallel_group(layout: TrainingLayout) -> str:
    """The ``parallel`` config group that runs ``layout`` (see module doc)."""
    if layout.ep > 1:
        return "ep_dp"
    if layout.tp > 1:
        return "tp_dp"
    if layout.sharding == "ddp":
        return "pp_dp" if layout.pp > 1 else "cp_dp" if layout.cp > 1 else "ddp"
    return layout.sharding


def plan_overrides(layout: TrainingLayout, group: str) -> list[str]:
    """The ``parallel.plan`` overrides of ``layout`` on top of ``group``'s YAML."""
    sizes: dict[str, object] = {
        "ep": layout.ep,
        "tp": layout.tp,
        "cp": layout.cp,
        "pp": layout.pp,
        "dp_shard": layout.dp_shard,
    }
    if layout.pp > 1 and (layout.virtual_stages > 1 or layout.schedule is not None):
        sizes |= {"schedule": schedule_of(layout), "virtual_stages": layout.virtual_stages}
    own = _GROUP_PLAN_KEYS.get(group, ())
    out = []
    for key, value in sizes.items():
        if value in (None, 1):
            continue
        out.append(f"{'' if key in own else '++'}parallel.plan.{key}={value}")
    return out


def train_overrides(
    layout: TrainingLayout,
    *,
    topology: str,
    nodes: int,
    ranks_per_node: int,
    model: str | None,
    framework: Framework = OVERLAPKIT_TRAIN,
    layers: int | None = None,
    modes: Mapping[str, object] | None = None,
) -> list[str]:
    """The ``overlapkit-train`` command-line overrides that run ``layout``.

    ``framework``: what overlapkit-train runs (``OVERLAPKIT_TRAIN``; a test passes another);
    ``layers``: the model's layers, checked against the pipeline's stages (None: not checked);
    ``modes``: the in-layer modes the search chose (``StepTime.modes``, ``parallel.plan`` keys
    the group's YAML declares).

    Raises:
        ValueError: overlapkit-train cannot run ``layout`` (the message says why).
    """
    refusal = framework.refusal(layout, layers=layers)
    if refusal is not None:
        raise ValueError(refusal)
    group = parallel_group(layout)
    args = [f"model={model}"] if model in TRAIN_MODELS else []
    args += [
        f"parallel={group}",
        *plan_overrides(layout, group),
        *(f"parallel.plan.{key}={value}" for key, value in (modes or {}).items()),
        *batch_overrides(layout),
        "topology=preset",
        f"topology.name_or_path={topology}",
        f"launcher.nnodes={nodes}",
        f"launcher.nproc_per_node={ranks_per_node}",
    ]
    if nodes > 1:
        args.append("launcher=multinode")
    return args


def batch_overrides(layout: TrainingLayout) -> list[str]:
    """``train.batch_size``, ``train.grad_accum`` and the recomputation of ``layout``."""
    return [
        f"train.batch_size={layout.micro_batch}",
        f"train.grad_accum={layout.num_micro_batches}",
        *recompute_overrides(layout),
    ]


def recompute_overrides(layout: TrainingLayout) -> list[str]:
    """``train.recompute`` (and ``train.recompute_layers``, per pipeline stage) for ``layout``:
    none when it recomputes nothing."""
    if layout.recompute == "none":
        return []
    out = [f"train.recompute={layout.recompute}"]
    if layout.recompute_layers is not None:
        out.append(f"train.recompute_layers={layout.recompute_layers}")
    return out


def priced_as(answer: AutoPlan, framework: Framework) -> dict:
    """The best layout priced as ``framework`` runs it (``autoplan.framework``), the other
    settings kept: ``framework``, ``step_time_s``, ``memory_gb_per_gpu`` (1e9 bytes), ``fits``."""
    settings = dataclasses.replace(answer.settings, framework=framework)
    candidate = price(
        answer.topology,
        answer.model,
        answer.best.layout,
        seq_len=answer.seq_len,
        settings=settings,
    )
    return {
        "framework": framework.name,
        "step_time_s": candidate.step.step_s,
        "memory_gb_per_gpu": candidate.memory.total / 1e9,
        "fits": candidate.fits,
    }
