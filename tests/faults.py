"""Fault injection for ``overlapkit-train``'s tests, armed through ``launcher.worker_init``.

Pass ``launcher.worker_init=[tests.faults:arm]`` (``WORKER_INIT``; the workers must be able to
import ``tests``: the repository root on ``PYTHONPATH``) and set, in the environment:

- ``OVERLAPKIT_TEST_KILL=RANK:STEP`` (e.g. ``1:5``): the worker with global rank ``RANK`` kills
  itself with SIGKILL in the forward pass of the ``STEP``-th optimizer step it runs (counted from 1
  in this process), on torch elastic's first attempt only, so that a restarted worker trains on:
  a worker dying the way a crashed host or an out-of-memory kill ends it, mid-step, without
  cleanup (``tests/test_elastic_restart.py``).
- ``OVERLAPKIT_TEST_DAMAGE_NEWEST=<run dir>`` as well: the killed worker of the run in that
  directory first overwrites the newest committed checkpoint's ``.metadata`` with a pickle that
  would run code when loaded (it opens ``<run dir>/ran-code-from-a-checkpoint``), as a tampered
  checkpoint would, so that the restart meets a refused newest checkpoint
  (``overlapkit.train.run.resume``).
- ``OVERLAPKIT_TEST_STALL=RANK:STEP``: the worker with global rank ``RANK`` stops (sleeps
  ``STALL_S``) in the forward pass of its ``STEP``-th optimizer step, on the first attempt only:
  a rank stuck before a collective, which the others' stall watchdog names
  (``tests/test_stall_watchdog.py``).
- ``OVERLAPKIT_TEST_SLOW=RANK:MS[:MODE]``: a slowed rank (``bench.harness.slow_rank``).
- ``OVERLAPKIT_TEST_FAULTS_IN=<run dir>``: arm nothing in the workers of any other run (the
  other jobs of a multirun, whose run directories are ``<sweep dir>/<job number>``).

Nothing here ships with overlapkit: a plain install has no module that can damage a checkpoint
(``tests/test_worker_init.py``).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from bench.harness.slow_rank import install_slow_from_env
from overlapkit.train.launch.worker_init import WorkerContext
from overlapkit.train.run.checkpoint import latest_checkpoint
from overlapkit.train.run.loop import RunPaths

logger = logging.getLogger(__name__)

KILL_ENV = "OVERLAPKIT_TEST_KILL"
"""The environment variable that asks for the kill, ``RANK:STEP``."""
DAMAGE_ENV = "OVERLAPKIT_TEST_DAMAGE_NEWEST"
"""A run directory: there the killed worker first damages the newest checkpoint (with
``KILL_ENV`` only)."""
STALL_ENV = "OVERLAPKIT_TEST_STALL"
"""The environment variable that asks for a stuck rank, ``RANK:STEP``."""
STALL_S = 600.0
"""How long the stuck rank sleeps: far past any stall limit a test sets (it is ended first)."""
FAULTS_IN_ENV = "OVERLAPKIT_TEST_FAULTS_IN"
"""A run directory: the only run whose workers ``arm`` arms (unset: every run's)."""
RAN_MARKER = "ran-code-from-a-checkpoint"
"""The file the damaging pickle creates, in the run directory, if anything ever unpickles it."""
WORKER_INIT = "tests.faults:arm"
"""The ``launcher.worker_init`` entry that arms what the environment asks for."""


def parse_kill_spec(spec: str, variable: str = KILL_ENV) -> tuple[int, int]:
    """``RANK:STEP`` (the value of ``variable``) as ``(rank, step)``.

    Raises:
        ValueError: not two ints ``RANK >= 0`` and ``STEP >= 1`` separated by a colon; the
            message names the environment variable and the value.
    """
    rank, sep, step = spec.strip().partition(":")
    if not (sep and rank.isdigit() and step.isdigit() and int(step) >= 1):
        raise ValueError(
            f"{variable} must be RANK:STEP with RANK >= 0 and STEP >= 1 (e.g. 1:5), got {spec!r}"
        )
    return int(rank), int(step)


class _OpensAFile:
    """Unpickling this opens (creates) ``path``: the code a tampered checkpoint would run."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def damage_newest_checkpoint(checkpoints: Path) -> Path | None:
    """Overwrite the newest committed checkpoint's ``.metadata`` with a pickled callable.

    Returns:
        Path | None: the damaged checkpoint; None when there is none.
    """
    newest = latest_checkpoint(checkpoints)
    if newest is None:
        return None
    payload = pickle.dumps(_OpensAFile(checkpoints.parent / RAN_MARKER))
    (newest[1] / ".metadata").write_bytes(payload)
    return newest[1]


def _same_run(configured: str, run_dir: Path) -> bool:
    return Path(configured).resolve() == run_dir.resolve()


def install_kill_from_env(rank: int, attempt: int, run_dir: Path | None = None) -> bool:
    """Arm the kill ``OVERLAPKIT_TEST_KILL`` asks for, if it names this rank on the first attempt.

    Args:
        rank (int): this worker's global rank.
        attempt (int): torch elastic's restart count (the kill strikes on attempt 0 only).
        run_dir (Path | None): the run directory, whose newest checkpoint is damaged when
            ``OVERLAPKIT_TEST_DAMAGE_NEWEST`` names it; None damages nothing.

    Returns:
        bool: whether a kill was armed.
    """
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return False
    kill_rank, kill_step = parse_kill_spec(spec)
    if rank != kill_rank or attempt != 0:
        return False
    damaged_run = os.environ.get(DAMAGE_ENV)
    damage = run_dir is not None and bool(damaged_run) and _same_run(damaged_run, run_dir)
    logger.error(
        "%s=%s: rank %d will SIGKILL itself in step %d%s",
        KILL_ENV,
        spec,
        rank,
        kill_step,
        ", after damaging the newest checkpoint" if damage else "",
    )

    def kill() -> None:
        if damage:
            damage_newest_checkpoint(RunPaths(run_dir, "").checkpoints)
        os.kill(os.getpid(), signal.SIGKILL)

    _in_step(kill_step, kill)
    return True


def _in_step(step: int, fault: Any) -> None:
    """Call ``fault()`` in the first forward pass of this process's ``step``-th optimizer step."""
    steps_done = 0

    def count_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        nonlocal steps_done
        steps_done += 1

    def in_forward(module: torch.nn.Module, args: Any) -> None:
        if steps_done == step - 1:
            fault()

    register_optimizer_step_post_hook(count_step)
    torch.nn.modules.module.register_module_forward_pre_hook(in_forward)


def install_stall_from_env(rank: int, attempt: int) -> bool:
    """Arm the stop ``OVERLAPKIT_TEST_STALL`` asks for, if it names this rank on the first
    attempt; returns whether it was armed."""
    spec = os.environ.get(STALL_ENV)
    if not spec:
        return False
    stall_rank, stall_step = parse_kill_spec(spec, STALL_ENV)
    if rank != stall_rank or attempt != 0:
        return False
    logger.error("%s=%s: rank %d will stop in step %d", STALL_ENV, spec, rank, stall_step)
    _in_step(stall_step, lambda: time.sleep(STALL_S))
    return True


def arm(context: WorkerContext) -> None:
    """``launcher.worker_init`` entry: arm the kill, the stop and the slow rank the environment
    asks for (in the run ``OVERLAPKIT_TEST_FAULTS_IN`` names, if set)."""
    only = os.environ.get(FAULTS_IN_ENV)
    if only and not _same_run(only, context.run_dir):
        return
    install_kill_from_env(context.rank, context.attempt, context.run_dir)
    install_stall_from_env(context.rank, context.attempt)
    install_slow_from_env(context.rank)
