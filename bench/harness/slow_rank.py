"""A rank slowed by a known amount, for checking straggler analysis on real runs.

Set, in the environment of ``overlapkit-train`` (with ``launcher.worker_init`` naming
``bench.harness.slow_rank:arm`` or ``tests.faults:arm``)::

    OVERLAPKIT_TEST_SLOW=RANK:MS[:MODE[:FROM]]   # e.g. 2:60, 2:60:compute or 2:60:data:40

and the worker with global rank ``RANK`` spends ``MS`` milliseconds more in every optimizer
step (once per step, on every attempt), from its ``FROM``-th step on (counted from 1 in this
process; default 1):

- ``sleep`` (the default): it sleeps before the step's first forward, so its compute lane
  idles: a host gap;
- ``compute``: it multiplies 256 x 256 matrices (``aten::mm``) for that long, before the first
  forward: longer compute;
- ``data``: its first batch of the step comes that much later (``BatchStream.next`` sleeps):
  slow data loading.

All work through torch's global optimizer and module hooks (``data``: a wrapped
``BatchStream.next``), so the training loop holds no test code.
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
SLOW_MODES = ("sleep", "compute", "data")
WORKER_INIT = "bench.harness.slow_rank:arm"
"""The ``launcher.worker_init`` entry that arms it."""


def parse_slow_spec(spec: str) -> tuple[int, float, str, int]:
    """``RANK:MS[:MODE[:FROM]]`` as ``(rank, ms, mode, from_step)``.

    Raises:
        ValueError: not a rank >= 0, a number of ms > 0, a mode in ``SLOW_MODES`` and a step
            >= 1, separated by colons; the message names the environment variable and the value.
    """
    parts = spec.strip().split(":")
    mode = parts[2] if len(parts) >= 3 else "sleep"
    try:
        rank, ms = int(parts[0]), float(parts[1])
        from_step = int(parts[3]) if len(parts) == 4 else 1
        valid = 2 <= len(parts) <= 4 and rank >= 0 and ms > 0 and mode in SLOW_MODES
        valid = valid and from_step >= 1
    except (ValueError, IndexError):
        valid = False
    if not valid:
        raise ValueError(
            f"{SLOW_ENV} must be RANK:MS[:MODE[:FROM]] with RANK >= 0, MS > 0, MODE one of "
            f"{', '.join(SLOW_MODES)} and FROM >= 1 (e.g. 2:60, 2:60:compute or 2:60:data:40), "
            f"got {spec!r}"
        )
    return rank, ms, mode, from_step


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
    slow_rank, ms, mode, from_step = parse_slow_spec(spec)
    if rank != slow_rank:
        return False
    logger.error("%s=%s: rank %d spends %.1f ms more (%s) per step", SLOW_ENV, spec, rank, ms, mode)
    state = {"pending": from_step == 1, "step": 1}  # a delay is due in the step that runs now

    def due_again(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        state["step"] += 1
        state["pending"] = state["step"] >= from_step

    def delay() -> None:
        if state["pending"]:
            state["pending"] = False
            (busy if mode == "compute" else time.sleep)(ms / 1e3)

    register_optimizer_step_post_hook(due_again)
    if mode == "data":
        _delay_batches(delay)
    else:
        torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: delay())
    return True


def _delay_batches(delay: Any) -> None:
    """Call ``delay`` before every batch ``overlapkit-train`` reads (it delays once per step)."""
    from overlapkit.train.run.data import BatchStream

    read = BatchStream.next

    def next_late(self: BatchStream) -> Any:
        delay()
        return read(self)

    BatchStream.next = next_late


def arm(context: Any) -> None:
    """``launcher.worker_init`` entry: slow this worker if ``OVERLAPKIT_TEST_SLOW`` names it."""
    install_slow_from_env(context.rank)
