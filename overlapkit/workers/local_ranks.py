"""Run a function on N local gloo ranks in worker processes (tests, benchmarks, doctor).

``run_on_ranks(fn, world_size=2)`` starts ``world_size`` processes, joins them into a gloo process
group whose collectives time out after ``collective_timeout_s`` seconds, calls
``fn(rank, world_size, *args)`` on each and returns the per-rank results (rank order).

It never hangs: the parent owns the rendezvous store (no free-port race), watches every child,
and when one fails or dies it gives the others one collective timeout to notice and then kills
them. A failure raises ``RankFailure`` whose message carries each failing rank's traceback or
exit status, so a test shows the child's error, not a bare "process exited".

``fn`` and its arguments must be picklable (a module-level function). The workers are forked from
a server that has imported torch (``overlapkit.workers.forkserver``) and take the parent's
environment, working directory and ``sys.path`` of the moment of the call, as spawned ones would.
"""

from __future__ import annotations

import gc
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from overlapkit.workers.forkserver import ParentState, context

DEFAULT_COLLECTIVE_TIMEOUT_S = 10.0
DEFAULT_TOTAL_TIMEOUT_S = 120.0


class RankFailure(RuntimeError):
    """One or more ranks raised, died or timed out; the message holds their tracebacks.

    A RuntimeError, not an AssertionError: callers outside tests (``overlapkit doctor``,
    ``overlapkit calibrate``) see a failed run, not a failed assertion.

    Attributes:
        results (dict[int, Any]): return values of the ranks that finished, by rank, so a test
            can read what the survivors of a dead rank saw.
        errors (dict[int, str]): traceback text of each rank that raised, by rank.
    """

    def __init__(
        self,
        message: str,
        results: dict[int, Any] | None = None,
        errors: dict[int, str] | None = None,
    ):
        super().__init__(message)
        self.results = results or {}
        self.errors = errors or {}


def _child(
    rank: int,
    world_size: int,
    store_port: int,
    collective_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    parent: ParentState,
    env: dict[str, str],
    threads_per_rank: int,
    results: mp.Queue,
    backend: str = "gloo",
) -> None:
    parent.adopt()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
    )
    torch.set_num_threads(threads_per_rank)
    timeout = timedelta(seconds=collective_timeout_s)
    try:
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        value = fn(rank, world_size, *args)
        # Pickled by value here: tensors sent through a torch queue are shared through file
        # descriptors that vanish when this process exits before the parent reads them.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # report everything, including KeyboardInterrupt-like exits
        results.put((rank, "error", traceback.format_exc()))
    finally:
        # Free what ``fn`` left in reference cycles (a DDP reducer, comm hook state) while the
        # group still exists: destroyed after it, a reducer can abort the process at exit.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    total_timeout_s: float = DEFAULT_TOTAL_TIMEOUT_S,
    env: dict[str, str] | None = None,
    threads_per_rank: int = 1,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks and return their results.

    Args:
        fn (Callable): module-level function; its return value must be picklable.
        world_size (int): number of ranks (processes). Defaults to 2.
        collective_timeout_s (float): gloo collective timeout in seconds. Defaults to 10.
        total_timeout_s (float): wall-clock limit for the whole run in seconds. Defaults to 120.
        env (dict): extra environment variables for the children.
        threads_per_rank (int): torch intra-op threads per rank. Defaults to 1, so that ranks
            sharing a few cores do not oversubscribe them.
        backend (str): the process group's backend. Defaults to ``"gloo"``; ``"nccl"`` for
            GPU benchmarks (``fn`` then picks its device before its first collective).

    Returns:
        list: ``fn``'s return value per rank, in rank order.

    Raises:
        RankFailure: a rank raised, exited without a result, or the run exceeded its time.
    """
    ctx = context()
    timeout = timedelta(seconds=collective_timeout_s)
    # The parent holds the store, so the port is bound before any child needs it.
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
    )
    results: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(
                rank,
                world_size,
                store.port,
                collective_timeout_s,
                fn,
                args,
                ParentState.capture(),
                env or {},
                threads_per_rank,
                results,
                backend,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        outcomes = _collect(results, procs, total_timeout_s, collective_timeout_s)
    finally:
        killed = _stop(procs)
        del store
    failures = _failures(procs, outcomes, killed)
    if failures:
        raise RankFailure(
            "\n".join(failures),
            results={r: pickle.loads(v) for r, (st, v) in outcomes.items() if st == "ok"},
            errors={r: v for r, (st, v) in outcomes.items() if st == "error"},
        )
    return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]


FAILURE_GRACE_S = 5.0
"""After a rank fails, the others get one collective timeout plus this long to report: the time
to notice a dead peer, unwind and send their own failure through the queue."""
RESULT_DELAY_S = 1.0
"""A process found dead gets this long for a result it sent to arrive through the queue before
it is judged to have died without one."""
POLL_S = 0.1
"""How often the parent looks for results and dead processes."""


def _collect(
    results: mp.Queue,
    procs: list[mp.Process],
    total_timeout_s: float,
    collective_timeout_s: float,
) -> dict[int, tuple[str, Any]]:
    """Per rank that reported, its ``("ok", pickled value)`` or ``("error", traceback)``.

    Returns once every rank reported, the run is past ``total_timeout_s``, a failure is older
    than a collective timeout (plus ``FAILURE_GRACE_S``), or every rank either reported or died.
    """
    world_size = len(procs)
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + total_timeout_s
    first_failure_at: float | None = None
    while len(outcomes) < world_size:
        now = time.monotonic()
        if now > deadline:
            break
        grace = collective_timeout_s + FAILURE_GRACE_S
        if first_failure_at is not None and now > first_failure_at + grace:
            break
        try:
            rank, status, value = results.get(timeout=POLL_S)
            outcomes[rank] = (status, value)
            if status == "error" and first_failure_at is None:
                first_failure_at = time.monotonic()
            continue
        except queue.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if r not in outcomes and not p.is_alive()]
        if dead and first_failure_at is None:
            first_failure_at = time.monotonic()
        if (
            dead
            and len(outcomes) + len(dead) == world_size
            and now > first_failure_at + RESULT_DELAY_S
        ):
            break  # everyone else has reported: nothing more can arrive
    return outcomes


def _stop(procs: list[mp.Process]) -> set[int]:
    """Kill the ranks still running and reap every process; the ranks killed."""
    killed = set()
    for rank, proc in enumerate(procs):
        if proc.is_alive():
            proc.kill()
            killed.add(rank)
        proc.join(timeout=5)
    return killed


def _failures(
    procs: list[mp.Process], outcomes: dict[int, tuple[str, Any]], killed: set[int]
) -> list[str]:
    """One section per failed rank: its traceback, or why it returned nothing."""
    failures = []
    for rank, proc in enumerate(procs):
        status, value = outcomes.get(rank, (None, None))
        if status == "error":
            failures.append(f"--- rank {rank} raised ---\n{value}")
        elif status is None:
            if rank in killed or proc.exitcode is None:
                why = "no result before the time limit (killed)"
            elif proc.exitcode < 0:
                why = f"killed by signal {-proc.exitcode}"
            else:
                why = f"exit code {proc.exitcode}"
            failures.append(f"--- rank {rank} returned nothing: {why} ---")
    return failures
