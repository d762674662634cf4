"""Checks of user-supplied numbers that every layer shares; errors name the offending value.

At the package root, a leaf importing nothing of overlapkit, because its users span every layer
(``profiling``, ``planner``, ``train``, ``doctor``, ``ddp``) and its two functions belong to no
concept of their own. Checks of one wrapper's options live with it (``overlapkit.ddp.options``).
"""

from __future__ import annotations

import sys
from typing import Any


def is_finite_number(value: Any) -> bool:
    """Whether ``value`` is an int or float that a float holds: not a bool, NaN, an infinity, or
    an int beyond ±1.8e308 (where ``float()`` raises OverflowError)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and -sys.float_info.max <= value <= sys.float_info.max
    )


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
