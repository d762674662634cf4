"""Learning-rate schedule: linear warm-up, then cosine decay to a floor (as nanoGPT's ``get_lr``).

``warmup_cosine_factor`` is the pure function (tested without an optimizer); ``warmup_cosine``
wraps it in a ``LambdaLR`` whose ``state_dict`` the checkpoint saves.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

logger = logging.getLogger(__name__)


def warmup_cosine_factor(
    step: int, *, total_steps: int, warmup_steps: int, min_lr_ratio: float
) -> float:
    """The multiplier of the base learning rate for the optimizer step with index ``step``.

    Steps are counted from 0. Warm-up steps ``0 .. warmup_steps - 1`` ramp linearly up to 1 (the
    last warm-up step runs at the full rate); then the factor follows half a cosine from 1 at
    ``warmup_steps`` towards ``min_lr_ratio`` at ``total_steps``, and stays there after it.

    Args:
        step (int): optimizer step index, >= 0.
        total_steps (int): steps of the whole run.
        warmup_steps (int): steps of linear warm-up; 0 starts at the full rate.
        min_lr_ratio (float): the floor, as a fraction of the base rate.

    Returns:
        float: the factor in ``[min_lr_ratio, 1]`` (warm-up: in ``(0, 1]``).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = total_steps - warmup_steps
    progress = min(1.0, (step - warmup_steps) / decay_steps) if decay_steps > 0 else 1.0
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    warmup_steps: int = 10,
    min_lr_ratio: float = 0.1,
) -> LambdaLR:
    """A ``LambdaLR`` following ``warmup_cosine_factor``; call ``step()`` after each optimizer step.

    A ``warmup_steps`` above ``total_steps`` is lowered to it, with a warning.

    Raises:
        ValueError: ``total_steps < 1``, negative ``warmup_steps``, or ``min_lr_ratio`` outside
            [0, 1]; the message names the config key.
    """
    if total_steps < 1:
        raise ValueError(f"train.steps must be >= 1, got {total_steps}")
    if warmup_steps < 0:
        raise ValueError(f"optim.scheduler.warmup_steps must be >= 0, got {warmup_steps}")
    if warmup_steps > total_steps:
        # A short smoke-test run should not need the schedule edited (torchtitan does the same).
        logger.warning(
            "optim.scheduler.warmup_steps (%d) exceeds train.steps (%d); warming up over all %d",
            warmup_steps,
            total_steps,
            total_steps,
        )
        warmup_steps = total_steps
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.scheduler.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    factor = functools.partial(
        warmup_cosine_factor,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        min_lr_ratio=min_lr_ratio,
    )
    return LambdaLR(optimizer, factor)
