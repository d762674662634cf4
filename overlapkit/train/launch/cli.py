"""``overlapkit-train``: the Hydra application that composes a run and launches its workers.

::

    overlapkit-train                                    # gpt_tiny, ok.ddp, 2 local ranks
    overlapkit-train recipe=demo                        # what `make demo` runs
    overlapkit-train parallel=fsdp train.steps=200 launcher.nproc_per_node=4
    overlapkit-train -m parallel=ddp,bucketer,fsdp      # one launch after another
    overlapkit-train parallel=tp_dp launcher.nproc_per_node=4   # tp=2 x dp=2, planned
    overlapkit-train parallel=ep_dp launcher.nproc_per_node=4   # moe_tiny, ep=2 x dp=2
    # the auto-planner chooses (a topology file with an accelerator section; on CPU hosts
    # `overlapkit calibrate --host` writes one)
    overlapkit-train parallel=auto topology=preset topology.name_or_path=host.yaml
    # two nodes: the same command on each, with its node_rank
    overlapkit-train launcher=multinode launcher.node_rank=0 launcher.rdzv_endpoint=HOST:29500
    # inside a Slurm allocation (recipes/slurm/train.sbatch): nodes and ranks from SLURM_*
    srun overlapkit-train launcher=slurm

The configuration is checked here, before any worker starts, so a bad value is reported once,
by name, without a traceback per rank. Only node 0 keeps Hydra's outputs (``.hydra/``, the log
file): the other nodes run Hydra in a scratch directory that is deleted when they finish.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from overlapkit.group.stall_watchdog import stall_message
from overlapkit.planner import plan as place
from overlapkit.train.launch.elastic import LauncherConfig, launch
from overlapkit.train.launch.slurm import task_index
from overlapkit.train.launch.worker_init import resolve_worker_init
from overlapkit.train.parallel.mesh import PlanConfig, split_parallel
from overlapkit.train.parallel.run_layout import check_parallel
from overlapkit.train.planning.parallel_auto import is_auto, resolve_auto
from overlapkit.train.run.checkpoint import latest_checkpoint
from overlapkit.train.run.data import check_compatible
from overlapkit.train.run.loop import RunPaths
from overlapkit.train.run.resume import NoUsableCheckpoint

logger = logging.getLogger(__name__)

_NODE_RANK_KEYS = ("launcher.node_rank=", "+launcher.node_rank=", "++launcher.node_rank=")
_DETECT = "overlapkit.topology.detect_topology"
_SLURM_CHOICE = "launcher=slurm"


def node_rank_from_argv(argv: list[str]) -> int:
    """The ``launcher.node_rank=N`` given on the command line; 0 when absent or not an int.

    It is read before Hydra runs because Hydra writes its outputs before calling the task.
    A value that is not an int is left for the config check to report.
    """
    for arg in reversed(argv):
        for key in _NODE_RANK_KEYS:
            if arg.startswith(key) and arg[len(key) :].strip().isdigit():
                return int(arg[len(key) :])
    return 0


def process_index(argv: list[str]) -> int:
    """Which launch of the job this process is; only 0 keeps Hydra's outputs.

    ``launcher.node_rank=N`` on the command line, or under ``launcher=slurm`` the Slurm task's
    ``SLURM_PROCID`` (0 hosts rank 0).
    """
    if _SLURM_CHOICE in argv:
        return task_index()
    return node_rank_from_argv(argv)


def check_missing(cfg: DictConfig) -> None:
    """Refuse a config with mandatory values (``???``) left unset.

    Hydra's ``instantiate`` silently drops them (the dataclass default would be used instead,
    for example ``node_rank=0`` on every node), so they are checked here, by name.

    Raises:
        ValueError: the unset keys, in order.
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(
            f"{', '.join(missing)} (??? in the config) must be set on the command line, e.g. "
            f"{missing[0]}=..."
        )


def check_job(cfg: DictConfig, launcher: LauncherConfig) -> None:
    """Build the cheap parts of the job once, so that bad values fail before any worker starts.

    Raises:
        ValueError / TypeError / FileNotFoundError: the first bad value, named by its key;
            ``parallel=auto`` (its layout is chosen first: ``resolve_auto``).
    """
    if is_auto(cfg.parallel):
        raise ValueError(
            "parallel=auto: the planner chooses the layout before the checks (overlapkit-train "
            "does it; from Python, overlapkit.train.planning.parallel_auto.resolve_auto)"
        )
    for spec in launcher.worker_init:
        resolve_worker_init(spec)
    train, model_config, source = _checked_components(cfg)
    world_size = launcher.nnodes * launcher.nproc_per_node
    plan, factory = split_parallel(cfg.parallel)
    check_parallel(
        plan,
        factory,
        train,
        world_size=world_size,
        model_config=model_config,
        seq_len=getattr(source, "seq_len", None),
    )
    _check_topology(cfg.get("topology"), plan, world_size)


