"""Checks of user-supplied options shared by the wrappers; errors name the offending value."""

from __future__ import annotations

import sys
from typing import Any

import torch


def is_finite_number(value: Any) -> bool:
    """Whether ``value`` is an int or float that a float holds: not a bool, NaN, an infinity, or
    an int beyond ±1.8e308 (where ``float()`` raises OverflowError)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and -sys.float_info.max <= value <= sys.float_info.max
    )


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


def check_int(name: str, value: Any, minimum: int, *, unit: str = "") -> int:
    """``value`` if it is an int >= ``minimum``; errors name ``name`` as the user spells it.

    Raises:
        TypeError: not an int (a bool is not accepted either).
        ValueError: below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        what = f"an int number of {unit}" if unit else "an int"
        raise TypeError(f"{name} must be {what}, got {value!r}")
    if value < minimum:
        suffix = f" {unit}" if unit else ""
        raise ValueError(f"{name} must be >= {minimum}{suffix}, got {value}")
    return value
