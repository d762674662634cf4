"""A rank x step picture of the time each rank waited for the others at collectives.

One row per rank, one column per step, the colour the milliseconds the rank's collectives of
that step waited for the last rank to start (``StragglerReport.waits``): a rank that delays the
others shows as a pale row among dark ones (it is the one that never waits), a bad step as a
dark column. Drawn with matplotlib's object API (no pyplot), as ``timeline``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from overlapkit.profiling.stragglers import StragglerReport


def wait_matrix(found: StragglerReport) -> tuple[np.ndarray, list[int], list[int]]:
    """The waits as a (ranks, steps) array of ms (NaN where a rank has no such step)."""
    waits = found.waits
    ranks = sorted(set(waits["rank"].tolist()))
    steps = sorted(set(waits["step"].tolist()))
    grid = np.full((len(ranks), len(steps)), np.nan)
    r = np.searchsorted(ranks, waits["rank"])
    s = np.searchsorted(steps, waits["step"])
    grid[r, s] = waits["wait_ms"]
    return grid, ranks, steps


def draw_wait_heatmap(found: StragglerReport, path: str | Path, *, title: object = "") -> Path:
    """Write the PNG; returns its path.

    Raises:
        ValueError: no collective was matched across ranks (nothing to draw).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    grid, ranks, steps = wait_matrix(found)
    if not len(ranks):
        raise ValueError("no collective was matched across ranks: no waits to draw")
    fig = Figure(
        figsize=(min(4 + 0.12 * len(steps), 16), min(2.5 + 0.12 * len(ranks), 12)), dpi=110
    )
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma")
    fig.colorbar(image, ax=ax, label="waited for others (ms)")
    ax.set_xlabel("step")
    ax.set_ylabel("rank")
    ax.set_xticks(
        np.linspace(0, len(steps) - 1, min(len(steps), 12)).round().astype(int),
        [
            str(steps[i])
            for i in np.linspace(0, len(steps) - 1, min(len(steps), 12)).round().astype(int)
        ],
    )
    ax.set_yticks(
        np.linspace(0, len(ranks) - 1, min(len(ranks), 16)).round().astype(int),
        [
            str(ranks[i])
            for i in np.linspace(0, len(ranks) - 1, min(len(ranks), 16)).round().astype(int)
        ],
    )
    named = sorted({s.rank for s in found.stragglers[:5]})
    ax.set_title(
        f"{title}: wait per rank and step" + (f"; stragglers: {named}" if named else ""),
        loc="left",
        fontsize="small",
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path
