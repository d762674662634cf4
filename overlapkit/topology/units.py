"""Parse and print sizes, bandwidths and durations as people write them.

Sizes: ``140e9``, ``140GB`` (decimal, 10^9), ``1.5GiB`` (binary, 2^30), ``4KiB``; a bare number is
bytes. Bandwidths: ``1.8TB/s``, ``50GB/s``, ``400Gbit/s``, ``400Gb/s``, ``400Gbps``, ``8gbit`` (tc's
spelling); a bare number is GB/s. A lower-case ``b`` or the word ``bit`` means bits, an upper-case
``B`` means bytes. Durations: ``5us``, ``2.5ms``, ``1e-6s``; a bare number is seconds.

Internally sizes are bytes, bandwidths GB/s (10^9 bytes per second) and durations seconds.
Rank lists print as ranges: ``[0, 1, 2, 3, 8, 9]`` is ``0-3,8-9``; tables as aligned columns.
"""

from __future__ import annotations

import math
import re

_NUMBER = r"(?P<value>[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
_SIZE_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<prefix>[kKmMgGtTpP]?)(?P<binary>i?)(?P<b>[bB]?)\s*$")
_BANDWIDTH_RE = re.compile(
    rf"^\s*{_NUMBER}\s*(?P<prefix>[kKmMgGtTpP]?)(?P<binary>i?)(?P<unit>B/s|b/s|Bps|bps|bit/s|bit)?\s*$"
)
_DURATION_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>s|ms|us|µs|ns)?\s*$")

_DECIMAL = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BINARY = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _lead(what: str) -> str:
    return f"{what}: " if what else ""


def _finite(value: float, text: str | int | float, what: str) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{what or 'value'} must be a finite number, got {text!r}")
    return value


def _float(number: int | float, what: str) -> float:
    try:
        return _finite(float(number), number, what)
    except OverflowError:  # an int beyond the float range (YAML and JSON allow any size)
        raise ValueError(f"{what or 'value'} must be a finite number, got {number!r}") from None


def parse_size(text: str | int | float, *, what: str = "size") -> float:
    """Bytes in ``text``: a number of bytes or a number with a unit (``140GB``, ``1.5GiB``).

    Args:
        text (str | int | float): the size; numbers are taken as bytes.
        what (str): how the caller names the value in error messages (``"--bytes"``).

    Returns:
        float: the size in bytes, >= 0.

    Raises:
        ValueError: unparseable, negative or not finite.
    """
    if isinstance(text, bool):
        raise TypeError(f"{what} must be a number of bytes or a string like '140GB', got {text!r}")
    if isinstance(text, (int, float)):
        value = _float(text, what)
    else:
        match = _SIZE_RE.match(str(text))
        if match is None:
            raise ValueError(
                f"{_lead(what)}cannot read {text!r} as a size; write bytes (140e9) or a "
                "number with a unit (140GB, 1.5GiB, 4KiB)"
            )
        if match["b"] == "b":
            raise ValueError(f"{_lead(what)}{text!r} is in bits; sizes are bytes (140GB, 1.5GiB)")
        if match["binary"] and not match["prefix"]:
            raise ValueError(
                f"{_lead(what)}cannot read {text!r} as a size; 'i' needs a prefix (KiB)"
            )
        table = _BINARY if match["binary"] else _DECIMAL
        prefix = match["prefix"].lower()
        value = _finite(float(match["value"]) * table[prefix], text, what)
    if value < 0:
        raise ValueError(f"{what or 'size'} must be >= 0 bytes, got {text!r}")
    return value


def parse_bandwidth(text: str | int | float, *, what: str = "bandwidth") -> float:
    """GB/s (10^9 bytes per second) in ``text`` (``1.8TB/s``, ``400Gbit/s``, ``8gbit``).

    Args:
        text (str | int | float): the bandwidth; numbers are taken as GB/s.
        what (str): how the caller names the value in error messages.

    Returns:
        float: bandwidth in GB/s, > 0.

    Raises:
        ValueError: unparseable, not positive or not finite.
    """
    if isinstance(text, bool):
        raise TypeError(f"{what} must be GB/s or a string like '50GB/s', got {text!r}")
    if isinstance(text, (int, float)):
        value = _float(text, what)
    else:
        match = _BANDWIDTH_RE.match(str(text))
        if match is None or (match["unit"] is None and (match["prefix"] or match["binary"])):
            raise ValueError(
                f"{_lead(what)}cannot read {text!r} as a bandwidth; write GB/s (50) or a "
                "number with a unit (1.8TB/s, 50GB/s, 400Gbit/s, 8gbit)"
            )
        bits = match["unit"] in ("b/s", "bps", "bit/s", "bit")
        table = _BINARY if match["binary"] else _DECIMAL
        per_second = float(match["value"]) * table[match["prefix"].lower()]
        if match["unit"] is None:
            per_second *= 1e9  # a bare number is GB/s
        value = _finite(per_second / (8 if bits else 1) / 1e9, text, what)
    if not value > 0:
        raise ValueError(f"{what or 'bandwidth'} must be > 0, got {text!r}")
    return value


def parse_duration(text: str | int | float, *, what: str = "duration") -> float:
    """Seconds in ``text`` (``5us``, ``2.5ms``, ``1e-6``); a bare number is seconds.

    Raises:
        ValueError: unparseable, negative or not finite.
    """
    if isinstance(text, bool):
        raise TypeError(f"{what} must be seconds or a string like '5us', got {text!r}")
    if isinstance(text, (int, float)):
        value = _float(text, what)
    else:
        match = _DURATION_RE.match(str(text))
        if match is None:
            raise ValueError(
                f"{_lead(what)}cannot read {text!r} as a duration; write seconds (1e-6) or a "
                "number with a unit (5us, 2.5ms)"
            )
        value = _finite(float(match["value"]) * _SECONDS[match["unit"] or "s"], text, what)
    if value < 0:
        raise ValueError(f"{what or 'duration'} must be >= 0, got {text!r}")
    return value


def format_bytes(nbytes: float) -> str:
    """``nbytes`` for people: binary units when they are exact (1.5 GiB), decimal otherwise."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            if float(nbytes * 1000 / scale).is_integer():
                return f"{nbytes / scale:g} {unit}"
            break
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:g} B"


def format_seconds(seconds: float) -> str:
    """``seconds`` in s, ms or us with four significant digits."""
    if seconds >= 1:
        return f"{seconds:.4g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.4g} ms"
    return f"{seconds * 1e6:.4g} us"


def rank_ranges(ranks: list[int] | tuple[int, ...]) -> str:
    """``[0, 1, 2, 3, 8, 9]`` -> ``"0-3,8-9"``."""
    parts: list[str] = []
    start = previous = None
    for rank in ranks:
        if previous is not None and rank == previous + 1:
            previous = rank
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = rank
    if start is not None:
        parts.append(str(start) if start == previous else f"{start}-{previous}")
    return ",".join(parts)


def text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """``header`` and ``rows`` as lines of left-aligned columns, indented by two spaces (the
    tables ``overlapkit topo`` and ``plan.explain()`` print)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    return [
        "  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