def _checked_components(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """The ``train`` config, the model's config and the data source, instantiated, with the
    optimizer, its schedule, the profiler and the live monitor's settings built once to check
    them."""
    train = instantiate(cfg.train)
    model_config = instantiate(cfg.model.config)
    source = instantiate(cfg.data)
    check_compatible(source, model_config)
    probe = [torch.zeros(1, requires_grad=True)]
    optimizer = instantiate(cfg.optim.optimizer)(probe)
    instantiate(cfg.optim.scheduler)(optimizer, total_steps=cfg.train.steps)
    if cfg.get("profiler") is not None:
        instantiate(cfg.profiler)(logdir="unused")  # checks the schedule; starts nothing
    if cfg.get("live") is not None:
        instantiate(cfg.live)  # checks live.*
    return train, model_config, source


def _check_topology(topology: DictConfig | None, plan: PlanConfig, world_size: int) -> None:
    """The topology holds the job's ranks and places its sizes (the planner's own refusals)."""
    if topology is None and not plan.trivial:
        raise ValueError(
            "parallel.plan needs a topology to place tp/ep/cp/pp/dp_shard on; use topology=detect "
            "or topology=preset (topology is null)"
        )
    if topology is None or topology.get("_target_") == _DETECT:
        return
    described = instantiate(topology)()
    if described.world_size != world_size:
        raise ValueError(
            f"topology {described.name!r} describes {described.world_size} ranks, but "
            f"launcher.nnodes * launcher.nproc_per_node = {world_size}; choose a preset of "
            "that size (NAMExN for N nodes) or topology=detect"
        )
    place(described, **plan.sizes.placement_sizes(), order=plan.order)


def check_fresh_start(cfg: DictConfig, run_dir: Path) -> None:
    """With ``train.resume=false``, refuse to save checkpoints next to an earlier run's.

    Its newer steps would otherwise survive and be resumed from later, mixed with this run's.

    Raises:
        ValueError: the run directory already holds checkpoints.
    """
    found = latest_checkpoint(RunPaths(run_dir, "").checkpoints)
    if not cfg.train.resume and cfg.train.checkpoint_every > 0 and found is not None:
        raise ValueError(
            f"train.resume=false, but {found[1].parent} holds checkpoints (newest: step "
            f"{found[0]}); resume (train.resume=true), choose another name=..., or remove them"
        )


@hydra.main(config_path="pkg://overlapkit.conf", config_name="config", version_base="1.3")
def run(cfg: DictConfig) -> None:
    """The Hydra task: one launch of the workers (a multirun calls it once per job)."""
    check_missing(cfg)
    launcher: LauncherConfig = instantiate(cfg.launcher)
    expected = node_rank_from_argv(sys.argv[1:])
    if HydraConfig.get().runtime.choices.get("launcher") == "slurm":
        # The node rank comes from SLURM_NODEID; main() must have seen the choice to decide
        # which task keeps Hydra's outputs.
        if _SLURM_CHOICE not in sys.argv[1:]:
            raise ValueError(
                f"{_SLURM_CHOICE} must be given on the command line, not chosen by a recipe or "
                "config file: each Slurm task reads it before Hydra starts to decide whether it "
                "keeps the run's outputs"
            )
    elif launcher.node_rank != expected:
        raise ValueError(
            f"launcher.node_rank={launcher.node_rank} must be given on the command line "
            "(launcher.node_rank=N), so that nodes other than 0 keep no Hydra outputs"
        )
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        cfg = _checked_job(cfg, launcher, run_dir)
    except ValueError as refusal:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        # One line naming the value, not Hydra's traceback of the check that refused it.
        raise SystemExit(f"overlapkit-train: error: {refusal}") from None
    job = OmegaConf.to_container(cfg, resolve=True)
    try:
        launch(job, run_dir, launcher)
    except NoUsableCheckpoint as refusal:
        # One line, no traceback (Hydra would print one): each rank has logged its reasons.
        raise SystemExit(f"overlapkit-train: error: {refusal}") from None
    except ChildFailedError as failure:
        stall = next(
            filter(None, (stall_message(f.message) for f in failure.failures.values())), None
        )
        if stall is None:
            raise
        # The waiting rank named who never arrived; the traceback would add nothing.
        raise SystemExit(f"overlapkit-train: error: {stall}") from None


def _checked_job(cfg: DictConfig, launcher: LauncherConfig, run_dir: Path) -> DictConfig:
    """The job to launch: ``parallel=auto`` resolved to the planner's layout, and every check
    made before a worker starts (each refusal a ValueError naming the value)."""
    if is_auto(cfg.parallel):  # the planner's layout, composed in place of parallel=auto
        hydra_cfg = HydraConfig.get()
        cfg = resolve_auto(
            cfg,
            run_dir=run_dir,
            model=hydra_cfg.runtime.choices.get("model", "model"),
            world_size=launcher.nnodes * launcher.nproc_per_node,
            task_overrides=list(hydra_cfg.overrides.task),
            compose=lambda overrides: hydra.compose(config_name="config", overrides=overrides),
        )
    check_job(cfg, launcher)
    check_fresh_start(cfg, run_dir)
    return cfg


def main() -> None:
    """``overlapkit-train [overrides] [-m]`` once its fork server has started (``entry.main``)."""
    node_rank = process_index(sys.argv[1:])
    if node_rank == 0:
        run()
        return
    scratch = tempfile.mkdtemp(prefix=f"overlapkit-node{node_rank}-")
    sys.argv += [
        f"hydra.run.dir={scratch}",
        f"hydra.sweep.dir={scratch}",
        "hydra.output_subdir=null",
        "hydra/job_logging=stdout",
    ]
    try:
        run()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
