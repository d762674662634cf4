"""What-if slowdowns of a run: how much faster it would be with its ranks made ideal.

**What-if slowdown** (Lin et al., OSDI '25): ``S = T / T_ideal``, T the replayed run and T_ideal
the run with every segment's compute and idle time replaced by the mean of its kind (its place
in the step, over all ranks and steps) and every transfer by the median of its kind, where they
were longer: unlike the paper, a value below the ideal is kept, so that making a rank ideal
never slows the run down (on a loaded machine a rank given the others' mean would often be the
slowest) and ``S >= 1``, ``0 <= M_W <= 1``. ``S`` per rank (only that rank's segments and
transfers made ideal), per kind (``compute``, ``host_gap``, ``transfer`` made ideal
everywhere), and ``M_W``: the share of ``T - T_ideal`` removed by making the worst 3 % of
ranks (by their S) ideal.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from overlapkit.profiling.collectives import Matching, group_median
from overlapkit.profiling.replay import VALUES, WORK, ReplayGraph

WORST_SHARE = 0.03
"""``M_W``'s worst ranks: this share of them (at least one)."""
MAX_RANK_REPLAYS = 64
"""Above this many ranks, ``S`` per rank is replayed for the costliest stragglers' ranks only:
each is one replay of the whole run."""


@dataclass(slots=True)
class WhatIf:
    """The what-if slowdowns of a run (the module doc defines them); times in ms."""

    t_ms: float
    t_ideal_ms: float
    slowdown: float
    per_rank: dict[int, float]
    """S of each rank replayed (every rank up to ``MAX_RANK_REPLAYS``, else the costliest)."""
    per_kind: dict[str, float]
    worst_ranks: list[int]
    m_w: float | None
    replay_error_us: float
    """Largest difference between the replay of the observed run and the run itself."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["per_rank"] = [{"rank": r, "slowdown": s} for r, s in sorted(self.per_rank.items())]
        return out


def what_if_slowdowns(
    graph: ReplayGraph,
    matching: Matching,
    index: np.ndarray,
    cost_by_rank: dict[int, float],
) -> WhatIf:
    """S for the run, per rank and per kind, and M_W (the module doc defines them).

    Args:
        graph (ReplayGraph): the run's dependency graph (``replay``).
        matching (Matching): its matched collectives.
        index (np.ndarray): per row, its collective's index in its step (its kind).
        cost_by_rank (dict[int, float]): the stragglers' cost per rank (ms): above
            ``MAX_RANK_REPLAYS`` ranks, the costliest are the ones replayed.

    Returns:
        WhatIf: ``slowdown >= 1``; every ``per_rank`` and ``per_kind`` value >= 1; ``m_w``
        in [0, 1], None where the run is already ideal.
    """
    kind_of = index.astype(np.int64)
    types = int(kind_of.max()) + 1 if len(kind_of) else 1
    counts = np.maximum(np.bincount(kind_of, minlength=types), 1)
    ideal = {
        name: (np.bincount(kind_of, weights=graph.values[name], minlength=types) / counts)[kind_of]
        for name in WORK
    }
    ideal["transfer"] = group_median(graph.values["transfer"], kind_of, types)[kind_of]
    ideal = {name: np.minimum(x, graph.values[name]) for name, x in ideal.items()}
    tail_ideal = {
        name: np.minimum(x, float(x.mean()) if len(x) else 0.0) for name, x in graph.tail.items()
    }
    t = graph.run()
    t_ideal = graph.run(ideal, tail_ideal)

    def fixed(rows: np.ndarray, programs: np.ndarray | None = None, what=VALUES) -> float:
        changes = {name: graph.values[name].copy() for name in what}
        for name in what:
            changes[name][rows] = ideal[name][rows]
        tail = {name: graph.tail[name].copy() for name in WORK}
        if programs is not None:
            for name in WORK:
                tail[name][programs] = tail_ideal[name][programs]
        return graph.run(changes, tail)

    all_rows = np.arange(len(kind_of))
    per_kind = {
        "compute": t / fixed(all_rows, what=("busy_pre", "busy_post")),
        "host_gap": t / fixed(all_rows, what=("gap_pre", "gap_post")),
        "transfer": t / fixed(all_rows, what=("transfer",)),
    }
    ranks = sorted({p.rank for p in matching.programs})
    if len(ranks) > MAX_RANK_REPLAYS:
        ranks = sorted(cost_by_rank, key=lambda r: -cost_by_rank[r])[:MAX_RANK_REPLAYS]
    program_rank = np.array([p.rank for p in matching.programs])
    per_rank = {
        r: t / fixed(np.flatnonzero(matching.row_rank == r), np.flatnonzero(program_rank == r))
        for r in ranks
    }
    worst_n = max(1, math.ceil(WORST_SHARE * len(set(program_rank.tolist()))))
    worst = sorted(per_rank, key=lambda r: -per_rank[r])[:worst_n]
    t_worst = fixed(
        np.flatnonzero(np.isin(matching.row_rank, worst)),
        np.flatnonzero(np.isin(program_rank, worst)),
    )
    m_w = (t - t_worst) / (t - t_ideal) if t - t_ideal > 1e-9 * t else None
    return WhatIf(
        t_ms=t / 1e3,
        t_ideal_ms=t_ideal / 1e3,
        slowdown=t / t_ideal,
        per_rank=per_rank,
        per_kind=per_kind,
        worst_ranks=worst,
        m_w=m_w,
        replay_error_us=graph.check(),
    )
