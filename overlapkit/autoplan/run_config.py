"""How to run a chosen layout: ``overlapkit-train`` overrides (torchtitan's arguments are
``autoplan.torchtitan``'s), and the layout priced as another framework runs it.

overlapkit-train runs data parallelism with ``ok.ddp`` / ``ok.GradBucketer`` (``parallel=ddp``),
``ok.fsdp`` (``parallel=fsdp``) and HSDP (``parallel=hsdp``, ``parallel.plan.dp_shard``), tensor
parallelism with the bucketer (``parallel=tp_dp``, ``parallel.plan.tp``) and expert parallelism
with it (``parallel=ep_dp``, ``parallel.plan.ep``); not tensor with expert parallelism together,
nor tensor parallelism under FSDP (``overlapkit/train/mesh.py`` refuses both). It has no
context or pipeline parallelism, no activation recomputation and no ZeRO-1/2 optimizer sharding:
what it runs is ``autoplan.framework.OVERLAPKIT_TRAIN``'s ``lacks`` / ``refusal``.
``train.batch_size`` is the micro-batch per rank and ``train.grad_accum`` the micro-batches; a
recomputing layout (once the framework runs one) adds ``train.recompute`` and, for full
recomputation of some layers, ``train.recompute_layers`` (layers of each pipeline stage).
"""

from __future__ import annotations

import dataclasses

from overlapkit.autoplan.auto import AutoPlan
from overlapkit.autoplan.framework import OVERLAPKIT_TRAIN, Framework
from overlapkit.autoplan.search import price
from overlapkit.planner.layout import TrainingLayout

TRAIN_MODELS = ("gpt_tiny", "moe_tiny", "mlp")
"""overlapkit-train's model zoo (``conf/model``)."""


def train_overrides(
    layout: TrainingLayout,
    *,
    topology: str,
    nodes: int,
    ranks_per_node: int,
    model: str | None,
    framework: Framework = OVERLAPKIT_TRAIN,
) -> list[str]:
    """The ``overlapkit-train`` command-line overrides that run ``layout``.

    ``framework``: what overlapkit-train runs (``OVERLAPKIT_TRAIN``; a test passes one that
    runs more, as overlapkit-train will).

    Raises:
        ValueError: overlapkit-train cannot run ``layout`` (the message says why).
    """
    refusal = framework.refusal(layout)
    if refusal is not None:
        raise ValueError(refusal)
    if layout.tp > 1:
        parallel = ["parallel=tp_dp", f"parallel.plan.tp={layout.tp}"]
    elif layout.ep > 1:
        parallel = ["parallel=ep_dp", f"parallel.plan.ep={layout.ep}"]
    elif layout.sharding == "hsdp":
        parallel = ["parallel=hsdp", f"parallel.plan.dp_shard={layout.dp_shard}"]
    elif layout.sharding == "fsdp":
        parallel = ["parallel=fsdp"]
    else:
        parallel = ["parallel=ddp"]
    args = [f"model={model}"] if model in TRAIN_MODELS else []
    args += [
        *parallel,
        f"train.batch_size={layout.micro_batch}",
        f"train.grad_accum={layout.num_micro_batches}",
        *recompute_overrides(layout),
        "topology=preset",
        f"topology.name_or_path={topology}",
        f"launcher.nnodes={nodes}",
        f"launcher.nproc_per_node={ranks_per_node}",
    ]
    if nodes > 1:
        args.append("launcher=multinode")
    return args


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
