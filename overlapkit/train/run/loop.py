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
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.optim.lr_scheduler import LRScheduler

from overlapkit.group.stall_watchdog import StallWatchdog
from overlapkit.live.monitor import LiveConfig, LiveMonitor
from overlapkit.profiling.profiler import Profile
from overlapkit.topology.model import Topology
from overlapkit.train.parallel.context_parallel import SequenceSplit, WholeSequences
from overlapkit.train.parallel.mesh import Layout, PlanConfig, build_layout, split_parallel
from overlapkit.train.parallel.pipeline_stages import pipeline_record
from overlapkit.train.parallel.recompute import NONE, check_recompute_mode
from overlapkit.train.parallel.wrappers import Parallelized
from overlapkit.train.planning.planned import Prediction, predict_job
from overlapkit.train.run.checkpoint import TrainingState, committed_checkpoints, remove_pending
from overlapkit.train.run.data import BatchStream, DataSource, check_compatible
from overlapkit.train.run.progress import Monitor, RunSummary
from overlapkit.train.run.resume import resume_from_newest_usable
from overlapkit.train.run.run_summary import RunRecord, gather_dispatch, summarize
from overlapkit.train.run.step import UNTIMED, train_step, wrap_model
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


def train(
    job: DictConfig, paths: RunPaths, *, local_rank: int, stall: StallWatchdog | None = None
) -> RunSummary | None:
    """Train as ``job`` (the composed config) says; every rank calls it after joining the group.

    Args:
        job (DictConfig): the resolved ``overlapkit-train`` config.
        paths (RunPaths): the run's directories (rank 0's).
        local_rank (int): this rank's index on its node (its CUDA device).
        stall (StallWatchdog | None): told of every step, and closed after the last; None:
            no stall limit.

    Returns:
        RunSummary | None: the summary on rank 0 (also printed and written to
        ``summary.json``); None on the other ranks.
    """
    run = _set_up(job, paths, local_rank)
    cfg, rank, world_size = run.cfg, run.rank, run.world_size
    start_step = _resume(run.state, paths, resume=cfg.resume, rank=rank)
    end_step = min(cfg.steps, cfg.stop_after or cfg.steps)
    description = run.par.description + run.split.description
    if run.recomputed:
        description += f", recompute={cfg.recompute} ({len(run.recomputed)} blocks)"
    logger.info(
        "%s, %d ranks (mesh %s), device %s: steps %d..%d of %d",
        description,
        world_size,
        run.layout.describe(),
        run.device,
        start_step + 1,
        end_step,
        cfg.steps,
    )
    prediction = _predict(job, run) if rank == 0 else None
    items_per_step = cfg.batch_size * cfg.grad_accum * run.data_shards * run.source.items_per_sample
    monitor = Monitor(
        enabled=rank == 0,
        tb_dir=paths.scalars,
        start_step=start_step,
        end_step=end_step,
        items_per_step=items_per_step,
        unit=run.source.unit,
        progress=cfg.progress,
    )
    profiled = job.get("profiler") is not None and start_step < end_step
    steps = range(start_step + 1, end_step + 1)
    live = _live_monitor(job)
    checkpoint, seconds = _run_steps(
        run,
        monitor,
        paths,
        steps,
        profiler=job.profiler if profiled else None,
        live=live,
        stall=stall,
    )
    dist.barrier()  # every rank's traces are written before rank 0 reads them
    dispatch = gather_dispatch(run.par.model, world_size)
    if rank != 0:
        return None
    record = RunRecord(
        name=str(job.get("name", "")),
        world_size=world_size,
        nodes=run.topology.num_nodes if run.topology is not None else None,
        description=description,
        unit=run.source.unit,
        start_step=start_step,
        end_step=end_step,
        seconds=seconds,
        layout=run.layout,
        pipeline=pipeline_record(run.plan, cfg.grad_accum),
        ep_dispatch=dispatch,
        baseline_items_per_s=cfg.baseline_items_per_s,
        checkpoint=checkpoint,
        live=None if live is None else live.summary(),
    )
    summary = summarize(
        record,
        monitor,
        run_dir=paths.run_dir,
        tensorboard_dir=paths.tensorboard,
        prediction=prediction,
        profile_dir=paths.profile if profiled else None,
    )
    summary.write(paths.run_dir / "summary.json")
    print(summary.format(), flush=True)
    return summary


@dataclass(slots=True, kw_only=True)
class _Run:
    """A rank's run, set up: its config, model as the step drives it, data and state."""

    cfg: TrainConfig
    rank: int
    world_size: int
    device: torch.device
    model_config: object
    """The model's ``config`` (what the planner describes it from)."""
    source: DataSource
    topology: Topology | None
    plan: PlanConfig
    factory: dict[str, Any]
    """The ``parallel`` group without ``plan``."""
    layout: Layout
    par: Parallelized
    split: WholeSequences | SequenceSplit
    recomputed: list[int]
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    stream: BatchStream
    data_shards: int
    state: TrainingState


