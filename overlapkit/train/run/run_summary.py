"""Rank 0's ``RunSummary`` at the end of an ``overlapkit-train`` run.

``summarize`` gathers what the loop measured (the monitor's steps, losses and throughput), what
the layout was (the planner's mesh, the pipeline's schedule, the MoE layers' dispatch groups),
the planner's prediction beside the measured step, and, when profiled, the exposed share of
communication; ``summary.json`` holds the same keys (``RunSummary``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch import nn

from overlapkit.profiling import analyze_run
from overlapkit.profiling.report import format_report
from overlapkit.train.models.moe import MoE
from overlapkit.train.parallel.mesh import Layout
from overlapkit.train.planning.planned import Prediction
from overlapkit.train.run.progress import Monitor, RunSummary, scaling_efficiency

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRecord:
    """What a finished run was, for its summary (rank 0's view)."""

    name: str
    world_size: int
    nodes: int | None
    """The topology's nodes; None without a ``topology`` group."""
    description: str
    """The layout in words (wrapper, cp split, recomputation)."""
    unit: str
    """What throughput counts: ``tok`` or ``samples``."""
    start_step: int
    end_step: int
    seconds: float
    """Wall time of the steps run, s."""
    layout: Layout
    pipeline: dict | None
    """``pipeline_stages.pipeline_record`` of the plan; None without pp."""
    ep_dispatch: list[dict] | None
    """``gather_dispatch``'s every-rank record; None without expert parallelism."""
    baseline_items_per_s: float | None
    checkpoint: Path | None
    """The last checkpoint saved in this invocation; None if none was."""
    live: dict | None = None
    """``ok.LiveMonitor.summary()`` of the run (rank 0); None with ``~live``."""


def gather_dispatch(model: nn.Module, world_size: int) -> list[dict] | None:
    """Every rank's MoE all-to-all record: the group ranks each layer dispatched over, how often.

    A collective (every rank calls it); None when the model has no expert-parallel layer.
    """
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.ep_group is not None]
    if not layers:
        return None
    mine = {
        "rank": dist.get_rank(),
        "layers": [
            {"group": list(m.stats.ranks), "all_to_all_calls": m.stats.all_to_all_calls}
            for m in layers
        ],
    }
    every: list = [None] * world_size
    dist.all_gather_object(every, mine)
    return every


def _mesh_record(layout: Layout) -> dict | None:
    """The planned sizes and groups of every axis larger than 1 (``summary.json``'s ``mesh``)."""
    placement = layout.placement
    if placement is None:
        return None
    return {
        "topology": placement.topology.name,
        "sizes": placement.sizes,
        "groups": {a: placement.groups(a) for a, n in placement.sizes.items() if n > 1},
    }


def _exposed_share(profile_dir: Path) -> tuple[float | None, float | None, int, str | None]:
    """Over all profiled rank-steps: (exposed comm / step time, exposed send/recv / step time,
    their count, the report text)."""
    try:
        report = analyze_run(profile_dir)
    except (FileNotFoundError, ValueError) as err:
        logger.warning("no exposed-comm report: %s", err)
        return None, None, 0, None
    step_ms = sum(r.step_ms for r in report.steps)
    exposed = sum(r.exposed_comm_ms for r in report.steps)
    send_recv = sum(r.kinds["send_recv"].exposed_ms for r in report.steps if "send_recv" in r.kinds)
    if step_ms <= 0:
        return None, None, len(report.steps), format_report(report)
    return exposed / step_ms, send_recv / step_ms, len(report.steps), format_report(report)


def summarize(
    record: RunRecord,
    monitor: Monitor,
    *,
    run_dir: Path,
    tensorboard_dir: Path,
    prediction: Prediction | None,
    profile_dir: Path | None,
) -> RunSummary:
    """The run's summary; with ``profile_dir`` (the run was profiled) its exposed-comm report is
    printed and its shares recorded.

    Args:
        record (RunRecord): what the run was.
        monitor (Monitor): rank 0's measurements of its steps.
        run_dir (Path): the run directory (``summary.json`` is written there by the caller).
        tensorboard_dir (Path): where its scalars went.
        prediction (Prediction | None): the planner's step for this layout, if it could say.
        profile_dir (Path | None): the traces of ``ok.profile``; None when not profiled.

    Returns:
        RunSummary: every key of ``summary.json``.
    """
    steps_per_s, items_per_s, median_ms = monitor.throughput()
    summary = RunSummary(
        name=record.name,
        world_size=record.world_size,
        nodes=record.nodes,
        parallel=record.description,
        unit=record.unit,
        start_step=record.start_step,
        final_step=max(record.start_step, record.end_step),
        steps_run=len(monitor.step_s),
        seconds=record.seconds,
        steps_per_s=steps_per_s,
        items_per_s=items_per_s,
        median_step_ms=median_ms,
        loss_first=monitor.losses[0] if monitor.losses else None,
        loss_last=monitor.losses[-1] if monitor.losses else None,
        run_dir=str(run_dir),
        mesh=_mesh_record(record.layout),
        pipeline=record.pipeline,
        ep_dispatch=record.ep_dispatch,
        baseline_items_per_s=record.baseline_items_per_s,
        scaling_efficiency=scaling_efficiency(
            items_per_s, record.world_size, record.baseline_items_per_s
        ),
        tensorboard_dir=str(tensorboard_dir),
        checkpoint=str(record.checkpoint) if record.checkpoint else None,
    )
    if record.live is not None:
        summary.live = {k: v for k, v in record.live.items() if k != "stragglers"}
        summary.stragglers = record.live["stragglers"]
    if prediction is not None:
        summary.planned_layout = prediction.record()
        summary.predicted_step_s = prediction.step_s
        summary.measured_step_s = None if median_ms is None else median_ms / 1e3
    if profile_dir is not None:
        share, send_recv, count, report = _exposed_share(profile_dir)
        summary.exposed_comm_share, summary.profiled_steps = share, count
        if summary.pipeline is not None:
            summary.pipeline["send_recv_exposed_share"] = send_recv
        summary.profile_dir = str(profile_dir)
        if report:
            print(report)
    return summary
