"""TensorBoard scalars of the per-step overlap metrics, one TensorBoard run per rank.

Tags (x axis: the profiler step number):
``overlap/exposed_comm_ms``, ``overlap/comm_ms``, ``overlap/compute_ms``, ``overlap/tail_ms``,
``overlap/ratio`` (omitted for steps without communication, where it is undefined).

Each rank writes to ``<logdir>/overlap/rank<R>``, so TensorBoard draws the ranks as separate
runs on one chart per tag, next to the profiler traces of the same logdir. ``overlapkit report
--stragglers --tensorboard`` adds ``straggler/wait_ms`` and ``straggler/cost_ms`` there.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from overlapkit.profiling.analysis import StepMetrics

SCALARS_DIR = "overlap"
TAGS = (
    "overlap/exposed_comm_ms",
    "overlap/comm_ms",
    "overlap/compute_ms",
    "overlap/tail_ms",
    "overlap/ratio",
)


def scalar_dir(logdir: str | Path, rank: int) -> Path:
    """Where rank ``rank``'s scalars go inside ``logdir``."""
    return Path(logdir) / SCALARS_DIR / f"rank{rank}"


def write_scalars(logdir: str | Path, steps: Iterable[StepMetrics]) -> list[Path]:
    """Write the overlap scalars of ``steps`` (any ranks) as TensorBoard event files.

    Returns:
        list[Path]: the per-rank directories written.
    """
    from torch.utils.tensorboard import SummaryWriter  # imports tensorboard; only when used

    by_rank: dict[int, list[StepMetrics]] = {}
    for row in steps:
        by_rank.setdefault(row.rank, []).append(row)
    written = []
    for rank, rows in sorted(by_rank.items()):
        directory = scalar_dir(logdir, rank)
        with SummaryWriter(log_dir=str(directory)) as writer:
            for row in sorted(rows, key=lambda r: r.step):
                values = {
                    "overlap/exposed_comm_ms": row.exposed_comm_ms,
                    "overlap/comm_ms": row.comm_ms,
                    "overlap/compute_ms": row.compute_ms,
                    "overlap/tail_ms": row.tail_ms,
                    "overlap/ratio": row.overlap_ratio,
                }
                for tag, value in values.items():
                    if value is not None:
                        writer.add_scalar(tag, value, global_step=row.step)
        written.append(directory)
    return written


WAIT_TAGS = ("straggler/wait_ms", "straggler/cost_ms")
"""Per rank and step: time the rank waited for others at collectives, and the cost of the
stragglers named on it (``stragglers``)."""


def write_wait_scalars(logdir: str | Path, waits: np.ndarray) -> list[Path]:
    """Write ``straggler/wait_ms`` and ``straggler/cost_ms`` per rank (``StragglerReport.waits``)
    beside the overlap scalars, one TensorBoard run per rank.

    Returns:
        list[Path]: the per-rank directories written.
    """
    from torch.utils.tensorboard import SummaryWriter

    written = []
    for rank in sorted(set(waits["rank"].tolist())):
        rows = np.sort(waits[waits["rank"] == rank], order="step")
        directory = scalar_dir(logdir, rank)
        with SummaryWriter(log_dir=str(directory)) as writer:
            for row in rows:
                writer.add_scalar(WAIT_TAGS[0], float(row["wait_ms"]), global_step=int(row["step"]))
                writer.add_scalar(WAIT_TAGS[1], float(row["cost_ms"]), global_step=int(row["step"]))
        written.append(directory)
    return written