def _set_up(job: DictConfig, paths: RunPaths, local_rank: int) -> _Run:
    """Every rank: the model on its device with the same initial weights, wrapped for the
    layout; the optimizer, schedule, this rank's batches and the checkpointable state."""
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
    return _Run(
        cfg=cfg,
        rank=rank,
        world_size=world_size,
        device=device,
        model_config=model.config,
        source=source,
        topology=topology,
        plan=plan,
        factory=factory,
        layout=layout,
        par=par,
        split=split,
        recomputed=recomputed,
        optimizer=optimizer,
        scheduler=scheduler,
        stream=stream,
        data_shards=data_shards,
        state=state,
    )


def _resume(state: TrainingState, paths: RunPaths, *, resume: bool, rank: int) -> int:
    """Load the newest usable checkpoint of the run directory (with ``resume``); the step it
    was saved at, or 0.

    Rank 0 lists the candidates, so that every rank tries the same ones even if their views of
    the directory differ (a shared file system that lags).
    """
    candidates = []
    if rank == 0:
        remove_pending(paths.checkpoints)
        candidates = committed_checkpoints(paths.checkpoints) if resume else []
    shared = [candidates]
    dist.broadcast_object_list(shared, src=0)
    found = resume_from_newest_usable(state, shared[0])
    if found is None:
        return 0
    logger.info("resumed from %s (step %d)", found[1], found[0])
    return found[0]


def _predict(job: DictConfig, run: _Run) -> Prediction | None:
    """What the planner predicts for this layout, where the topology can say (rank 0)."""
    prediction = predict_job(
        run.plan,
        run.factory,
        run.cfg,
        world_size=run.world_size,
        topology=run.topology,
        model_config=run.model_config,
        seq_len=getattr(run.source, "seq_len", None),
        name=str(job.get("name", "")),
    )
    if prediction is not None:
        logger.info("%s", prediction.describe())
    return prediction


def _live_monitor(job: DictConfig) -> LiveMonitor | None:
    """The ``live`` group's monitor (every rank); None when ``~live``."""
    if job.get("live") is None:
        return None
    config: LiveConfig = instantiate(job.live)
    return LiveMonitor(config)


def _run_steps(
    run: _Run,
    monitor: Monitor,
    paths: RunPaths,
    steps: range,
    *,
    profiler: DictConfig | None,
    live: LiveMonitor | None = None,
    stall: StallWatchdog | None = None,
) -> tuple[Path | None, float]:
    """Run ``steps``, under ``ok.profile`` when the ``profiler`` group is given, timed by the
    ``live`` monitor when there is one, checkpointing every ``train.checkpoint_every`` steps
    and at the last. ``stall`` is told of each step, paused in checkpoints and trace exports
    (long, and not steps), and closed after the last step.

    Returns:
        tuple: the last checkpoint saved (None if none was) and the seconds from the start to
        the wrapper's pending work settled (``Parallelized.settle``).
    """
    cfg, checkpoint = run.cfg, None
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.callback(monitor.close)
        if live is not None:
            stack.callback(live.stop)
        profile = None
        if profiler is not None:
            profile = stack.enter_context(instantiate(profiler)(logdir=paths.profile))
        for step in steps:
            lr = run.scheduler.get_last_lr()[0]
            t0 = time.perf_counter()
            loss, grad_norm = train_step(
                run.par,
                run.optimizer,
                run.stream,
                run.source,
                cfg,
                run.device,
                run.split,
                phases=live or UNTIMED,
            )
            run.scheduler.step()
            step_s = time.perf_counter() - t0
            if live is not None:
                monitor.live_step(live.end_step(step), exposed_ms=live.exposed_ms())
            monitor.step(step, loss=loss, lr=lr, grad_norm=grad_norm, step_s=step_s)
            if stall is not None:
                stall.step(step)
            with _paused(stall):
                if profile is not None:
                    _step_profiler(profile, monitor, step, rank=run.rank)
                every = cfg.checkpoint_every
                if every and (step % every == 0 or step == steps[-1]):
                    checkpoint = run.state.save(paths.checkpoints, step, keep=cfg.keep_checkpoints)
        if stall is not None:
            stall.close()  # what follows (trace export, summary) is not a step
        if live is not None:
            monitor.live_step(live.close(), exposed_ms=None)
        run.par.settle()
        seconds = time.perf_counter() - started
    return checkpoint, seconds


def _paused(stall: StallWatchdog | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if stall is None else stall.paused()


def _step_profiler(profile: Profile, monitor: Monitor, step: int, *, rank: int) -> None:
    """Advance ``ok.profile`` one step; on rank 0, when it saved a cycle, show that cycle's
    median exposed communication, labelled with the steps it covers."""
    traces = len(profile.files)
    profile.step()
    if rank == 0 and len(profile.files) > traces:
        # A cycle was saved: its active steps are the ones that just ran.
        cycle = {path.name for path in profile.files[traces:]}
        monitor.set_exposed_comm(
            statistics.median(m.exposed_comm_ms for m in profile.summary() if m.file in cycle),
            range(step - profile.active + 1, step + 1),
        )
