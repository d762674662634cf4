"""Scaling efficiency: how much of N ranks' ideal throughput a job reaches.

``scaling_efficiency(T1, TN, N) = TN / (N x T1)``, with throughputs in items per second (samples
or tokens) of the whole job: 1.0 means N ranks do N times the work of one, and below ``1 / N``
N ranks do less than one alone. Used by ``overlapkit doctor`` (check 8) and
``bench/scaling.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def scaling_efficiency(throughput_1: float, throughput_n: float, n: int) -> float:
    """``throughput_n / (n x throughput_1)`` (dimensionless).

    Args:
        throughput_1 (float): one rank's throughput, items/s (> 0).
        throughput_n (float): the whole job's throughput on ``n`` ranks, items/s (>= 0).
        n (int): ranks (>= 1).

    Raises:
        ValueError: ``n < 1``, ``throughput_1 <= 0`` or a throughput that is negative or not
            finite, naming the value.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"scaling_efficiency: n must be an int >= 1 rank, got {n!r}")
    if not math.isfinite(throughput_1) or throughput_1 <= 0:
        raise ValueError(
            f"scaling_efficiency: throughput_1 must be > 0 items/s, got {throughput_1!r}"
        )
    if not math.isfinite(throughput_n) or throughput_n < 0:
        raise ValueError(
            f"scaling_efficiency: throughput_n must be >= 0 items/s, got {throughput_n!r}"
        )
    return throughput_n / (n * throughput_1)


def efficiencies(throughputs: Mapping[int, float]) -> dict[int, float]:
    """Per rank count, the efficiency against the 1-rank throughput (which must be present).

    Raises:
        ValueError: no 1-rank throughput, or one ``scaling_efficiency`` rejects.
    """
    if 1 not in throughputs:
        raise ValueError(
            f"scaling efficiency needs the 1-rank throughput; got rank counts {sorted(throughputs)}"
        )
    return {n: scaling_efficiency(throughputs[1], t, n) for n, t in sorted(throughputs.items())}


def rank_counts(world_size: int) -> list[int]:
    """1, 2, 4, ... up to ``world_size``, which is always included."""
    counts, n = [], 1
    while n < world_size:
        counts.append(n)
        n *= 2
    return [*counts, world_size]
