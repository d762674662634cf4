"""Start the training workers through torch elastic (torchrun's machinery), one per local rank.

``launch()`` runs in the process Hydra started; it builds a ``LaunchConfig`` from the ``launcher``
group and calls ``elastic_launch`` with ``worker_main``, which torch elastic starts
``nproc_per_node`` times (forked from ``overlapkit.workers.forkserver``'s server) with torchrun's
environment (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``MASTER_ADDR``...). A single node uses the
c10d rendezvous on a free local port, as ``torchrun --standalone`` does. Several nodes use the
static rendezvous, as ``torchrun --nnodes N --node-rank R --master-addr A --master-port P`` does:
node ``node_rank`` 0 hosts the store at ``rdzv_endpoint`` and ranks are numbered node by node. When
an outside launcher starts one process per rank (``launcher=slurm`` with several tasks per node, see
``slurm.py``), ``launcher.local_rank`` is set and the process runs ``worker_main`` itself.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from overlapkit.group.stall_watchdog import (
    STALL_EXIT_CODE,
    StallWatchdog,
    enable_flight_recorder,
)
from overlapkit.train.launch.worker_init import WorkerContext, run_worker_init
from overlapkit.train.run.loop import RunPaths, resolve_device, train
from overlapkit.train.run.resume import NoUsableCheckpoint
from overlapkit.validation import check_int, is_finite_number
from overlapkit.workers.forkserver import ParentState, context

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class LauncherConfig:
    """The ``launcher`` config group."""

    nproc_per_node: int = 2
    """Worker processes (ranks) on this node."""
    nnodes: int = 1
    """Nodes in the job; each runs the same command with its own ``node_rank``."""
    node_rank: int = 0
    """This node's index, 0 .. nnodes - 1; node 0 hosts the rendezvous and rank 0."""
    rdzv_endpoint: str | None = None
    """``HOST:PORT`` of node 0, reachable from every node; None on a single node (a free
    local port is used)."""
    rdzv_id: str = "overlapkit"
    """Names the job in the rendezvous; the same on every node."""
    rdzv_timeout_s: int = 300
    """How long a node waits for the others to join, s."""
    max_restarts: int = 0
    """How often torch elastic restarts the workers after one of them fails (all of them
    restart); with ``train.resume=true`` they resume from the newest complete checkpoint, so a
    restart loses only the steps after it."""
    collective_timeout_s: float = 300.0
    """Timeout of every collective of the process group, s."""
    stall_limit_s: float | None = None
    """Seconds of no progress (no step finished, no collective issued or completed) after
    which the ranks waiting name the rank(s) that never arrived and end the run
    (``overlapkit.group.stall_watchdog``). None: 10 x the slowest step (the first excluded), at
    least 60 s, at most half of ``collective_timeout_s``; 0: off."""
    threads_per_rank: int | None = None
    """torch intra-op threads per worker; None divides this machine's cores among them."""
    local_rank: int | None = None
    """Set when an outside launcher started one process per rank (``launcher=slurm`` with
    several tasks per node): this process is the worker with this local rank and joins the
    group itself, as rank ``node_rank * nproc_per_node + local_rank``; torch elastic is not
    used. None: torch elastic starts the ``nproc_per_node`` workers."""
    worker_init: list[str] = field(default_factory=list)
    """Functions (``module:function``) every worker calls with a ``WorkerContext`` before it
    joins the process group (``overlapkit.train.launch.worker_init``)."""

    def __post_init__(self) -> None:
        self.worker_init = [str(spec) for spec in self.worker_init]
        check_int("launcher.nproc_per_node", self.nproc_per_node, 1)
        check_int("launcher.nnodes", self.nnodes, 1)
        check_int("launcher.node_rank", self.node_rank, 0)
        check_int("launcher.rdzv_timeout_s", self.rdzv_timeout_s, 1)
        check_int("launcher.max_restarts", self.max_restarts, 0)
        if self.threads_per_rank is not None:
            check_int("launcher.threads_per_rank", self.threads_per_rank, 1)
        if not self.collective_timeout_s > 0 or not is_finite_number(self.collective_timeout_s):
            raise ValueError(
                "launcher.collective_timeout_s must be a finite number > 0 s, got "
                f"{self.collective_timeout_s!r}"
            )
        if self.stall_limit_s is not None and not (
            is_finite_number(self.stall_limit_s)
            and (self.stall_limit_s == 0 or 0 < self.stall_limit_s < self.collective_timeout_s)
        ):
            raise ValueError(
                "launcher.stall_limit_s must be null (chosen from the step time), 0 (off) or a "
                f"number of seconds below launcher.collective_timeout_s "
                f"({self.collective_timeout_s:g}), got {self.stall_limit_s!r}"
            )
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"launcher.node_rank ({self.node_rank}) must be < launcher.nnodes ({self.nnodes})"
            )
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(
                f"launcher.nnodes={self.nnodes} needs launcher.rdzv_endpoint=HOST:PORT (node 0's "
                "address, reachable from every node)"
            )
        if self.local_rank is not None:
            check_int("launcher.local_rank", self.local_rank, 0)
            if self.local_rank >= self.nproc_per_node or self.rdzv_endpoint is None:
                raise ValueError(
                    f"launcher.local_rank ({self.local_rank}) needs launcher.rdzv_endpoint and "
                    f"must be < launcher.nproc_per_node ({self.nproc_per_node})"
                )
            if self.max_restarts:
                raise ValueError(
                    f"launcher.max_restarts={self.max_restarts} needs torch elastic, which does "
                    "not run with one process per rank; run one Slurm task per node "
                    "(--ntasks-per-node=1), or let Slurm restart the job (sbatch --requeue)"
                )
        if self.rdzv_endpoint is not None:
            host, _, port = str(self.rdzv_endpoint).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"launcher.rdzv_endpoint must be HOST:PORT with a port in 1..65535, got "
                    f"{self.rdzv_endpoint!r}"
                )

    @property
    def standalone(self) -> bool:
        """One node and no endpoint: rendezvous on a free port of this machine."""
        return self.nnodes == 1 and self.rdzv_endpoint is None

    def threads(self) -> int:
        """Intra-op threads per worker."""
        if self.threads_per_rank is not None:
            return self.threads_per_rank
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return max(1, (cores or 1) // self.nproc_per_node)

    def launch_config(self, log_dir: str | Path) -> LaunchConfig:
        """torch elastic's ``LaunchConfig`` for this node; its error files go to ``log_dir``."""
        common = dict(
            min_nodes=self.nnodes,
            max_nodes=self.nnodes,
            nproc_per_node=self.nproc_per_node,
            max_restarts=self.max_restarts,
            start_method="forkserver",  # see overlapkit.workers.forkserver
            logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
        )
        if self.standalone:
            return LaunchConfig(
                rdzv_backend="c10d",
                rdzv_endpoint="localhost:0",
                run_id=str(uuid.uuid4()),
                rdzv_configs={"timeout": self.rdzv_timeout_s},
                **common,
            )
        return LaunchConfig(
            rdzv_backend="static",
            rdzv_endpoint=self.rdzv_endpoint,
            run_id=self.rdzv_id,
            rdzv_configs={"rank": self.node_rank, "timeout": self.rdzv_timeout_s},
            **common,
        )


def _setup_worker_logging(rank: int) -> None:
    # Rank 0 tells the story (torchtitan's default, too); the others speak up only for errors.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank{rank}] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.ERROR)


@record
def worker_main(
    job: dict[str, Any],
    run_dir: str,
    threads: int,
    collective_timeout_s: float,
    worker_init: Sequence[str] = (),
    stall_limit_s: float | None = None,
    parent: ParentState | None = None,
) -> dict[str, Any] | NoUsableCheckpoint | None:
    """One rank: join the process group, agree on rank 0's run directory, train.

    Started by torch elastic with torchrun's environment (forked from the server of
    ``overlapkit.workers.forkserver``, so it first adopts the launching process's environment);
    returns rank 0's summary as a dict. When no checkpoint can be resumed from, every rank
    returns the ``NoUsableCheckpoint`` instead of raising it: a failed worker would be restarted
    into the same refusal (``launcher.max_restarts``) and each attempt print its traceback.
    Unless ``stall_limit_s`` is 0, a ``StallWatchdog`` watches the training steps.
    """
    if parent is not None:
        parent.adopt()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    _setup_worker_logging(rank)
    # Kineto prints "USDT: ... profiler_start" (and _stop) to stderr whenever a profiling cycle
    # starts or ends, on every rank, into the progress bar's line. KINETO_LOG_LEVEL, read when
    # the profiler first starts, is torch's only switch; USDT is Kineto's highest level, so 6
    # also hides its ERROR lines (a rank that saved no trace is still reported by ok.profile).
    # A level the user set wins.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    context = WorkerContext(
        rank=rank,
        local_rank=local_rank,
        world_size=int(os.environ["WORLD_SIZE"]),
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        run_dir=Path(run_dir),
    )
    run_worker_init(worker_init, context)
    torch.set_num_threads(threads)
    device = resolve_device(job["train"]["device"], local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if stall_limit_s != 0:
        enable_flight_recorder()  # before the first group: torch reads it once
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=timedelta(seconds=collective_timeout_s),
    )
    stall = None
    if stall_limit_s != 0:
        stall = StallWatchdog(stall_limit_s, collective_timeout_s=collective_timeout_s).start()
    try:
        # Other nodes run Hydra in a scratch directory; everything goes to node 0's.
        shared = [run_dir, datetime.now().strftime("%Y%m%d-%H%M%S")]
        dist.broadcast_object_list(shared, src=0)
        try:
            summary = train(
                OmegaConf.create(job),
                RunPaths(Path(shared[0]), shared[1]),
                local_rank=local_rank,
                stall=stall,
            )
        except NoUsableCheckpoint as refusal:  # each rank has logged its reasons
            return refusal
        return asdict(summary) if summary is not None else None
    finally:
        if stall is not None:
            stall.close()
        # Wrappers left in reference cycles (torch's DDP is one) are freed now, while the group
        # is still registered: freed after it, DDP's reducer destroys the gloo group holding the
        # GIL, which can deadlock with a gloo thread finishing its last work item (torch 2.13).
        gc.collect()
        dist.destroy_process_group()


