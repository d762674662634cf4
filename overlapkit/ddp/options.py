"""Checks of the arguments ``ok.ddp`` and ``ok.GradBucketer`` share; errors name the value."""

from __future__ import annotations

import torch

from overlapkit.validation import is_finite_number


def validate_bucket_mb(bucket_mb: float, *, caller: str) -> float:
    """Check a bucket size in MiB: a positive finite number."""
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
        raise TypeError(f"{caller}: bucket_mb must be a number of MiB, got {bucket_mb!r}")
    if not bucket_mb > 0:
        raise ValueError(f"{caller}: bucket_mb must be > 0 MiB, got {bucket_mb!r}")
    if not is_finite_number(bucket_mb):
        raise ValueError(f"{caller}: bucket_mb must be a finite number of MiB, got {bucket_mb!r}")
    return float(bucket_mb)


def trainable_parameters(model: torch.nn.Module, *, caller: str) -> list[torch.nn.Parameter]:
    """The parameters with ``requires_grad``; raises ValueError when there are none."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            f"{caller}: the model ({type(model).__name__}) has no trainable parameters "
            "(none with requires_grad=True); there is nothing to reduce"
        )
    return params
