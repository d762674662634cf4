"""Test-only fault injection for ``overlapkit-train``: SIGKILL one worker in the middle of a step.

The elastic-restart test (``tests/test_elastic_restart.py``) needs a worker to die the way a
crashed host or an out-of-memory kill ends it: at once, without cleanup, mid-step. Set, in the
environment of ``overlapkit-train``::

    OVERLAPKIT_TEST_KILL=RANK:STEP     # e.g. 1:5

and the worker with global rank ``RANK`` kills itself with SIGKILL in the forward pass of the
``STEP``-th optimizer step it runs (counted from 1 in this process; the same as the run's step
when the run starts fresh), on torch elastic's first attempt only (``TORCHELASTIC_RESTART_COUNT``
is 0), so that a restarted worker trains on. Unset (the normal case) nothing is installed.

It works through torch's global optimizer and module hooks, which ``worker_main`` installs
before training, so the training loop holds no test code.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

logger = logging.getLogger(__name__)

KILL_ENV = "OVERLAPKIT_TEST_KILL"
"""The environment variable that asks for the kill, ``RANK:STEP``."""


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


def install_kill_from_env(rank: int) -> bool:
    """Arm the kill ``OVERLAPKIT_TEST_KILL`` asks for, if it names this rank on the first attempt.

    Args:
        rank (int): this worker's global rank.

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
    logger.error("%s=%s: rank %d will SIGKILL itself in step %d", KILL_ENV, spec, rank, kill_step)
    steps_done = 0

    def count_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        nonlocal steps_done
        steps_done += 1

    def kill_in_forward(module: torch.nn.Module, args: Any) -> None:
        if steps_done == kill_step - 1:
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_post_hook(count_step)
    torch.nn.modules.module.register_module_forward_pre_hook(kill_in_forward)
    return True