@contextlib.contextmanager
def _fresh_store_per_restart(launcher: LauncherConfig) -> Iterator[None]:
    """With restarts, give each attempt's workers a new store instead of the agent's shared one.

    torch elastic's c10d rendezvous lends its agent's TCPStore to the workers by default, and
    keeps the same one across restarts; the restarted workers then find the keys the killed
    attempt wrote (gloo's and NCCL's peer addresses under the same names) and connect to ports
    that are gone: "Gloo connectFullMesh failed ... Connection refused"
    (pytorch/pytorch#135712; seen with torch 2.13). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
    torch's own opt-out, makes each rendezvous round publish a fresh port on which rank 0 hosts
    a new store. It is read by the agent in this process, so it is set only for the launch.
    """
    name = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    if launcher.max_restarts == 0:
        yield
        return
    saved = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


_launch_numbers = itertools.count()
_NODE_EXIT_TIMEOUT_S = 30.0


@contextlib.contextmanager
def _hold_store_until_nodes_leave(launcher: LauncherConfig) -> Iterator[None]:
    """Keep node 0's rendezvous store up until the other nodes are past torch elastic's exit.

    torch elastic's exit barrier races with the store's host: the last node to arrive can still
    be waiting on the store when node 0 has seen the barrier complete and closed it, and then
    logs a "Failed to recv" traceback although the job succeeded (pytorch/pytorch#69520). Node 0
    therefore also opens the store's port (``multi_tenant``: the rendezvous shares this server)
    and keeps it until every other node has checked in after its launch returned.
    """
    if launcher.nnodes == 1:
        yield
        return
    host, _, port = str(launcher.rdzv_endpoint).rpartition(":")
    # Every node runs the same sequence of launches (a multirun), so the numbers agree.
    prefix = f"overlapkit/{launcher.rdzv_id}/launch{next(_launch_numbers)}/left"
    timeout = timedelta(seconds=_NODE_EXIT_TIMEOUT_S)
    if launcher.node_rank != 0:
        try:
            yield
        finally:
            with contextlib.suppress(Exception):  # node 0 gone: nobody is waiting
                store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
                store.set(f"{prefix}/{launcher.node_rank}", "1")
        return
    store = dist.TCPStore(
        host,
        int(port),
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=launcher.rdzv_timeout_s),
    )
    yield
    try:
        store.wait([f"{prefix}/{node}" for node in range(1, launcher.nnodes)], timeout)
    except Exception as err:  # the job is done; a missing check-in only costs log noise
        logger.warning("not every node checked in after the launch: %s", err)


