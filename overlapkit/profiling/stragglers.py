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

The report also holds the what-if slowdowns of the run (``what_if``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from overlapkit.profiling.collectives import Matching, group_median, match, view
from overlapkit.profiling.programs import RankProgram
from overlapkit.profiling.rank_trace import COLLECTIVE_KINDS
from overlapkit.profiling.replay import WORK, ReplayGraph, build_replay_graph
from overlapkit.profiling.what_if import WhatIf, what_if_slowdowns

FLOOR_US = 10.0
NOISE_FACTOR = 6.0
ALWAYS_SHARE = 0.2
"""An excess of this share of the typical segment (or transfer) is named whatever the noise:
where most collectives have a straggler (a short run), the noise estimate is no guide."""
PLACE_SAMPLES = 16
"""The deviations a place in the step needs for a spread of its own (8 steps of two ranks): in a
short run a delay is most of a place's few deviations, and only the run's spread is kept."""
MAD_TO_SIGMA = 1.4826
"""The median absolute deviation times this estimates a normal distribution's standard
deviation (``1 / Phi^-1(3/4)``): the robust spread of the noise."""
DATA_LOADING_SHARE = 0.5
"""A ``host_gap`` is ``data_loading`` where the DataLoader's extra time covers at least this share
of the extra idle time: most of the excess is the loader's."""
SETTLE_ROUNDS = 4
"""Rounds of naming and taking the baseline again without the named ranks (``_settled``). On
600 runs of the tests' generator (seeds 0-199, each at its own jitter, 0.3 % and 1 %) every
cause settled by the third round (1,790 of 1,800 by the second); the fourth is to spare, and
the bound stops a named set that would alternate."""


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
        matching = self.matching
        rows = self.collectives if collective_rows is None else self.collectives[:collective_rows]
        return {
            "stragglers": [s.to_dict() for s in self.stragglers],
            "straggler_ranks": self.per_rank(),
            "straggler_steps": self.per_step(),
            "what_if": None if self.what_if is None else self.what_if.to_dict(),
            "clock": {
                "offsets_us": [
                    {"rank": r, "offset_us": o} for r, o in sorted(matching.offsets_us.items())
                ],
                "residual_us": [
                    {"rank": r, "median_us": a, "max_us": b}
                    for r, (a, b) in sorted(matching.residual_us.items())
                ],
            },
            "matched_collectives": matching.instances,
            "unmatched": [{"reason": k, "rows": v} for k, v in matching.unmatched.items()],
            "collectives": rows,
            "collectives_omitted": len(self.collectives) - len(rows),
            "thresholds_us": self.thresholds_us,
        }


def _label(kind: int, index: int) -> str:
    return f"{COLLECTIVE_KINDS[kind]} #{index}"


def _index_in_step(matching: Matching) -> np.ndarray:
    steps = matching.column("step")
    out = np.zeros(len(steps), np.int64)
    for p, prog in enumerate(matching.programs):
        lo = int(matching.first_row[p])
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
    """Robust standard deviation: ``MAD_TO_SIGMA`` x the median absolute deviation (0 for none)."""
    if len(deviation) == 0:
        return 0.0
    return MAD_TO_SIGMA * float(np.median(np.abs(deviation - np.median(deviation))))


def _noise(
    values: np.ndarray, inst: np.ndarray, count: int, typical: np.ndarray, position: np.ndarray
) -> np.ndarray:
    """Per value, the excess its rank needs to be named: ``NOISE_FACTOR`` x the spread of the
    values' deviations from the median of their collective's other values, over the run or,
    where larger, over the collectives at the same ``position`` in their step (if they have
    ``PLACE_SAMPLES``); at most ``ALWAYS_SHARE`` x its ``typical`` (its collective's median
    segment or transfer), at least ``FLOOR_US``.

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


def _op_excess(matching: Matching, row: int, members: np.ndarray) -> str | None:
    """The op whose time in ``row``'s segment exceeds the other members' median the most."""

    def ops(r: int) -> dict[str, float]:
        prog = matching.programs[int(matching.row_program[r])]
        local = int(r - matching.first_row[matching.row_program[r]])
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


_PARTS = {
    "compute": ("busy_pre", "busy_post"),
    "host_gap": ("gap_pre", "gap_post"),
    "comm": ("transfer",),
}
"""The replay's values each cause adds up (``replay.VALUES``)."""


def _total(values: dict[str, np.ndarray], cause: str) -> np.ndarray:
    """Per row, the sum of the values ``cause`` adds up (``_PARTS``)."""
    first, *rest = _PARTS[cause]
    total = values[first]
    for name in rest:
        total = total + values[name]
    return total


@dataclass(slots=True)
class _Excesses:
    """Per matched row (``rows``: the global rows of matched collectives), each cause's excess
    over its collective's baseline (µs); the thresholds (µs) and the baselines per collective."""

    rows: np.ndarray
    thresholds_us: dict[str, np.ndarray]
    """Per cause, per row the excess it needs to be named (``_noise``)."""
    excess: dict[str, np.ndarray]
    """``compute``, ``host_gap``, ``comm`` and ``loader`` (the DataLoader's share of the gap)."""
    baseline: dict[str, np.ndarray]
    """Per collective: each of ``_PARTS``' values, ``loader`` and the ``start``."""


def _thresholds(
    values: dict[str, np.ndarray],
    rows: np.ndarray,
    inst: np.ndarray,
    count: int,
    position: np.ndarray,
) -> dict[str, np.ndarray]:
    """Per cause, per row the excess a rank needs to be named (``_noise``), bounded by its
    collective's typical segment (busy and idle) or transfer; ``position``: per row, its
    collective's index in its step."""
    totals = {cause: _total(values, cause) for cause in _PARTS}
    segment = totals["compute"][rows] + totals["host_gap"][rows]
    typical = {"compute": group_median(segment, inst[rows], count)[inst[rows]]}
    typical["host_gap"] = typical["compute"]
    typical["comm"] = group_median(totals["comm"][rows], inst[rows], count)[inst[rows]]
    return {
        cause: _noise(totals[cause][rows], inst[rows], count, typical[cause], position[rows])
        for cause in ("compute", "host_gap", "comm")
    }


def _settled(
    total: np.ndarray, inst: np.ndarray, count: int, threshold: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(per collective the baseline, per row whether it is named) once naming settles.

    The baseline is the lower median of the ranks not named, so naming a rank can lower it and
    name another (two slow ranks of two, three or four); the rounds stop when the named set no
    longer changes, after ``SETTLE_ROUNDS`` at most.
    """
    named = np.zeros(len(total), bool)
    for _ in range(SETTLE_ROUNDS):
        base = _baseline(total, inst, count, named)
        now = total - base[inst] > threshold
        if (now == named).all():
            break
        named = now
    return base, named


def _excesses(matching: Matching, graph: ReplayGraph, index: np.ndarray) -> _Excesses:
    """Each matched row's excess per cause over the baseline of its collective's ranks not
    named for that cause; ``index``: per row, its collective's index in its step."""
    inst, count = matching.instance, max(matching.instances, 1)
    rows = np.flatnonzero(inst >= 0)
    values = graph.values
    thresholds = _thresholds(values, rows, inst, count, index)
    loader = matching.column("loader")
    baseline, excess = {}, {}
    for cause, names in _PARTS.items():
        total = _total(values, cause)
        base, named = _settled(total[rows], inst[rows], count, thresholds[cause])
        excess[cause] = total[rows] - base[inst[rows]]
        for name in names:
            baseline[name] = _baseline(values[name][rows], inst[rows], count, named)
        if cause == "host_gap":
            baseline["loader"] = _baseline(loader[rows], inst[rows], count, named)
    excess["loader"] = loader[rows] - baseline["loader"][inst[rows]]
    _, start, _, _ = graph.observed
    baseline["start"] = group_median(start[rows], inst[rows], count, lower=True)
    return _Excesses(rows, thresholds, excess, baseline)


@dataclass(slots=True)
class _Namer:
    """Turns an excess into a ``Straggler``: where it is named, and what removing it saves."""

    matching: Matching
    graph: ReplayGraph
    baseline: dict[str, np.ndarray]
    index: np.ndarray
    """Per row, its collective's index in its step on its rank."""
    kinds: np.ndarray
    steps: np.ndarray

    def name(
        self, row: int, at: int, cause: str, excess_us: float, changes: dict[str, np.ndarray]
    ) -> Straggler:
        """``row``'s excess of ``cause``, named at the collective of row ``at``; its cost is
        the replayed run's time saved by ``changes`` (new values of ``row``)."""
        matching, graph = self.matching, self.graph
        kinds, steps, inst = self.kinds, self.steps, matching.instance
        _, start, _, _ = graph.observed
        cost = graph.delta(np.array([row]), changes)
        members = matching.members[int(inst[at])]
        prog = matching.programs[int(matching.row_program[at])]
        local = int(at - matching.first_row[matching.row_program[at]])
        code = int(prog.rows["group"][local])
        return Straggler(
            rank=int(matching.row_rank[row]),
            step=int(steps[at]),
            collective=_label(int(kinds[at]), int(self.index[at])),
            cause=cause,
            cost_ms=cost / 1e3 if cost > 0 else 0.0,  # not -0.0 where max(-0.0, 0.0) is
            excess_ms=excess_us / 1e3,
            late_ms=float(start[at] - self.baseline["start"][inst[at]]) / 1e3,
            others_waited_ms=float(np.maximum(start[at] - start[members], 0.0).sum()) / 1e3,
            op=_op_excess(matching, row, members) if cause == "compute" else None,
            cause_collective=(
                f"{_label(int(kinds[row]), int(self.index[row]))} of step {int(steps[row])}"
                if cause == "comm"
                else None
            ),
            group=prog.groups[code] if code >= 0 else None,
            seq=int(prog.rows["seq"][local]) if prog.rows["seq"][local] >= 0 else None,
        )


def _segment_stragglers(found: _Excesses, namer: _Namer) -> list[Straggler]:
    """Ranks whose segment before a collective computed or idled too long, named there; the
    cost removes every significant part of the excess."""
    values, inst, tau = namer.graph.values, namer.matching.instance, found.thresholds_us
    busy_ex, gap_ex = found.excess["compute"], found.excess["host_gap"]
    out = []
    for k in np.flatnonzero((busy_ex > tau["compute"]) | (gap_ex > tau["host_gap"])).tolist():
        row = int(found.rows[k])
        parts = {"compute": busy_ex[k], "host_gap": gap_ex[k]}
        significant = {c: x for c, x in parts.items() if x > tau[c][k]}
        cause = max(significant, key=significant.get)
        changes = {name: values[name][[row]].copy() for name in WORK}
        for c in significant:
            for name in _PARTS[c]:
                changes[name][0] = min(values[name][row], found.baseline[name][inst[row]])
        if cause == "host_gap" and found.excess["loader"][k] >= DATA_LOADING_SHARE * gap_ex[k]:
            cause = "data_loading"
        out.append(namer.name(row, row, cause, float(sum(significant.values())), changes))
    return out


def _comm_stragglers(found: _Excesses, namer: _Namer) -> list[Straggler]:
    """Ranks whose transfer ran long, named where the others then waited for them: the rank's
    next collective held back by it (its queue successor, or the collective its compute waited
    on it for), or the slow one itself when nothing was held back."""
    graph, inst = namer.graph, namer.matching.instance
    transfer = graph.values["transfer"]
    user = np.full(len(transfer), -1, np.int64)
    for refs in (graph.wait_on, graph.fifo):
        later = np.flatnonzero(refs >= 0)
        user[refs[later]] = later
    comm_ex = found.excess["comm"]
    out = []
    for k in np.flatnonzero(comm_ex > found.thresholds_us["comm"]).tolist():
        row = int(found.rows[k])
        at = int(user[row]) if user[row] >= 0 and inst[user[row]] >= 0 else row
        base = found.baseline["transfer"][inst[row]]
        changes = {"transfer": np.array([min(transfer[row], base)])}
        out.append(namer.name(row, at, "comm", float(comm_ex[k]), changes))
    return out


def find_stragglers(programs: list[RankProgram], *, what_if: bool = True) -> StragglerReport:
    """Match, align, attribute and cost the stragglers of a run (the module doc says how).

    Args:
        programs (list[RankProgram]): every rank's collectives and segments, as read from its
            trace (``analysis.analyze_run(..., programs=True)``).
        what_if (bool): also replay the what-if slowdowns (``WhatIf``). Defaults to True.

    Returns:
        StragglerReport: the stragglers, costliest first (then by step, rank); every cost is
        >= 0 and in ms; ``thresholds_us`` the median excess each cause needed.
    """
    matching = match(programs)
    graph = build_replay_graph(matching)
    index = _index_in_step(matching)
    found = _excesses(matching, graph, index)
    kinds, steps = matching.column("kind"), matching.column("step")
    namer = _Namer(matching, graph, found.baseline, index, kinds, steps)
    stragglers = _segment_stragglers(found, namer) + _comm_stragglers(found, namer)
    stragglers.sort(key=lambda x: (-x.cost_ms, x.step, x.rank))
    collectives = view(matching)
    replayed = what_if and matching.instances
    return StragglerReport(
        stragglers=stragglers,
        matching=matching,
        what_if=what_if_slowdowns(graph, matching, index, _cost_by_rank(stragglers))
        if replayed
        else None,
        waits=_waits(matching, collectives.wait_us, steps, stragglers),
        collectives=_collective_rows(matching, collectives, index, kinds, steps),
        thresholds_us={
            cause: float(np.median(tau)) if len(tau) else FLOOR_US
            for cause, tau in found.thresholds_us.items()
        },
    )


def _cost_by_rank(stragglers: list[Straggler]) -> dict[int, float]:
    """Per rank named, the summed cost of its stragglers (ms)."""
    cost: dict[int, float] = {}
    for straggler in stragglers:
        cost[straggler.rank] = cost.get(straggler.rank, 0.0) + straggler.cost_ms
    return cost


def _waits(
    matching: Matching, wait_us: np.ndarray, steps: np.ndarray, found: list[Straggler]
) -> np.ndarray:
    dtype = np.dtype([("rank", "i8"), ("step", "i8"), ("wait_ms", "f8"), ("cost_ms", "f8")])
    keys = sorted(
        {
            (int(r), int(st))
            for r, st in zip(matching.row_rank.tolist(), steps.tolist(), strict=True)
        }
    )
    where = {k: i for i, k in enumerate(keys)}
    out = np.zeros(len(keys), dtype)
    for i, (r, st) in enumerate(keys):
        out[i]["rank"], out[i]["step"] = r, st
    for r, st, w in zip(matching.row_rank.tolist(), steps.tolist(), wait_us.tolist(), strict=True):
        out["wait_ms"][where[(r, st)]] += w / 1e3
    for sgl in found:
        if (sgl.rank, sgl.step) in where:
            out["cost_ms"][where[(sgl.rank, sgl.step)]] += sgl.cost_ms
    return out


def _collective_rows(matching: Matching, collectives, index, kinds, steps) -> list[dict[str, Any]]:
    start, arrival = matching.aligned("start"), matching.aligned("arrival")
    out = []
    for i, rows in enumerate(matching.members):
        first = int(rows[0])
        out.append(
            {
                "step": int(steps[first]),
                "collective": _label(int(kinds[first]), int(index[first])),
                "last_arriver": int(collectives.last_arriver[i]),
                "transfer_ms": float(collectives.transfer_us[i]) / 1e3,
                "max_wait_ms": float(collectives.wait_us[rows].max()) / 1e3,
                "ranks": matching.row_rank[rows].tolist(),
                "arrival_us": arrival[rows].tolist(),
                "start_us": start[rows].tolist(),
                "wait_ms": (collectives.wait_us[rows] / 1e3).tolist(),
            }
        )
    out.sort(key=lambda r: (r["step"], r["collective"]))
    return out
