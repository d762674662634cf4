"""A rank slowed by a known amount, for checking straggler analysis on real runs.

Set, in the environment of ``overlapkit-train`` (with ``launcher.worker_init`` naming
``bench.harness.slow_rank:arm`` or ``tests.faults:arm``)::

    OVERLAPKIT_TEST_SLOW=RANK:MS[:MODE]   # e.g. 2:60 or 2:60:compute

and the worker with global rank ``RANK`` spends ``MS`` milliseconds more in the forward pass of
every optimizer step (once per step, before the first forward of the step, on every attempt):

- ``sleep`` (the default): it sleeps, so its compute lane idles: a host gap;
- ``compute``: it multiplies 256 x 256 matrices (``aten::mm``) for that long: longer compute.

Both work through torch's global optimizer and module hooks, so the training loop holds no
test code.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

logger = logging.getLogger(__name__)

SLOW_ENV = "OVERLAPKIT_TEST_SLOW"
"""The environment variable that asks for a slow rank, ``RANK:MS[:MODE]``."""
SLOW_MODES = ("sleep", "compute")
WORKER_INIT = "bench.harness.slow_rank:arm"
"""The ``launcher.worker_init`` entry that arms it."""


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


def busy(seconds: float) -> None:
    """Real compute for ``seconds``: matrix products the profiler records as ``aten::mm``."""
    a = torch.ones(256, 256)
    deadline = time.perf_counter() + seconds
    with torch.no_grad():
        while time.perf_counter() < deadline:
            torch.mm(a, a)


def install_slow_from_env(rank: int) -> bool:
    """Arm the slow rank ``OVERLAPKIT_TEST_SLOW`` asks for, if it names this rank.

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
            (time.sleep if mode == "sleep" else busy)(ms / 1e3)

    register_optimizer_step_post_hook(due_again)
    torch.nn.modules.module.register_module_forward_pre_hook(delay_in_forward)
    return True


def arm(context: Any) -> None:
    """``launcher.worker_init`` entry: slow this worker if ``OVERLAPKIT_TEST_SLOW`` names it."""
    install_slow_from_env(context.rank)