def _run_here(job: dict[str, Any], run_dir: Path, launcher: LauncherConfig) -> dict | None:
    """Be one worker: this process was started per rank (by srun), so it joins the group itself.

    It gets the environment torchrun gives its workers, which ``init_process_group``'s ``env://``
    rendezvous and topology detection read; rank 0 hosts the store at ``rdzv_endpoint``.
    """
    assert launcher.local_rank is not None
    host, _, port = str(launcher.rdzv_endpoint).rpartition(":")
    rank = launcher.node_rank * launcher.nproc_per_node + launcher.local_rank
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(launcher.local_rank),
        GROUP_RANK=str(launcher.node_rank),
        WORLD_SIZE=str(launcher.nnodes * launcher.nproc_per_node),
        LOCAL_WORLD_SIZE=str(launcher.nproc_per_node),
        MASTER_ADDR=host,
        MASTER_PORT=port,
    )
    logger.info(
        "worker %d of %d (node %d of %d), rendezvous at %s",
        rank,
        launcher.nnodes * launcher.nproc_per_node,
        launcher.node_rank,
        launcher.nnodes,
        launcher.rdzv_endpoint,
    )
    summary = worker_main(
        job,
        str(run_dir),
        launcher.threads(),
        float(launcher.collective_timeout_s),
        launcher.worker_init,
        launcher.stall_limit_s,
    )
    if isinstance(summary, NoUsableCheckpoint):
        raise summary
    return summary if rank == 0 else None


