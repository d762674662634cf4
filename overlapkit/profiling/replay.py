"""Replaying a run's collectives with some work changed: the time a what-if run would take.

The model, built from the ranks' programs (``programs``) on the aligned clock (``collectives``):
each rank runs its segments in order; a segment's work (``busy + gap``, before and after its wait)
follows the previous arrival, and where the rank waited for one of its collectives, the work after
the wait also follows that collective's end; a collective starts on a rank once it is enqueued and,
if its comm lane is a queue, the previous one there has ended, plus the rank's observed latency; it
ends on every rank its own transfer after the last rank started it (``X``, observed); the last step
ends after the tail work. With the observed work and transfers the replay gives back the observed
timeline (``ReplayGraph.check``: to float precision); with some work or transfers changed it gives
the run that would have been, as far as this dependency graph goes (the what-if of Lin et al., OSDI
'25).

Waits are part of the program, the same on every rank: a rank's wait (confirmed by
``programs`` or not: the lane may have gone on late, a wait and then a host gap) is kept where
at least half of the collective's other ranks (of the cycle's other programs, for the tail)
have one on the same collective there and one of them is confirmed; elsewhere (an idle stretch
that merely held an end) it is folded into the segment's work before it.

``ReplayGraph.run`` replays everything; ``ReplayGraph.delta`` replays from one collective on and
stops once every later dependency is shifted by the same amount (the usual case a collective or two
later), which makes the cost of one straggler cheap on a thousand ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from overlapkit.profiling.collectives import Matching

WORK = ("busy_pre", "gap_pre", "busy_post", "gap_post")
"""The per-row work a scenario may change (µs); with ``transfer``, the values of a row."""
VALUES = (*WORK, "transfer")
SETTLED_SHIFT = 1e-6
"""``delta`` stops replaying once every live row is shifted by the same amount, to this share of
the shift (of 1 µs at least): what float64 sums of µs round away, far below any delay a trace
can show."""


@dataclass(slots=True)
class _Times:
    """Per row, replayed: arrival (enqueued), start and end of its collective, µs."""

    arrival: np.ndarray
    start: np.ndarray
    end: np.ndarray


@dataclass(slots=True)
class ReplayGraph:
    """The dependency graph of a run and its observed values (global rows of ``Matching``)."""

    order: list[np.ndarray]
    """Groups of rows replayed together, in a dependency order: each matched collective's rows,
    and each unmatched row on its own."""
    synced: np.ndarray
    """Per group, whether it is a matched collective (its end waits for its last start)."""
    prev: np.ndarray
    wait_on: np.ndarray
    fifo: np.ndarray
    latency: np.ndarray
    values: dict[str, np.ndarray]
    """Per row: ``WORK`` parts and ``transfer`` (end less the collective's last start)."""
    row_start: np.ndarray
    """Per row, its program's start (used where ``prev`` is -1)."""
    tail_row: np.ndarray
    """Per program, its last row (-1 without rows)."""
    tail: dict[str, np.ndarray]
    """Per program, its tail's ``WORK`` parts."""
    tail_wait: np.ndarray
    program_start: np.ndarray
    cycle: np.ndarray
    """Per program, its cycle (programs with the same steps)."""
    observed: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    """Observed arrival, start, end per row and end per program (aligned µs)."""
    position: np.ndarray
    """Per row, the index in ``order`` of its group."""
    full: np.ndarray
    """Per group, whether every program of its cycle takes part."""
    crossing: dict[int, np.ndarray]
    """Per full group, the earlier rows whose end a later row still reads."""

    def total(self, ends: np.ndarray) -> float:
        """The run's time: per cycle, its last end less its first start, summed (µs)."""
        total = 0.0
        for c in np.unique(self.cycle):
            mine = self.cycle == c
            total += float(ends[mine].max() - self.program_start[mine].min())
        return total

    def _group(self, rows: np.ndarray, group: int, times: _Times, values: dict) -> None:
        """Replay the rows of ``group`` (one collective, or one unmatched row) into ``times``."""
        prev = self.prev[rows]
        base = np.where(prev >= 0, times.arrival[np.maximum(prev, 0)], self.row_start[rows])
        post = values["busy_post"][rows] + values["gap_post"][rows]
        arrival = base + values["busy_pre"][rows] + values["gap_pre"][rows] + post
        wait_on = self.wait_on[rows]
        waits = wait_on >= 0
        if waits.any():
            waited = times.end[wait_on[waits]] + post[waits]
            arrival[waits] = np.maximum(arrival[waits], waited)
        fifo = self.fifo[rows]
        begin = arrival.copy()
        queued = fifo >= 0
        if queued.any():
            begin[queued] = np.maximum(begin[queued], times.end[fifo[queued]])
        begin += self.latency[rows]
        times.arrival[rows], times.start[rows] = arrival, begin
        last_start = begin.max() if self.synced[group] else begin
        times.end[rows] = last_start + values["transfer"][rows]

    def _ends(self, times: _Times, tail: dict[str, np.ndarray]) -> np.ndarray:
        """Per program, the end of its tail work after its last row."""
        last = self.tail_row
        post = tail["busy_post"] + tail["gap_post"]
        base = np.where(last >= 0, times.arrival[np.maximum(last, 0)], self.program_start)
        ends = base + tail["busy_pre"] + tail["gap_pre"] + post
        wait_on = self.tail_wait
        waits = wait_on >= 0
        ends[waits] = np.maximum(ends[waits], times.end[wait_on[waits]] + post[waits])
        return ends

    def _timeline(self, values: dict[str, np.ndarray]) -> _Times:
        rows = len(self.prev)
        times = _Times(np.zeros(rows), np.zeros(rows), np.zeros(rows))
        for group, members in enumerate(self.order):
            self._group(members, group, times, values)
        return times

    def with_changes(self, changes: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """The per-row values with ``changes`` (full arrays by name) put in."""
        return {**self.values, **(changes or {})}

    def run(
        self,
        changes: dict[str, np.ndarray] | None = None,
        tail: dict[str, np.ndarray] | None = None,
    ) -> float:
        """The run's time (µs) with these per-row values and tail work (default: observed)."""
        times = self._timeline(self.with_changes(changes))
        return self.total(self._ends(times, {**self.tail, **(tail or {})}))

    def check(self) -> float:
        """The largest difference (µs) between the replayed and the observed timeline."""
        times = self._timeline(self.values)
        arrival, start, end, ends = self.observed
        pairs = ((times.arrival, arrival), (times.start, start), (times.end, end))
        worst = max(
            (float(np.abs(replayed - seen).max()) for replayed, seen in pairs if len(replayed)),
            default=0.0,
        )
        return max(worst, float(np.abs(self._ends(times, self.tail) - ends).max()))

    def delta(self, rows: np.ndarray, changes: dict[str, np.ndarray]) -> float:
        """How much shorter (µs) the run is with ``rows`` given these values (by name, one per
        row); replays from the first changed row until every dependency is shifted alike."""
        arrival, start, end, ends = self.observed
        times = _Times(arrival.copy(), start.copy(), end.copy())
        values = dict(self.values)
        for name, new in changes.items():
            values[name] = values[name].copy()
            values[name][rows] = new
        first, last = int(self.position[rows].min()), int(self.position[rows].max())
        for group in range(first, len(self.order)):
            members = self.order[group]
            self._group(members, group, times, values)
            if not self.full[group] or group < last:
                continue
            live = np.concatenate((members, self.crossing.get(group, np.empty(0, np.int64))))
            shift = np.concatenate(
                (times.arrival[members] - arrival[members], times.end[live] - end[live])
            )
            if np.ptp(shift) <= SETTLED_SHIFT * max(1.0, abs(float(shift[0]))):
                return -float(shift[0])
        return self.total(ends) - self.total(self._ends(times, self.tail))


def build_replay_graph(matching: Matching) -> ReplayGraph:
    """The dependency graph of the matched programs (see the module docstring)."""
    programs = matching.programs
    first = matching.first_row
    n_rows = len(matching.row_rank)
    offsets = {p: matching.offsets_us.get(prog.rank, 0.0) for p, prog in enumerate(programs)}
    shift = np.array([offsets[p] for p in matching.row_program.tolist()]) if n_rows else np.zeros(0)
    arrival, start, end = (
        matching.column("arrival") - shift,
        matching.column("start") - shift,
        matching.column("end") - shift,
    )
    local = np.arange(n_rows) - first[matching.row_program] if n_rows else np.zeros(0, np.int64)
    prev = np.where(local > 0, np.arange(n_rows) - 1, -1)
    wait_on = _global(matching.column("wait_on"), matching.row_program, first)
    fifo = _global(matching.column("fifo_prev"), matching.row_program, first)
    ready = np.where(fifo >= 0, np.maximum(arrival, end[np.maximum(fifo, 0)]), arrival)
    latency = start - ready
    matched = matching.instance >= 0
    latest = np.full(max(matching.instances, 1), -np.inf)
    if matched.any():
        np.maximum.at(latest, matching.instance[matched], start[matched])
    transfer = np.where(matched, end - latest[np.maximum(matching.instance, 0)], end - start)
    values = {name: matching.column(name) for name in WORK} | {"transfer": transfer}
    wait_on = _settle_waits(
        matching, wait_on, matching.column("confirmed"), matching.column("wait"), values
    )
    row_start = np.array(
        [programs[p].cycle_start - offsets[p] for p in matching.row_program.tolist()]
    )
    groups, synced, keys = [], [], []
    for rows in matching.members:
        groups.append(rows)
        synced.append(True)
        keys.append(float(start[rows].max()))
    for row in np.flatnonzero(~matched).tolist():
        groups.append(np.array([row]))
        synced.append(False)
        keys.append(float(start[row]))
    order = _dependency_order(groups, keys, (prev, wait_on, fifo), n_rows)
    groups = [groups[i] for i in order]
    synced = np.array([synced[i] for i in order], bool)
    position = np.zeros(n_rows, np.int64)
    for group, rows in enumerate(groups):
        position[rows] = group
    tail_row = np.array(
        [first[p] + len(prog.rows) - 1 if len(prog.rows) else -1 for p, prog in enumerate(programs)]
    )
    tails = [prog.tail[0] for prog in programs]
    tail_wait = np.array(
        [first[p] + t["wait_on"] if t["wait_on"] >= 0 else -1 for p, t in enumerate(tails)],
        np.int64,
    )
    tail = {name: np.array([t[name] for t in tails], float) for name in WORK}
    tail_wait = _settle_tail_waits(matching, programs, tails, tail_wait, tail)
    program_start = np.array([prog.cycle_start - offsets[p] for p, prog in enumerate(programs)])
    ends = np.array([prog.cycle_end - offsets[p] for p, prog in enumerate(programs)])
    cycle_ids = {}
    cycle = np.array([cycle_ids.setdefault(tuple(prog.steps), len(cycle_ids)) for prog in programs])
    graph = ReplayGraph(
        order=groups,
        synced=synced,
        prev=prev,
        wait_on=wait_on,
        fifo=fifo,
        latency=latency,
        values=values,
        row_start=row_start,
        tail_row=tail_row,
        tail=tail,
        tail_wait=tail_wait,
        program_start=program_start,
        cycle=cycle,
        observed=(arrival, start, end, ends),
        position=position,
        full=np.zeros(len(groups), bool),
        crossing={},
    )
    _barriers(graph, matching)
    return graph


def _fold(values: dict[str, np.ndarray], at: np.ndarray, wait: np.ndarray) -> None:
    """Make the rows ``at`` one part of work: no wait, the waited time a host gap (in place)."""
    values["busy_pre"][at] += values["busy_post"][at]
    values["gap_pre"][at] += wait[at] + values["gap_post"][at]
    values["busy_post"][at] = values["gap_post"][at] = 0.0


def _structural(groups: list, target: list[int], confirmed: list[bool], size: dict) -> list[bool]:
    """Per candidate wait (``groups[i]`` its collective or cycle, ``target[i]`` the collective
    waited on, -1 none): whether at least half of the group's other members have a candidate
    wait on the same collective and one of them, or itself, is confirmed."""
    candidates: dict[tuple, int] = {}
    sure: dict[tuple, int] = {}
    for group, waited, is_confirmed in zip(groups, target, confirmed, strict=True):
        if waited >= 0:
            candidates[(group, waited)] = candidates.get((group, waited), 0) + 1
            sure[(group, waited)] = sure.get((group, waited), 0) + int(is_confirmed)
    keep = []
    for group, waited in zip(groups, target, strict=True):
        others = candidates.get((group, waited), 0) - 1
        keep.append(
            waited >= 0
            and others >= 1
            and 2 * others >= size[group] - 1
            and sure[(group, waited)] >= 1
        )
    return keep


def _settle_waits(matching: Matching, wait_on, confirmed, wait, values) -> np.ndarray:
    """Keep a rank's wait where it is structural (``_structural``: the collective's ranks
    wait there too), fold the others (see the module docstring)."""
    inst = matching.instance
    has = (wait_on >= 0) & (inst >= 0)
    waited = np.where(has, inst[np.maximum(wait_on, 0)], -1)
    waited = np.where(has, waited, -1)
    size = {i: len(rows) for i, rows in enumerate(matching.members)}
    size[-1] = 0
    keep = np.array(_structural(inst.tolist(), waited.tolist(), confirmed.tolist(), size), bool)
    keep &= has
    _fold(values, np.flatnonzero((wait_on >= 0) & ~keep), wait)
    return np.where(keep, wait_on, -1)


def _settle_tail_waits(matching: Matching, programs, tails, tail_wait, tail) -> np.ndarray:
    """``_settle_waits`` for the programs' tails, the programs of a cycle voting."""
    cycle = [tuple(p.steps) for p in programs]
    target = np.where(tail_wait >= 0, matching.instance[np.maximum(tail_wait, 0)], -1)
    confirmed = [bool(t["confirmed"]) for t in tails]
    size: dict[tuple, int] = {}
    for c in cycle:
        size[c] = size.get(c, 0) + 1
    keep = np.array(_structural(cycle, target.tolist(), confirmed, size), bool) & (tail_wait >= 0)
    wait = np.array([t["wait"] for t in tails], float)
    _fold(tail, np.flatnonzero((tail_wait >= 0) & ~keep), wait)
    return np.where(keep, tail_wait, -1)


def _dependency_order(groups: list[np.ndarray], keys: list[float], refs, n: int) -> list[int]:
    """Groups ordered so that every row comes after the rows it depends on: by the time they
    started, or, where that order breaks a dependency, topologically."""
    order = np.argsort(keys, kind="stable")
    group_of = np.zeros(n, np.int64)
    for g, rows in enumerate(groups):
        group_of[rows] = g
    rank_of = np.empty(len(groups), np.int64)
    rank_of[order] = np.arange(len(groups))
    edges = [
        (group_of[ref[rows]], group_of[rows]) for ref in refs for rows in [np.flatnonzero(ref >= 0)]
    ]
    src = np.concatenate([s for s, _ in edges]) if edges else np.zeros(0, np.int64)
    dst = np.concatenate([d for _, d in edges]) if edges else np.zeros(0, np.int64)
    if not len(src) or (rank_of[src] < rank_of[dst]).all():
        return order.tolist()
    # Kahn's algorithm, taking the earliest-starting ready group first.
    import heapq

    outgoing: dict[int, list[int]] = {}
    indegree = np.zeros(len(groups), np.int64)
    for a, b in set(zip(src.tolist(), dst.tolist(), strict=True)):
        if a != b:
            outgoing.setdefault(a, []).append(b)
            indegree[b] += 1
    ready = [(keys[g], g) for g in np.flatnonzero(indegree == 0).tolist()]
    heapq.heapify(ready)
    out = []
    while ready:
        _, g = heapq.heappop(ready)
        out.append(g)
        for b in outgoing.get(g, []):
            indegree[b] -= 1
            if indegree[b] == 0:
                heapq.heappush(ready, (keys[b], b))
    if len(out) != len(groups):  # a cycle: the programs disagree; keep the time order
        return order.tolist()
    return out


def _global(local: np.ndarray, row_program: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Row indices within a program made global (-1 stays -1)."""
    return np.where(local >= 0, first[row_program] + local, -1).astype(np.int64)


def _barriers(graph: ReplayGraph, matching: Matching) -> None:
    """Mark the groups every program of their cycle takes part in, and the earlier rows still
    read after each (``ReplayGraph.delta`` stops at such a group once all of them shift alike)."""
    programs_of_cycle = {c: int((graph.cycle == c).sum()) for c in np.unique(graph.cycle)}
    for g, rows in enumerate(graph.order):
        if graph.synced[g]:
            progs = matching.row_program[rows]
            cycle = graph.cycle[progs[0]]
            graph.full[g] = len(np.unique(progs)) == programs_of_cycle[cycle]
    src, dst = [], []
    for refs in (graph.wait_on, graph.fifo):
        users = np.flatnonzero(refs >= 0)
        src.append(refs[users])
        dst.append(graph.position[users])
    src.append(graph.tail_wait[graph.tail_wait >= 0])
    dst.append(np.full(int((graph.tail_wait >= 0).sum()), len(graph.order)))
    src, dst = np.concatenate(src), np.concatenate(dst)
    at = graph.position[src] if len(src) else np.zeros(0, np.int64)
    full = np.flatnonzero(graph.full)
    lo = np.searchsorted(full, at, side="left")
    hi = np.searchsorted(full, dst, side="left")
    for k in np.flatnonzero(hi > lo).tolist():
        for g in full[lo[k] : hi[k]].tolist():
            graph.crossing.setdefault(g, []).append(int(src[k]))
    graph.crossing = {g: np.array(v, np.int64) for g, v in graph.crossing.items()}
