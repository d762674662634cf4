"""How much of a profiled run's communication stayed exposed, as ``overlapkit report`` reads it."""

from __future__ import annotations

import statistics
from pathlib import Path

from overlapkit.profiling.analysis import analyze_run, rank_totals


def exposed_share(logdir: Path) -> dict:
    """Whole-run exposed share and median step time from ``overlapkit report``'s analysis."""
    report = analyze_run(logdir)
    totals = rank_totals(report.steps)
    comm = sum(t["comm_ms"] for t in totals)
    exposed = sum(t["exposed_comm_ms"] for t in totals)
    return {
        "exposed_share": exposed / comm if comm else None,
        "comm_ms_per_step": comm / len(report.steps),
        "exposed_comm_ms_per_step": exposed / len(report.steps),
        "median_ms": statistics.median(r.step_ms for r in report.steps),
    }