_WORKER_FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _StallExitFilter(logging.Filter):
    """Drops torch elastic's traceback of a worker that a stall ended (its own exit, with
    ``STALL_EXIT_CODE``): the stall's one line says what happened."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(f"failed (exitcode: {STALL_EXIT_CODE})")


def launch(job: dict[str, Any], run_dir: Path, launcher: LauncherConfig) -> dict[str, Any] | None:
    """Run the job's workers on this node and wait for them; with ``launcher.local_rank``, be
    that worker in this process.

    Args:
        job (dict): the resolved config (plain containers: it is pickled to the workers).
        run_dir (Path): this node's Hydra output directory (node 0's is the run's).
        launcher (LauncherConfig): how many workers, and how nodes meet.

    Returns:
        dict | None: rank 0's summary on node 0; None on the other nodes.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a worker failed; the
            message holds its traceback.
        NoUsableCheckpoint: the run has checkpoints, and every rank refused each of them.
    """
    # torch elastic logs its whole launch configuration at INFO; keep the console for training.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    worker_failures = logging.getLogger(_WORKER_FAILURE_LOGGER)
    if not any(isinstance(f, _StallExitFilter) for f in worker_failures.filters):
        worker_failures.addFilter(_StallExitFilter())
    run_dir.mkdir(parents=True, exist_ok=True)
    if launcher.local_rank is not None:
        return _run_here(job, run_dir, launcher)
    # torch elastic's per-rank error files are read into the exception when a worker fails;
    # afterwards they are of no use, so they live in a directory that goes away.
    with tempfile.TemporaryDirectory(prefix="overlapkit-elastic-") as log_dir:
        config = launcher.launch_config(log_dir=log_dir)
        logger.info(
            "launching %d worker(s) on node %d of %d (%s rendezvous at %s)",
            launcher.nproc_per_node,
            launcher.node_rank,
            launcher.nnodes,
            config.rdzv_backend,
            launcher.rdzv_endpoint or "a free local port",
        )
        context()  # the forkserver torch elastic starts the workers from preloads overlapkit
        with _hold_store_until_nodes_leave(launcher), _fresh_store_per_restart(launcher):
            results = elastic_launch(config, worker_main)(
                job,
                str(run_dir),
                launcher.threads(),
                float(launcher.collective_timeout_s),
                launcher.worker_init,
                launcher.stall_limit_s,
                ParentState.capture(),
            )
    for result in results.values():
        if isinstance(result, NoUsableCheckpoint):
            raise result
    return results.get(0)
