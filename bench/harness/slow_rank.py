"""A rank slowed by a known amount, for checking straggler analysis on real runs.

Set, in the environment of ``overlapkit-train`` (with ``launcher.worker_init`` naming
``bench.harness.slow_rank:arm`` or ``tests.faults:arm``)::

    OVERLAPKIT_TEST_SLOW=RANK:MS[:MODE[:FROM[:TO]]][,...]   # e.g. 2:60, 2:60:data:40:80

and the worker with global rank ``RANK`` spends ``MS`` milliseconds more in every optimizer
step (once per step, on every attempt) from its ``FROM``-th step to its ``TO``-th (counted from
1 in this process; default: from the first, to the end); several specs, separated by commas,
slow ranks one after another (or together):

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
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

logger = logging.getLogger(__name__)

SLOW_ENV = "OVERLAPKIT_TEST_SLOW"
"""The environment variable that asks for slow ranks, ``RANK:MS[:MODE[:FROM[:TO]]][,...]``."""
SLOW_MODES = ("sleep", "compute", "data")
WORKER_INIT = "bench.harness.slow_rank:arm"
"""The ``launcher.worker_init`` entry that arms it."""


@dataclass(frozen=True, slots=True)
class SlowSpec:
    """One slowed rank: ``ms`` more per step by ``mode`` in its steps ``from_step..to_step``."""

    rank: int
    ms: float
    mode: str = "sleep"
    from_step: int = 1
    to_step: int | None = None
    """The last slowed step; None: to the end."""

    def slows(self, step: int) -> bool:
        return self.from_step <= step and (self.to_step is None or step <= self.to_step)


def parse_slow_spec(spec: str) -> list[SlowSpec]:
    """``RANK:MS[:MODE[:FROM[:TO]]][,...]`` as one ``SlowSpec`` per comma-separated part.

    Raises:
        ValueError: a part is not a rank >= 0, a number of ms > 0, a mode in ``SLOW_MODES``
            and steps 1 <= FROM <= TO, separated by colons; the message names the environment
            variable and the value.
    """
    return [_parse_one(part, spec) for part in spec.strip().split(",")]


def _parse_one(part: str, spec: str) -> SlowSpec:
    parts = part.strip().split(":")
    try:
        valid = 2 <= len(parts) <= 5
        steps = [int(p) for p in parts[3:]]
        slow = SlowSpec(int(parts[0]), float(parts[1]), *parts[2:3], *steps)
        valid = valid and slow.rank >= 0 and slow.ms > 0 and slow.mode in SLOW_MODES
        last = slow.from_step if slow.to_step is None else slow.to_step
        valid = valid and 1 <= slow.from_step <= last
    except (ValueError, IndexError, TypeError):
        valid = False
    if not valid:
        raise ValueError(
            f"{SLOW_ENV} must be RANK:MS[:MODE[:FROM[:TO]]][,...] with RANK >= 0, MS > 0, MODE "
            f"one of {', '.join(SLOW_MODES)} and 1 <= FROM <= TO (e.g. 2:60, 2:60:compute or "
            f"2:60:data:40:80), got {spec!r}"
        )
    return slow


def busy(seconds: float) -> None:
    """Real compute for ``seconds``: matrix products the profiler records as ``aten::mm``."""
    a = torch.ones(256, 256)
    deadline = time.perf_counter() + seconds
    with torch.no_grad():
        while time.perf_counter() < deadline:
            torch.mm(a, a)


def install_slow_from_env(rank: int) -> bool:
    """Arm the slow steps ``OVERLAPKIT_TEST_SLOW`` asks for, where they name this rank.

    Returns:
        bool: whether this rank was slowed.
    """
    spec = os.environ.get(SLOW_ENV)
    if not spec:
        return False
    mine = [slow for slow in parse_slow_spec(spec) if slow.rank == rank]
    for slow in mine:
        logger.error(
            "%s=%s: rank %d spends %.1f ms more (%s) per step",
            SLOW_ENV,
            spec,
            rank,
            slow.ms,
            slow.mode,
        )
        _arm(slow)
    return bool(mine)


def _arm(slow: SlowSpec) -> None:
    state = {"step": 1, "pending": slow.slows(1)}  # a delay is due in the step that runs now

    def due_again(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        state["step"] += 1
        state["pending"] = slow.slows(state["step"])

    def delay() -> None:
        if state["pending"]:
            state["pending"] = False
            (busy if slow.mode == "compute" else time.sleep)(slow.ms / 1e3)

    register_optimizer_step_post_hook(due_again)
    if slow.mode == "data":
        _delay_batches(delay)
    else:
        torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: delay())


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
