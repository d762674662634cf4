"""Across ranks, from the run's step table: who was slowest in each step, per rank totals and
percentiles, in array passes (a thousand ranks of hundreds of steps are one table).

The table (``TABLE_DTYPE``, one row per rank and step, ms) is ``RunReport.table``; these also
take a list of ``StepMetrics``. ``cross_rank``: per step the slowest rank and the spread of
``comm_ms`` (the rank with the least comm waited least, so its comm is closest to the transfer
itself; the others also waited for it); ``slowest_ranks``: per step the ``TOP_K`` slowest;
``rank_totals`` and ``rank_percentiles``: per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

TOP_K = 5
TABLE_DTYPE = np.dtype(
    [
        ("rank", "i8"),
        ("step", "i8"),
        ("file", "i4"),
        ("step_ms", "f8"),
        ("compute_ms", "f8"),
        ("comm_ms", "f8"),
        ("exposed_comm_ms", "f8"),
        ("tail_ms", "f8"),
    ]
)


@dataclass(frozen=True, slots=True)
class CrossRankStep:
    """One step across ranks: who was slowest and how far ``comm_ms`` spread (ms)."""

    step: int
    ranks: int
    slowest_rank: int
    slowest_step_ms: float
    fastest_step_ms: float
    min_comm_rank: int
    min_comm_ms: float
    max_comm_rank: int
    max_comm_ms: float
    comm_spread_ms: float
    """max - min comm_ms: roughly the time the faster ranks waited for the slowest one."""


def _as_table(steps: list | np.ndarray) -> np.ndarray:
    if isinstance(steps, np.ndarray):
        return steps
    table = np.zeros(len(steps), TABLE_DTYPE)
    for name in ("rank", "step", "step_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "tail_ms"):
        table[name] = [getattr(row, name) for row in steps]
    return table


def _groups(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unique keys, the order that sorts rows by key (stably), and each group's first index."""
    order = np.argsort(keys, kind="stable")
    unique, first = np.unique(keys[order], return_index=True)
    return unique, order, first


def cross_rank(steps: list | np.ndarray) -> list[CrossRankStep]:
    """For each step number: the slowest rank and the spread of comm time across ranks."""
    table = _as_table(steps)
    unique, order, first = _groups(table["step"])
    out = []
    for number, rows in zip(unique.tolist(), np.split(table[order], first[1:]), strict=True):
        slowest = rows[np.argmax(rows["step_ms"])]  # first of equal maxima, as max() picks
        least = rows[np.argmin(rows["comm_ms"])]
        most = rows[np.argmax(rows["comm_ms"])]
        out.append(
            CrossRankStep(
                step=number,
                ranks=len(np.unique(rows["rank"])),
                slowest_rank=int(slowest["rank"]),
                slowest_step_ms=float(slowest["step_ms"]),
                fastest_step_ms=float(rows["step_ms"].min()),
                min_comm_rank=int(least["rank"]),
                min_comm_ms=float(least["comm_ms"]),
                max_comm_rank=int(most["rank"]),
                max_comm_ms=float(most["comm_ms"]),
                comm_spread_ms=float(most["comm_ms"] - least["comm_ms"]),
            )
        )
    return out


def rank_totals(steps: list | np.ndarray) -> list[dict[str, Any]]:
    """Per rank sums over its steps and the whole-trace overlap percentage."""
    table = _as_table(steps)
    unique, order, first = _groups(table["rank"])
    out = []
    for rank, rows in zip(unique.tolist(), np.split(table[order], first[1:]), strict=True):
        comm, exposed = float(rows["comm_ms"].sum()), float(rows["exposed_comm_ms"].sum())
        out.append(
            {
                "rank": rank,
                "steps": len(rows),
                "compute_ms": float(rows["compute_ms"].sum()),
                "comm_ms": comm,
                "exposed_comm_ms": exposed,
                "tail_ms": float(rows["tail_ms"].sum()),
                "overlap_pct": 100.0 * (1.0 - exposed / comm) if comm > 0 else None,
            }
        )
    return out


def slowest_ranks(table: np.ndarray, k: int = TOP_K) -> list[dict[str, Any]]:
    """Per step, the ``k`` ranks with the longest step time: ``{"step", "ranks": [{"rank",
    "step_ms"}]}`` slowest first."""
    unique, order, first = _groups(table["step"])
    out = []
    for number, rows in zip(unique.tolist(), np.split(table[order], first[1:]), strict=True):
        top = rows[np.argsort(-rows["step_ms"], kind="stable")[:k]]
        out.append(
            {
                "step": number,
                "ranks": [
                    {"rank": int(r), "step_ms": float(ms)}
                    for r, ms in zip(top["rank"], top["step_ms"], strict=True)
                ],
            }
        )
    return out


def rank_percentiles(table: np.ndarray) -> list[dict[str, Any]]:
    """Per rank, the 50th, 90th and 99th percentiles of its step time and its comm time (ms)."""
    unique, order, first = _groups(table["rank"])
    out = []
    for rank, rows in zip(unique.tolist(), np.split(table[order], first[1:]), strict=True):
        step = np.percentile(rows["step_ms"], [50, 90, 99])
        comm = np.percentile(rows["comm_ms"], [50, 90, 99])
        out.append(
            {"rank": rank, "steps": len(rows)}
            | {f"step_ms_p{p}": float(v) for p, v in zip((50, 90, 99), step, strict=True)}
            | {f"comm_ms_p{p}": float(v) for p, v in zip((50, 90, 99), comm, strict=True)}
        )
    return out
