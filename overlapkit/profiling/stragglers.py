"""Which ranks delay the others, in which collective, why, and what it costs.

For every rank of every matched collective (``collectives``), its segment before the
collective is compared with the same segment on the collective's ranks: the baseline is the
lower median (the lower of the two middle values for an even count) of the ranks not named for
that cause, found again once named ranks are left out, so that two slow ranks of two, three or
four leave a baseline that was not slow:

- ``compute``: it computed longer (``busy``); named with the operator or kernel whose time in
  the segment exceeds the others' most;
- ``host_gap``: it idled longer with nothing to wait for (``gap``); ``data_loading`` where a
  DataLoader range covers most of that extra idle time;
- ``comm``: its transfer in a collective took longer than the others' (``cause_collective``,
  a slow link); named at the collective where the others then waited for it (the next one its
  comm lane or compute held back), or at that one when nothing was held back.

A rank is named a straggler there when one of these excesses is above the run's noise: six
times the robust spread (1.4826 x the median absolute deviation) of each rank's deviation from
the median of its collective's other ranks, over all ranks and collectives or, where larger,
over the collectives at the same place in their step (a longer segment jitters more; given
``PLACE_SAMPLES`` deviations there), at least ``FLOOR_US``, and in any case when it makes the
segment (or the transfer) ``ALWAYS_SHARE`` (20 %) longer than its collective's median one (in a
short run where most collectives have a straggler, the spread is no guide). Its **cost** is the
what-if (``replay``): how much shorter the run would be with those excesses
removed (the segment's busy / gap time, or that transfer, set to the baseline) and everything
else as observed. An excess that others absorbed costs 0.

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
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from overlapkit.profiling.collectives import Matching, group_median, match, view
from overlapkit.profiling.programs import RankProgram
from overlapkit.profiling.rank_trace import COLLECTIVE_KINDS
from overlapkit.profiling.replay import VALUES, WORK, ReplayGraph, build_replay_graph

FLOOR_US = 10.0
NOISE_FACTOR = 6.0
ALWAYS_SHARE = 0.2
"""An excess of this share of the typical segment (or transfer) is named whatever the noise:
where most collectives have a straggler (a short run), the noise estimate is no guide."""
PLACE_SAMPLES = 16
"""The deviations a place in the step needs for a spread of its own (8 steps of two ranks): in a
short run a delay is most of a place's few deviations, and only the run's spread is kept."""
WORST_SHARE = 0.03
MAX_RANK_REPLAYS = 64


@dataclass(slots=True)
class Straggler:
    """One rank delaying one collective (times in ms)."""

    rank: int
    step: int
    collective: str
    """``<kind> #<index>``: the ``index``-th collective of the step on this rank."""
    cause: str
    cost_ms: float
    excess_ms: float
    """The delay removed for the cost: the rank's excess over the others' median."""
    late_ms: float
    """How much later the rank started this collective than the median rank."""
    others_waited_ms: float
    """Summed over the collective's other ranks: how long each waited for this one."""
    op: str | None = None
    """For ``compute``: the operator or kernel that ran longest beyond the others'."""
    cause_collective: str | None = None
    """For ``comm``: the collective whose transfer ran long (``<kind> #<i> of step <n>``)."""
    group: str | None = None
    seq: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class WhatIf:
    """The what-if slowdowns (see the module docstring)."""

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


@dataclass(slots=True)
class StragglerReport:
    """Everything ``overlapkit report --stragglers`` prints."""

    stragglers: list[Straggler]
    matching: Matching
    what_if: WhatIf | None
    waits: np.ndarray
    """Per (rank, step): ``rank``, ``step``, ``wait_ms`` (waited for others), ``cost_ms``."""
    collectives: list[dict[str, Any]]
    thresholds_us: dict[str, float] = field(default_factory=dict)

    def per_rank(self) -> list[dict[str, Any]]:
        """Per rank with stragglers: how often, what it cost, and the causes."""
        out: dict[int, dict[str, Any]] = {}
        for s in self.stragglers:
            row = out.setdefault(s.rank, {"rank": s.rank, "count": 0, "cost_ms": 0.0, "causes": {}})
            row["count"] += 1
            row["cost_ms"] += s.cost_ms
            row["causes"][s.cause] = row["causes"].get(s.cause, 0) + 1
        return sorted(out.values(), key=lambda r: -r["cost_ms"])

    def per_step(self) -> list[dict[str, Any]]:
        """Per step with stragglers: their count, summed cost, and the costliest one."""
        out: dict[int, dict[str, Any]] = {}
        for s in self.stragglers:
            row = out.setdefault(
                s.step, {"step": s.step, "count": 0, "cost_ms": 0.0, "worst": None}
            )
            row["count"] += 1
            row["cost_ms"] += s.cost_ms
            if row["worst"] is None or s.cost_ms > row["worst"]["cost_ms"]:
                row["worst"] = {
                    "rank": s.rank,
                    "collective": s.collective,
                    "cause": s.cause,
                    "cost_ms": s.cost_ms,
                }
        return [out[k] for k in sorted(out)]

    def to_json(self, collective_rows: int | None = None) -> dict[str, Any]:
        m = self.matching
        rows = self.collectives if collective_rows is None else self.collectives[:collective_rows]
        return {
            "stragglers": [s.to_dict() for s in self.stragglers],
            "straggler_ranks": self.per_rank(),
            "straggler_steps": self.per_step(),
            "what_if": None if self.what_if is None else self.what_if.to_dict(),
            "clock": {
                "offsets_us": [
                    {"rank": r, "offset_us": o} for r, o in sorted(m.offsets_us.items())
                ],
                "residual_us": [
                    {"rank": r, "median_us": a, "max_us": b}
                    for r, (a, b) in sorted(m.residual_us.items())
                ],
            },
            "matched_collectives": m.instances,
            "unmatched": [{"reason": k, "rows": v} for k, v in m.unmatched.items()],
            "collectives": rows,
            "collectives_omitted": len(self.collectives) - len(rows),
            "thresholds_us": self.thresholds_us,
        }


