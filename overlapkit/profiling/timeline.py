"""A timeline picture of one step: compute, comm and exposed comm lanes for every rank.

Drawn with matplotlib's object API (no pyplot), so it neither needs a display nor changes the
caller's backend. Each rank's x axis starts at its own ``ProfilerStep`` start, because the clocks
of different hosts are not aligned.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from overlapkit.profiling.analysis import RunReport, StepLanes

_COLORS = {"compute": "#4C72B0", "comm": "#DD8452", "exposed": "#C44E52"}


def default_step(report: RunReport) -> int:
    """The last step recorded by the most ranks.

    Raises:
        ValueError: the report has no steps.
    """
    counts = Counter(report.table["step"].tolist())
    if not counts:
        raise ValueError(f"no steps to draw in {report.run_dir}")
    most = max(counts.values())
    return max(step for step, n in counts.items() if n == most)


def _bars(intervals_us: list[tuple[float, float]], origin: float) -> list[tuple[float, float]]:
    return [((s - origin) / 1e3, (e - s) / 1e3) for s, e in intervals_us]


def draw_timeline(report: RunReport, path: str | Path, step: int | None = None) -> Path:
    """Write a PNG of ``step`` (default: ``default_step``) for every rank.

    The report must hold that step's intervals (``analyze_run(..., lanes={step})``).

    Raises:
        ValueError: ``step`` is not in the report (the message lists the steps there are).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    available = sorted(set(report.table["step"].tolist()))
    step = default_step(report) if step is None else step
    if step not in available:
        raise ValueError(f"--step {step} is not in the traces; steps there: {available}")
    if not any(lanes.step == step for lanes in report.lanes):
        raise ValueError(
            f"the report holds no intervals of step {step}: analyse with lanes={{{step}}}"
        )
    chosen: list[StepLanes] = sorted(
        (lanes for lanes in report.lanes if lanes.step == step), key=lambda s: s.rank
    )
    metrics = {(m.rank, m.file): m for m in report.steps if m.step == step}

    fig = Figure(figsize=(11, 1.0 + 1.1 * len(chosen)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ticks, labels = [], []
    y = 0.0
    for lanes in reversed(chosen):
        m = metrics[(lanes.rank, lanes.file)]
        rows = (
            ("exposed", lanes.exposed, f"exposed {m.exposed_comm_ms:.1f} ms"),
            ("comm", lanes.comm, f"comm {m.comm_ms:.1f} ms"),
            ("compute", lanes.compute, f"compute {m.compute_ms:.1f} ms"),
        )
        for lane, spans, label in rows:
            ax.broken_barh(_bars(spans, lanes.start), (y, 0.8), color=_COLORS[lane])
            ticks.append(y + 0.4)
            labels.append(f"rank {lanes.rank} {label}")
            y += 1.0
        if lanes.tail_from is not None and m.tail_ms > 0:
            x = (lanes.tail_from - lanes.start) / 1e3
            ax.plot([x, x], [y - 3.0, y - 0.2], color="black", linestyle="--", linewidth=1)
        step_end = (lanes.end - lanes.start) / 1e3
        ax.plot([step_end, step_end], [y - 3.0, y - 0.2], color="grey", linewidth=1, linestyle=":")
        y += 0.5
    ax.set_yticks(ticks, labels)
    ax.set_xlabel("ms since the step started on that rank (dotted: step end, dashed: tail start)")
    ax.set_title(f"{report.run_dir.name or report.run_dir}: step {step}", loc="left")
    ax.legend(
        handles=[Patch(color=c, label=n) for n, c in _COLORS.items()],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=3,
        fontsize="small",
        frameon=False,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path
