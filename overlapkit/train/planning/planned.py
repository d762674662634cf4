"""What the auto-planner predicts for a run: its layout in the planner's terms and its step time.

Every ``overlapkit-train`` run whose topology has an accelerator section (a GPU preset, or a host
measured by ``overlapkit calibrate --host``) is priced as overlapkit-train runs it
(``autoplan.framework.OVERLAPKIT_TRAIN``, fp32 as the loop trains): the run's layout
(``train.parallel.run_layout``, the inverse of ``autoplan.handoff.run_config.train_overrides``)
is priced by ``predict_run`` with the search's own step-time and memory models. Rank 0 logs the
layout and the predicted step before step 1, and the summary ends with the measured median step
beside it (``planned_layout``, ``predicted_step_s``, ``measured_step_s`` in ``summary.json``).

What the planner does not price is priced as its nearest: ``ok.GradBucketer`` as ``ok.ddp``
(both all-reduce buckets of the same bytes), per-bucket or per-block optimizer updates
(``bucketer_overlap``, ``fsdp_overlap``) as the plain step, bf16 gradient compression as fp32
gradients, HSDP with one replica (``dp_shard`` equal to dp) as fsdp, ZeRO over an HSDP mesh as
ZeRO over dp. A wrapper the planner has no sharding for (another ``_target_``), a model without
attention (``model=mlp``) or a topology
without an accelerator get no prediction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from overlapkit.autoplan.candidate import layout_dict
from overlapkit.autoplan.framework import OVERLAPKIT_TRAIN
from overlapkit.autoplan.memory import FP32
from overlapkit.autoplan.models import train_model_spec
from overlapkit.autoplan.search import price
from overlapkit.autoplan.settings import SearchSettings
from overlapkit.layout import TrainingLayout
from overlapkit.topology.model import Topology
from overlapkit.train.parallel.mesh import PlanConfig
from overlapkit.train.parallel.run_layout import run_layout

RUN_SETTINGS = SearchSettings(framework=OVERLAPKIT_TRAIN, precision=FP32)
"""How the planner prices an overlapkit-train run: as it splits the model, in fp32 (the loop
has no mixed precision). On GPUs the presets' peak is BF16's, which fp32 matmuls do not reach:
there the prediction is the step BF16 would give."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """The planner's price of a run's layout."""

    layout: TrainingLayout
    step_s: float
    """Predicted step time, s."""
    memory_gb: float
    """Predicted peak memory per rank, GB (10^9 bytes)."""
    fits: bool
    topology: str

    def describe(self) -> str:
        """``planned layout tp=1 pp=2 ...: predicted step 412.3 ms (...)``, one line."""
        fits = "" if self.fits else ", does NOT fit the accelerator's memory"
        return (
            f"planned layout {self.layout.describe()}: predicted step "
            f"{self.step_s * 1e3:.1f} ms, {self.memory_gb:.3g} GB per rank{fits} "
            f"(the auto-planner on {self.topology}, as overlapkit-train runs it)"
        )

    def record(self) -> dict:
        """``summary.json``'s ``planned_layout``: the layout as ``--json`` spells it, and its
        one-line description (``text``)."""
        return {**layout_dict(self.layout), "text": self.layout.describe()}


def predict_run(
    topology: Topology | None,
    model_config: Any,
    layout: TrainingLayout | None,
    *,
    seq_len: int,
    name: str,
    modes: Mapping[str, Any] | None = None,
) -> Prediction | None:
    """The planner's step time and memory of ``layout`` (see module doc) in the run's in-layer
    ``modes`` (``parallel.plan``'s ``ep_chunks``, ``tp_comm``, ``tp_chunks``; None: the
    synchronous ones); None where there is no layout, no accelerator section or no transformer
    to describe."""
    if layout is None or topology is None or topology.accelerator is None:
        return None
    if getattr(model_config, "n_head", None) is None:
        return None
    spec = train_model_spec(model_config, name=name)
    fixed = {"ep_chunks": 1, "tp_comm": "sync"} | dict(modes or {})
    settings = dataclasses.replace(RUN_SETTINGS, **fixed)
    candidate = price(topology, spec, layout, seq_len=seq_len, settings=settings)
    return Prediction(
        layout,
        candidate.step.step_s,
        candidate.memory.total / 1e9,
        candidate.fits,
        topology.name,
    )


def predict_job(
    plan: PlanConfig,
    factory_cfg: Mapping[str, Any],
    train: Any,
    *,
    world_size: int,
    topology: Topology | None,
    model_config: Any,
    seq_len: int | None,
    name: str,
) -> Prediction | None:
    """``predict_run`` of the run ``plan``, the ``parallel`` group's wrapper and ``train`` (the
    ``TrainConfig``) describe."""
    layout = run_layout(plan, factory_cfg, train, world_size=world_size)
    seq_len = seq_len or getattr(model_config, "block_size", 1)
    return predict_run(
        topology,
        model_config,
        layout,
        seq_len=seq_len,
        name=name,
        modes={"ep_chunks": plan.ep_chunks, "tp_comm": plan.tp_comm, "tp_chunks": plan.tp_chunks},
    )
