"""Test-only fault injection for ``overlapkit-train``: kill one worker mid-step, or slow one down.

**A killed worker.** The elastic-restart test (``tests/test_elastic_restart.py``) needs a worker
to die the way a crashed host or an out-of-memory kill ends it: at once, without cleanup,
mid-step. Set, in the environment of ``overlapkit-train``::

    OVERLAPKIT_TEST_KILL=RANK:STEP     # e.g. 1:5

and the worker with global rank ``RANK`` kills itself with SIGKILL in the forward pass of the
``STEP``-th optimizer step it runs (counted from 1 in this process; the same as the run's step
when the run starts fresh), on torch elastic's first attempt only (``TORCHELASTIC_RESTART_COUNT``
is 0), so that a restarted worker trains on. Unset (the normal case) nothing is installed.
With ``OVERLAPKIT_TEST_DAMAGE_NEWEST=1`` as well, the worker first overwrites the newest
committed checkpoint's ``.metadata`` with a pickle that would run code when loaded (it opens
``<run dir>/ran-code-from-a-checkpoint``), as a tampered checkpoint would, so that the restart
meets a refused newest checkpoint (``overlapkit.train.resume``).

**A slow rank.** The straggler analysis (``overlapkit report --stragglers``) is checked on real
runs where one rank is slower than the others by a known amount
(``tests/test_stragglers_real.py``)::

    OVERLAPKIT_TEST_SLOW=RANK:MS[:MODE]   # e.g. 2:60 or 2:60:compute

and the worker with global rank ``RANK`` spends ``MS`` milliseconds more in the forward pass of
every optimizer step (once per step, before the first forward of the step, on every attempt):

- ``sleep`` (the default): it sleeps, so its compute lane idles: a host gap;
- ``compute``: it multiplies 256 x 256 matrices (``aten::mm``) for that long: longer compute.

Both work through torch's global optimizer and module hooks, which ``worker_main`` installs
before training, so the training loop holds no test code.
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

from overlapkit.train.checkpoint import latest_checkpoint

logger = logging.getLogger(__name__)

KILL_ENV = "OVERLAPKIT_TEST_KILL"
"""The environment variable that asks for the kill, ``RANK:STEP``."""
SLOW_ENV = "OVERLAPKIT_TEST_SLOW"
"""The environment variable that asks for a slow rank, ``RANK:MS[:MODE]``."""
SLOW_MODES = ("sleep", "compute")
DAMAGE_ENV = "OVERLAPKIT_TEST_DAMAGE_NEWEST"
"""``1``: the killed worker first damages the newest checkpoint (with ``KILL_ENV`` only)."""
RAN_MARKER = "ran-code-from-a-checkpoint"
"""The file the damaging pickle creates, in the run directory, if anything ever unpickles it."""


def parse_kill_spec(spec: str) -> tuple[int, int]:
    """``RANK:STEP`` as ``(rank, step)``.

    Raises:
        ValueError: not two ints ``RANK >= 0`` and ``STEP >= 1`` separated by a colon; the
            message names the environment variable and the value.
    """
    rank, sep, step = spec.strip().partition(":")
    if not (sep and rank.isdigit() and step.isdigit() and int(step) >= 1):
        raise ValueError(
            f"{KILL_ENV} must be RANK:STEP with RANK >= 0 and STEP >= 1 (e.g. 1:5), got {spec!r}"
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


def install_kill_from_env(rank: int, checkpoints: Path | None = None) -> bool:
    """Arm the kill ``OVERLAPKIT_TEST_KILL`` asks for, if it names this rank on the first attempt.

    Args:
        rank (int): this worker's global rank.
        checkpoints (Path | None): the run's checkpoint directory, which
            ``OVERLAPKIT_TEST_DAMAGE_NEWEST=1`` damages; None damages nothing.

    Returns:
        bool: whether a kill was armed.
    """
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return False
    kill_rank, kill_step = parse_kill_spec(spec)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank != kill_rank or attempt != 0:
        return False
    damage = checkpoints is not None and os.environ.get(DAMAGE_ENV) == "1"
    logger.error(
        "%s=%s: rank %d will SIGKILL itself in step %d%s",
        KILL_ENV,
        spec,
        rank,
        kill_step,
        ", after damaging the newest checkpoint" if damage else "",
    )
    steps_done = 0

    def count_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        nonlocal steps_done
        steps_done += 1

    def kill_in_forward(module: torch.nn.Module, args: Any) -> None:
        if steps_done == kill_step - 1:
            if damage:
                damage_newest_checkpoint(checkpoints)
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_post_hook(count_step)
    torch.nn.modules.module.register_module_forward_pre_hook(kill_in_forward)
    return True


def parse_slow_spec(spec: str) -> tuple[int, float, str]:
    """``RANK:MS[:MODE]`` as ``(rank, ms, mode)``.

    Raises:
        ValueError: not a rank >= 0, a number of ms > 0 and a mode in ``SLOW_MODES``,
            separated by colons; the message names the environment variable and the value.
    """
    parts = spec.strip().split(":")
    mode = parts[2] if len(parts) == 3 else "sleep"
    try:
        rank, ms = int(parts[0]), float(parts[1])
        valid = len(parts) in (2, 3) and rank >= 0 and ms > 0 and mode in SLOW_MODES
    except (ValueError, IndexError):
        valid = False
    if not valid:
        raise ValueError(
            f"{SLOW_ENV} must be RANK:MS[:MODE] with RANK >= 0, MS > 0 and MODE one of "
            f"{', '.join(SLOW_MODES)} (e.g. 2:60 or 2:60:compute), got {spec!r}"
        )
    return rank, ms, mode


def _busy(seconds: float) -> None:
    """Real compute for ``seconds``: matrix products the profiler records as ``aten::mm``."""
    a = torch.ones(256, 256)
    deadline = time.perf_counter() + seconds
    with torch.no_grad():
        while time.perf_counter() < deadline:
            torch.mm(a, a)


def install_slow_from_env(rank: int) -> bool:
    """Arm the slow rank ``OVERLAPKIT_TEST_SLOW`` asks for, if it names this rank.

    Args:
        rank (int): this worker's global rank.

    Returns:
        bool: whether this rank was slowed.
    """
    spec = os.environ.get(SLOW_ENV)
    if not spec:
        return False
    slow_rank, ms, mode = parse_slow_spec(spec)
    if rank != slow_rank:
        return False
    logger.error("%s=%s: rank %d spends %.1f ms more (%s) per step", SLOW_ENV, spec, rank, ms, mode)
    pending = [True]  # a delay is due before the next forward

    def due_again(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        pending[0] = True

    def delay_in_forward(module: torch.nn.Module, args: Any) -> None:
        if pending[0]:
            pending[0] = False
            (time.sleep if mode == "sleep" else _busy)(ms / 1e3)

    register_optimizer_step_post_hook(due_again)
    torch.nn.modules.module.register_module_forward_pre_hook(delay_in_forward)
    return True
