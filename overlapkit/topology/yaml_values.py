"""Value converters of the topology file's keys: each checks one YAML value and returns it in
the model's units (GB, GB/s, µs, s), or raises ValueError saying what was expected and what was
given (``loading`` adds the file, line and key).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

from overlapkit.topology.units import parse_bandwidth, parse_duration, parse_size

MAX_COUNT = 2**31 - 1  # no count in a machine description comes near it


def integer(minimum: int) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
        if value < minimum:
            raise ValueError(f"must be >= {minimum}, got {value}")
        if value > MAX_COUNT:
            raise ValueError(f"must be <= {MAX_COUNT}, got {value}")
        return value

    return convert


def real(minimum: float) -> Callable[[Any], float]:
    def convert(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {value!r}")
        if not value >= minimum:
            raise ValueError(f"must be >= {minimum:g}, got {value}")
        if value == math.inf:
            raise ValueError(f"must be a finite number, got {value}")
        if value > sys.float_info.max:  # an int: YAML allows any number of digits
            raise ValueError(f"must be a finite number, got an integer of {len(str(value))} digits")
        return float(value)

    return convert


def fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"expected a fraction in (0, 1], got {value!r}")
    return float(value)


def share(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"expected a share in [0, 1], got {value!r}")
    return float(value)


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def string(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


def choice(enum: type) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        return enum.parse(value)

    return convert


def bandwidth(value: Any) -> float:
    return parse_bandwidth(value, what="")


def gigabytes(value: Any) -> float:
    if not isinstance(value, str):
        raise ValueError(f"expected a size with a unit like 80GB or 141GB, got {value!r}")
    return parse_size(value, what="") / 1e9


def microseconds(value: Any) -> float:
    if not isinstance(value, str):
        # A bare number is ambiguous here (seconds? microseconds?), so a unit is required.
        raise ValueError(f"expected a duration with a unit like 3.4us or 0.5ms, got {value!r}")
    microseconds = parse_duration(value, what="") * 1e6
    if not math.isfinite(microseconds):
        raise ValueError(f"expected a finite duration, got {value!r}")
    return round(microseconds, 9)


def seconds(value: Any) -> float:
    return microseconds(value) / 1e6


def int_tuple(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected a list of integers like [4, 4, 4], got {value!r}")
    return tuple(integer(1)(v) for v in value)


def bool_tuple(value: Any) -> tuple[bool, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected a list of true/false, got {value!r}")
    return tuple(boolean(v) for v in value)