def _label(kind: int, index: int) -> str:
    return f"{COLLECTIVE_KINDS[kind]} #{index}"


def _index_in_step(m: Matching) -> np.ndarray:
    steps = m.column("step")
    out = np.zeros(len(steps), np.int64)
    for p, prog in enumerate(m.programs):
        lo = int(m.first_row[p])
        seen: dict[int, int] = {}
        for k, step in enumerate(prog.rows["step"].tolist()):
            out[lo + k] = seen.get(step, 0)
            seen[step] = out[lo + k] + 1
    return out


def _others_median(values: np.ndarray, inst: np.ndarray, count: int) -> np.ndarray:
    """Per value, the median of the other values of its collective ``inst`` (NaN if none)."""
    order = np.lexsort((values, inst))
    group, ranked = inst[order], values[order]
    sizes = np.bincount(group, minlength=count)
    first = (np.cumsum(sizes) - sizes)[group]
    own = np.arange(len(ranked)) - first
    others = sizes[group] - 1

    def other(k: np.ndarray) -> np.ndarray:  # the k-th smallest of the others
        k = np.maximum(k, 0)
        return ranked[np.minimum(first + k + (k >= own), len(ranked) - 1)]

    middle = (other((others - 1) // 2) + other(others // 2)) / 2
    out = np.empty(len(values))
    out[order] = np.where(others > 0, middle, np.nan)
    return out


def _spread(deviation: np.ndarray) -> float:
    """Robust standard deviation: 1.4826 x the median absolute deviation (0 for none)."""
    if len(deviation) == 0:
        return 0.0
    return 1.4826 * float(np.median(np.abs(deviation - np.median(deviation))))


def _noise(
    values: np.ndarray, inst: np.ndarray, count: int, typical: np.ndarray, position: np.ndarray
) -> np.ndarray:
    """Per value, the excess its rank needs to be named: ``NOISE_FACTOR`` x the spread of the
    values' deviations from the median of their collective's other values, over the run or,
    where larger, over the collectives at the same ``position`` in their step (if they have
    ``PLACE_SAMPLES``); at most
    ``ALWAYS_SHARE`` x its ``typical`` (its collective's median segment or transfer), at least
    ``FLOOR_US``.

    The deviation from the others is what an excess is (the value less the others' lower
    median), so both have one scale for any group size; the deviation from the collective's
    own median would be half a two-rank group's difference (and 0 for the middle of three).
    A position's own spread and cap keep the jitter of longer segments (or transfers) from
    passing the run's: jitter grows with what it is the jitter of."""
    deviation = values - _others_median(values, inst, count)
    known = ~np.isnan(deviation)
    run = _spread(deviation[known])
    spread = np.full(len(values), run)
    for place in np.unique(position):
        here = position == place
        if np.count_nonzero(here & known) >= PLACE_SAMPLES:
            spread[here] = max(run, _spread(deviation[here & known]))
    return np.maximum(np.minimum(NOISE_FACTOR * spread, ALWAYS_SHARE * typical), FLOOR_US)


def _baseline(values: np.ndarray, inst: np.ndarray, count: int, named: np.ndarray) -> np.ndarray:
    """Per collective, the lower median of its values on the ranks not ``named`` (all of its
    values where every rank is named)."""
    base = group_median(values[~named], inst[~named], count, lower=True)
    everyone = group_median(values, inst, count, lower=True)
    return np.where(np.isnan(base), everyone, base)


def _op_excess(m: Matching, row: int, members: np.ndarray) -> str | None:
    """The op whose time in ``row``'s segment exceeds the other members' median the most."""

    def ops(r: int) -> dict[str, float]:
        prog = m.programs[int(m.row_program[r])]
        local = int(r - m.first_row[m.row_program[r]])
        codes, times = prog.rows["top_op"][local], prog.rows["top_us"][local]
        return {
            prog.names[c]: float(t)
            for c, t in zip(codes.tolist(), times.tolist(), strict=True)
            if c >= 0
        }

    mine = ops(row)
    others = [ops(int(r)) for r in members if r != row]
    best, best_excess = None, -math.inf
    for name, t in mine.items():
        excess = t - float(np.median([o.get(name, 0.0) for o in others])) if others else t
        if excess > best_excess:
            best, best_excess = name, excess
    return best


def find_stragglers(programs: list[RankProgram], *, what_if: bool = True) -> StragglerReport:
    """Match, align, attribute and cost the stragglers of a run (see the module docstring)."""
    m = match(programs)
    v = view(m)
    graph = build_replay_graph(m)
    inst = m.instance
    ok = inst >= 0
    n_inst = max(m.instances, 1)
    values = graph.values
    busy = values["busy_pre"] + values["busy_post"]
    gap = values["gap_pre"] + values["gap_post"]
    transfer = values["transfer"]
    loader = m.column("loader")
    _, s, _, _ = graph.observed
    rows = np.flatnonzero(ok)
    segment = group_median(busy[rows] + gap[rows], inst[rows], n_inst)[inst[rows]]
    typical = {"compute": segment, "host_gap": segment}
    typical["comm"] = group_median(transfer[rows], inst[rows], n_inst)[inst[rows]]
    index = _index_in_step(m)
    tau = {
        cause: _noise(x[rows], inst[rows], n_inst, typical[cause], index[rows])
        for cause, x in (("compute", busy), ("host_gap", gap), ("comm", transfer))
    }
    # Each cause's baseline: the lower median of the collective's ranks not named for it.
    parts = {"compute": ("busy_pre", "busy_post"), "host_gap": ("gap_pre", "gap_post")}
    parts["comm"] = ("transfer",)
    totals = {"compute": busy, "host_gap": gap, "comm": transfer}
    med, excess = {}, {}
    for cause, total in totals.items():
        named_mask = np.zeros(len(rows), bool)
        for _ in range(4):
            base = _baseline(total[rows], inst[rows], n_inst, named_mask)
            now = total[rows] - base[inst[rows]] > tau[cause]
            if (now == named_mask).all():
                break
            named_mask = now
        excess[cause] = total[rows] - base[inst[rows]]
        med[cause] = base
        for name in parts[cause]:
            med[name] = _baseline(values[name][rows], inst[rows], n_inst, named_mask)
        if cause == "host_gap":
            med["loader"] = _baseline(loader[rows], inst[rows], n_inst, named_mask)
    med["start"] = group_median(s[rows], inst[rows], n_inst, lower=True)
    busy_ex, gap_ex, comm_ex = excess["compute"], excess["host_gap"], excess["comm"]
    loader_ex = loader[rows] - med["loader"][inst[rows]]
    # Where a long transfer makes the others wait: at the rank's next collective held back by
    # it (its queue successor, or the collective its compute waited on it for).
    user = np.full(len(busy), -1, np.int64)
    for refs in (graph.wait_on, graph.fifo):
        later = np.flatnonzero(refs >= 0)
        user[refs[later]] = later
    kinds = m.column("kind")
    steps = m.column("step")
    found = []

    def named(row: int, at: int, cause: str, excess: float, changes: dict, changed: list) -> None:
        cost = graph.delta(np.array(changed), changes)
        members = m.members[int(inst[at])]
        prog = m.programs[int(m.row_program[at])]
        local = int(at - m.first_row[m.row_program[at]])
        code = int(prog.rows["group"][local])
        found.append(
            Straggler(
                rank=int(m.row_rank[row]),
                step=int(steps[at]),
                collective=_label(int(kinds[at]), int(index[at])),
                cause=cause,
                cost_ms=cost / 1e3 if cost > 0 else 0.0,  # not -0.0 where max(-0.0, 0.0) is
                excess_ms=excess / 1e3,
                late_ms=float(s[at] - med["start"][inst[at]]) / 1e3,
                others_waited_ms=float(np.maximum(s[at] - s[members], 0.0).sum()) / 1e3,
                op=_op_excess(m, row, members) if cause == "compute" else None,
                cause_collective=(
                    f"{_label(int(kinds[row]), int(index[row]))} of step {int(steps[row])}"
                    if cause == "comm"
                    else None
                ),
                group=prog.groups[code] if code >= 0 else None,
                seq=int(prog.rows["seq"][local]) if prog.rows["seq"][local] >= 0 else None,
            )
        )

    segment = (busy_ex > tau["compute"]) | (gap_ex > tau["host_gap"])
    for k in np.flatnonzero(segment).tolist():
        row = int(rows[k])
        parts = {"compute": busy_ex[k], "host_gap": gap_ex[k]}
        significant = {c: x for c, x in parts.items() if x > tau[c][k]}
        cause = max(significant, key=significant.get)
        changes = {name: values[name][[row]].copy() for name in WORK}
        for c, names in (
            ("compute", ("busy_pre", "busy_post")),
            ("host_gap", ("gap_pre", "gap_post")),
        ):
            if c in significant:
                for name in names:
                    changes[name][0] = min(values[name][row], med[name][inst[row]])
        if cause == "host_gap" and loader_ex[k] >= 0.5 * gap_ex[k]:
            cause = "data_loading"
        named(row, row, cause, float(sum(significant.values())), changes, [row])
    for k in np.flatnonzero(comm_ex > tau["comm"]).tolist():
        row = int(rows[k])
        at = int(user[row]) if user[row] >= 0 and inst[user[row]] >= 0 else row
        changes = {"transfer": np.array([min(transfer[row], med["transfer"][inst[row]])])}
        named(row, at, "comm", float(comm_ex[k]), changes, [row])
    found.sort(key=lambda x: (-x.cost_ms, x.step, x.rank))
    report = StragglerReport(
        stragglers=found,
        matching=m,
        what_if=_what_if(graph, m, index, found) if what_if and m.instances else None,
        waits=_waits(m, v.wait_us, steps, found),
        collectives=_collective_rows(m, v, index, kinds, steps),
        thresholds_us={c: float(np.median(t)) if len(t) else FLOOR_US for c, t in tau.items()},
    )
    return report


def _waits(
    m: Matching, wait_us: np.ndarray, steps: np.ndarray, found: list[Straggler]
) -> np.ndarray:
    dtype = np.dtype([("rank", "i8"), ("step", "i8"), ("wait_ms", "f8"), ("cost_ms", "f8")])
    keys = sorted(
        {(int(r), int(st)) for r, st in zip(m.row_rank.tolist(), steps.tolist(), strict=True)}
    )
    where = {k: i for i, k in enumerate(keys)}
    out = np.zeros(len(keys), dtype)
    for i, (r, st) in enumerate(keys):
        out[i]["rank"], out[i]["step"] = r, st
    for r, st, w in zip(m.row_rank.tolist(), steps.tolist(), wait_us.tolist(), strict=True):
        out["wait_ms"][where[(r, st)]] += w / 1e3
    for sgl in found:
        if (sgl.rank, sgl.step) in where:
            out["cost_ms"][where[(sgl.rank, sgl.step)]] += sgl.cost_ms
    return out


def _collective_rows(m: Matching, v, index, kinds, steps) -> list[dict[str, Any]]:
    start, arrival = m.aligned("start"), m.aligned("arrival")
    out = []
    for i, rows in enumerate(m.members):
        first = int(rows[0])
        out.append(
            {
                "step": int(steps[first]),
                "collective": _label(int(kinds[first]), int(index[first])),
                "last_arriver": int(v.last_arriver[i]),
                "transfer_ms": float(v.transfer_us[i]) / 1e3,
                "max_wait_ms": float(v.wait_us[rows].max()) / 1e3,
                "ranks": m.row_rank[rows].tolist(),
                "arrival_us": arrival[rows].tolist(),
                "start_us": start[rows].tolist(),
                "wait_ms": (v.wait_us[rows] / 1e3).tolist(),
            }
        )
    out.sort(key=lambda r: (r["step"], r["collective"]))
    return out


def _what_if(graph: ReplayGraph, m: Matching, index: np.ndarray, found: list[Straggler]) -> WhatIf:
    """S for the run, per rank and per kind, and M_W (see the module docstring)."""
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
    ranks = sorted({p.rank for p in m.programs})
    if len(ranks) > MAX_RANK_REPLAYS:
        cost: dict[int, float] = {}
        for sgl in found:
            cost[sgl.rank] = cost.get(sgl.rank, 0.0) + sgl.cost_ms
        ranks = sorted(cost, key=lambda r: -cost[r])[:MAX_RANK_REPLAYS]
    program_rank = np.array([p.rank for p in m.programs])
    per_rank = {
        r: t / fixed(np.flatnonzero(m.row_rank == r), np.flatnonzero(program_rank == r))
        for r in ranks
    }
    worst_n = max(1, math.ceil(WORST_SHARE * len(set(program_rank.tolist()))))
    worst = sorted(per_rank, key=lambda r: -per_rank[r])[:worst_n]
    t_worst = fixed(
        np.flatnonzero(np.isin(m.row_rank, worst)), np.flatnonzero(np.isin(program_rank, worst))
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
