"""The training loop every ``overlapkit-train`` worker runs (one process per rank).

Per step (``overlapkit.train.run.step``): ``grad_accum`` micro-batches (gradient reduction skipped
on all but the last; under context parallelism each rank's chunks of the sequences), the
wrapper's end-of-backward (the bucketer's ``wait``), gradient clipping, AdamW, the warm-up/cosine
schedule. Around it: automatic resume from the newest checkpoint in the run directory,
``ok.profile`` when the ``profiler`` group is chosen, rank 0's progress bar and TensorBoard
scalars, checkpoints every ``checkpoint_every`` steps and at the end, and a summary.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig

from overlapkit.profiling import analyze_run
from overlapkit.profiling.report import format_report
from overlapkit.train.models.moe import MoE
from overlapkit.train.parallel.mesh import Layout, build_layout, split_parallel
from overlapkit.train.parallel.pipeline_stages import pipeline_record
from overlapkit.train.parallel.recompute import NONE, check_recompute_mode
from overlapkit.train.parallel.wrappers import Parallelized
from overlapkit.train.planning.planned import predict_job
from overlapkit.train.run.checkpoint import TrainingState, committed_checkpoints, remove_pending
from overlapkit.train.run.data import BatchStream, check_compatible
from overlapkit.train.run.progress import Monitor, RunSummary, scaling_efficiency
from overlapkit.train.run.resume import resume_from_newest_usable
from overlapkit.train.run.step import train_step, wrap_model
from overlapkit.validation import check_int

logger = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The ``train`` config group."""

    steps: int = 100
    """Optimizer steps of the whole run (the LR schedule spans them)."""
    batch_size: int = 8
    """Samples per rank per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; gradients are reduced once, after the last."""
    clip_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; None disables clipping."""
    seed: int = 0
    """Seeds the initial weights (the same on every rank) and the data."""
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda``."""
    checkpoint_every: int = 50
    """Save every this many steps and at the last step; 0 disables checkpoints."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep; 0 keeps all."""
    resume: bool = True
    """Resume from the newest checkpoint in the run directory when there is one."""
    stop_after: int | None = None
    """End this invocation after this step (checkpointed) without changing the schedule, as a
    time-limited job does; rerunning resumes. None runs to ``steps``."""
    progress: bool = True
    """Show the progress bar on rank 0."""
    baseline_items_per_s: float | None = None
    """Throughput of a 1-rank run of the same config (its summary's tok/s, or samples/s for
    data=regression); the summary then reports scaling efficiency T(N) / (N x T(1)). None: not
    reported."""
    recompute: str = NONE
    """Activation recomputation (``overlapkit.train.parallel.recompute``): ``none``,
    ``selective`` (the attention core of every block) or ``full`` (whole blocks)."""
    recompute_layers: int | None = None
    """With ``recompute: full``: blocks of each pipeline stage recomputed, from its first; None
    means all of them (the planner's ``full:K`` / ``full:all``)."""

    def __post_init__(self) -> None:
        check_int("train.steps", self.steps, 1)
        check_int("train.batch_size", self.batch_size, 1)
        check_int("train.grad_accum", self.grad_accum, 1)
        check_int("train.seed", self.seed, 0)
        check_int("train.checkpoint_every", self.checkpoint_every, 0)
        check_int("train.keep_checkpoints", self.keep_checkpoints, 0)
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(
                f"train.clip_grad_norm must be > 0 or null (no clipping), got "
                f"{self.clip_grad_norm!r}"
            )
        if self.baseline_items_per_s is not None and not self.baseline_items_per_s > 0:
            raise ValueError(
                f"train.baseline_items_per_s must be > 0 (a 1-rank run's tok/s) or null, got "
                f"{self.baseline_items_per_s!r}"
            )
        check_recompute_mode(self.recompute, self.recompute_layers)
        if self.device not in DEVICES:
            raise ValueError(f"train.device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.stop_after is not None:
            check_int("train.stop_after", self.stop_after, 1)
            if self.stop_after > self.steps:
                raise ValueError(
                    f"train.stop_after ({self.stop_after}) must be <= train.steps ({self.steps})"
                )
            if self.checkpoint_every == 0:
                raise ValueError(
                    "train.stop_after needs checkpoints to resume from; set "
                    "train.checkpoint_every > 0"
                )


def resolve_device(name: str, local_rank: int, local_world_size: int | None = None) -> torch.device:
    """The device a rank trains on: ``cuda:<local_rank>`` or ``cpu``.

    ``auto`` is CUDA only when every local rank has a GPU of its own: NCCL needs one GPU per
    rank, and the choice must be the same on all ranks (rank 0 on a GPU and rank 1 on the CPU
    would pick different backends).

    Args:
        name (str): ``train.device``: ``auto``, ``cuda`` or ``cpu``.
        local_rank (int): this rank on its node.
        local_world_size (int): ranks on this node. Defaults to torchrun's
            ``LOCAL_WORLD_SIZE``, or 1.

    Raises:
        ValueError: ``cuda`` asked for on a machine without CUDA, or with fewer GPUs than
            local ranks.
    """
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "cuda" and gpus < local_world_size:
        raise ValueError(
            f"train.device=cuda needs one GPU per local rank: {local_world_size} rank(s) on "
            f"this node, {gpus} GPU(s) here; use auto or cpu, or fewer launcher.nproc_per_node"
        )
    if name == "cpu" or (name == "auto" and gpus < local_world_size):
        if name == "auto" and gpus > 0:
            logger.warning(
                "train.device=auto: %d local rank(s) but %d GPU(s); training on the CPU",
                local_world_size,
                gpus,
            )
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


@dataclass(frozen=True, slots=True)
class RunPaths:
    """Where a run writes; the same on every rank (rank 0's, broadcast at start)."""

    run_dir: Path
    stamp: str
    """This invocation's start time, naming its TensorBoard directory."""

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.run_dir / "tb"

    @property
    def scalars(self) -> Path:
        return self.tensorboard / self.stamp

    @property
    def profile(self) -> Path:
        return self.scalars / "profile"


def _topology(job: DictConfig, world_size: int, rank: int, paths: RunPaths):
    """Build the ``topology`` group (a collective when detecting); rank 0 saves it as JSON."""
    if job.get("topology") is None:
        return None
    topology = instantiate(job.topology)()
    if topology.world_size != world_size:
        raise ValueError(
            f"topology {topology.name!r} describes {topology.world_size} ranks, but this job has "
            f"{world_size}; choose a preset of this size (NAMExN for N nodes) or topology=detect"
        )
    if rank == 0:
        (paths.run_dir / "topology.json").write_text(json.dumps(topology.to_dict(), indent=2))
    logger.info(
        "topology %s: %d rank(s) on %d node(s)",
        topology.name,
        topology.world_size,
        topology.num_nodes,
    )
    return topology


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


def _gather_dispatch(par: Parallelized, world_size: int) -> list[dict] | None:
    """Every rank's MoE all-to-all record: the group ranks each layer dispatched over, how often.

    A collective (every rank calls it); None when the model has no expert-parallel layer.
    """
    layers = [m for m in par.model.modules() if isinstance(m, MoE) and m.ep_group is not None]
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


def train(job: DictConfig, paths: RunPaths, *, local_rank: int) -> RunSummary | None:
    """Train as ``job`` (the composed config) says; every rank calls it after joining the group.

    Args:
        job (DictConfig): the resolved ``overlapkit-train`` config.
        paths (RunPaths): the run's directories (rank 0's).
        local_rank (int): this rank's index on its node (its CUDA device).

    Returns:
        RunSummary | None: the summary on rank 0 (also printed and written to
        ``summary.json``); None on the other ranks.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg: TrainConfig = instantiate(job.train)
    device = resolve_device(cfg.device, local_rank)

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = instantiate(job.model).to(device)
    source = instantiate(job.data)
    check_compatible(source, model.config)
    topology = _topology(job, world_size, rank, paths)
    plan, factory = split_parallel(job.parallel)
    layout = build_layout(plan, topology, device)
    make_optimizer = instantiate(job.optim.optimizer)
    par, split, recomputed = wrap_model(
        model,
        plan,
        factory,
        layout,
        cfg,
        loss_fn=source.loss,
        make_optimizer=make_optimizer,
        device=device,
    )
    optimizer = par.optimizer or make_optimizer(par.model.parameters())
    scheduler = instantiate(job.optim.scheduler)(optimizer, total_steps=cfg.steps)
    # Ranks of one tensor-parallel group read the same batches.
    data_index, data_shards = layout.data_shard(rank, world_size)
    stream = BatchStream(source, rank=data_index, batch_size=cfg.batch_size)
    state = TrainingState(
        par.model,
        optimizer,
        scheduler,
        stream,
        rank,
        par.bucketers,
        bucketer_keys=par.bucketer_keys,
        flatten_optimizer=plan.sizes.pp > 1,
    )
    torch.manual_seed(cfg.seed + 1 + rank)  # anything random at run time differs per rank

    start_step = 0
    candidates = []
    if rank == 0:
        remove_pending(paths.checkpoints)
        candidates = committed_checkpoints(paths.checkpoints) if cfg.resume else []
    # Rank 0 lists them, so that every rank tries the same ones even if their views of the
    # directory differ (a shared file system that lags).
    shared = [candidates]
    dist.broadcast_object_list(shared, src=0)
    found = resume_from_newest_usable(state, shared[0])
    if found is not None:
        start_step = found[0]
        logger.info("resumed from %s (step %d)", found[1], start_step)
    end_step = min(cfg.steps, cfg.stop_after or cfg.steps)
    description = par.description + split.description
    if recomputed:
        description += f", recompute={cfg.recompute} ({len(recomputed)} blocks)"
    logger.info(
        "%s, %d ranks (mesh %s), device %s: steps %d..%d of %d",
        description,
        world_size,
        layout.describe(),
        device,
        start_step + 1,
        end_step,
        cfg.steps,
    )

    prediction = None
    if rank == 0:  # what the planner predicts for this layout, where the topology can say
        prediction = predict_job(
            plan,
            factory,
            cfg,
            world_size=world_size,
            topology=topology,
            model_config=model.config,
            seq_len=getattr(source, "seq_len", None),
            name=str(job.get("name", "")),
        )
        if prediction is not None:
            logger.info("%s", prediction.describe())

    items_per_step = cfg.batch_size * cfg.grad_accum * data_shards * source.items_per_sample
    monitor = Monitor(
        enabled=rank == 0,
        tb_dir=paths.scalars,
        start_step=start_step,
        end_step=end_step,
        items_per_step=items_per_step,
        unit=source.unit,
        progress=cfg.progress,
    )
    profiler = None
    checkpoint = None
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.callback(monitor.close)
        if job.get("profiler") is not None and start_step < end_step:
            profiler = stack.enter_context(instantiate(job.profiler)(logdir=paths.profile))
        for step in range(start_step + 1, end_step + 1):
            lr = scheduler.get_last_lr()[0]
            t0 = time.perf_counter()
            loss, grad_norm = train_step(par, optimizer, stream, source, cfg, device, split)
            scheduler.step()
            monitor.step(
                step, loss=loss, lr=lr, grad_norm=grad_norm, step_s=time.perf_counter() - t0
            )
            if profiler is not None:
                traces = len(profiler.files)
                profiler.step()
                if rank == 0 and len(profiler.files) > traces:
                    # A cycle was saved: its active steps are the ones that just ran.
                    cycle = {path.name for path in profiler.files[traces:]}
                    monitor.set_exposed_comm(
                        statistics.median(
                            m.exposed_comm_ms for m in profiler.summary() if m.file in cycle
                        ),
                        range(step - profiler.active + 1, step + 1),
                    )
            every = cfg.checkpoint_every
            if every and (step % every == 0 or step == end_step):
                checkpoint = state.save(paths.checkpoints, step, keep=cfg.keep_checkpoints)
        par.settle()
        seconds = time.perf_counter() - started
    dist.barrier()  # every rank's traces are written before rank 0 reads them
    dispatch = _gather_dispatch(par, world_size)
    if rank != 0:
        return None

    steps_per_s, items_per_s, median_ms = monitor.throughput()
    summary = RunSummary(
        name=str(job.get("name", "")),
        world_size=world_size,
        nodes=topology.num_nodes if topology is not None else None,
        parallel=description,
        unit=source.unit,
        start_step=start_step,
        final_step=max(start_step, end_step),
        steps_run=len(monitor.step_s),
        seconds=seconds,
        steps_per_s=steps_per_s,
        items_per_s=items_per_s,
        median_step_ms=median_ms,
        loss_first=monitor.losses[0] if monitor.losses else None,
        loss_last=monitor.losses[-1] if monitor.losses else None,
        run_dir=str(paths.run_dir),
        mesh=_mesh_record(layout),
        pipeline=pipeline_record(plan, cfg.grad_accum),
        ep_dispatch=dispatch,
        baseline_items_per_s=cfg.baseline_items_per_s,
        scaling_efficiency=scaling_efficiency(items_per_s, world_size, cfg.baseline_items_per_s),
        tensorboard_dir=str(paths.tensorboard),
        checkpoint=str(checkpoint) if checkpoint else None,
    )
    if prediction is not None:
        summary.planned_layout = prediction.record()
        summary.predicted_step_s = prediction.step_s
        summary.measured_step_s = None if median_ms is None else median_ms / 1e3
    if profiler is not None:
        share, send_recv, count, report = _exposed_share(paths.profile)
        summary.exposed_comm_share, summary.profiled_steps = share, count
        if summary.pipeline is not None:
            summary.pipeline["send_recv_exposed_share"] = send_recv
        summary.profile_dir = str(paths.profile)
        if report:
            print(report)
    summary.write(paths.run_dir / "summary.json")
    print(summary.format(), flush=True)
    return summary
