"""Each collective matched across the ranks of its group, and every rank's clock aligned.

**Matching** (``match``): an NCCL collective is the rows of all ranks with the same
``(Process Group Name, Seq)``; a gloo collective the rows with the same group, step and
position among the rank's ``c10d::*`` enqueues of that step (``programs``). A collective whose
group's ranks are not all there (a trace missing, a rank whose collectives cannot be told apart)
is left unmatched, and so are all collectives of a program that ``programs`` could not identify;
``Matching.unmatched`` says how many and why.

**Clocks** (``align``): ranks on one host (the traces' ``host_name``) share its clock; between
hosts, the ranks of a collective leave it at about the same moment (the last data arrives
everywhere together), so each host's offset is found from the ends of the matched collectives:
alternately the common end of each collective (the median over its ranks of end less offset)
and each host's offset (the median over its ranks' collectives of end less common end), the
host of the lowest rank of each connected set of hosts fixed at 0. A trace without
``host_name`` is a host of its own. What remains, each end's distance
from its collective's common end, is the **residual skew**, reported per rank (median and
largest absolute value, µs). A rank whose transfers always end later (a link slower in every
collective) cannot be told from a clock offset by timestamps alone; it shows as a rank that
waits longer.

Per collective, on the aligned clock: every rank's ``arrival`` (when it enqueued), ``start``
(when its comm lane began it) and ``wait`` (the latest start less its own: the time it waited
for the others), the **last arriver** (latest start) and the **transfer** (the median over its
ranks of end less the latest start).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from overlapkit.profiling.programs import RankProgram

_ALIGN_ROUNDS = 8


def group_median(
    values: np.ndarray, groups: np.ndarray, count: int, *, lower: bool = False
) -> np.ndarray:
    """The median of ``values`` in each group ``0 .. count - 1`` (NaN for an empty group);
    with ``lower``, the lower of the two middle values of an even-sized group."""
    out = np.full(count, np.nan)
    if len(values) == 0:
        return out
    order = np.lexsort((values, groups))
    g, v = groups[order], values[order]
    sizes = np.bincount(g, minlength=count)
    first = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    present = sizes > 0
    lo = first + (sizes - 1) // 2
    hi = lo if lower else first + sizes // 2
    out[present] = (v[lo[present]] + v[hi[present]]) / 2
    return out


@dataclass(slots=True)
class Matching:
    """All programs' rows in one table, with the collective each belongs to."""

    programs: list[RankProgram]
    row_program: np.ndarray
    """Per global row, the index of its program."""
    row_rank: np.ndarray
    instance: np.ndarray
    """Per global row, its collective's index, or -1 when unmatched."""
    instances: int
    members: list[np.ndarray]
    """Per collective, its global rows."""
    first_row: np.ndarray
    """Per program, its first global row."""
    unmatched: dict[str, int] = field(default_factory=dict)
    """Why rows were left unmatched, and how many."""
    offsets_us: dict[int, float] = field(default_factory=dict)
    residual_us: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Per rank, (median, largest) |end less its collective's common end| after alignment."""

    def column(self, name: str) -> np.ndarray:
        """One field of every program's rows, concatenated (global row order)."""
        if not self.programs:
            return np.empty(0)
        return np.concatenate([p.rows[name] for p in self.programs])

    def aligned(self, name: str) -> np.ndarray:
        """A time field of every row on the aligned clock (µs)."""
        offsets = np.array([self.offsets_us.get(int(r), 0.0) for r in self.row_rank])
        return self.column(name) - offsets if len(offsets) else np.empty(0)


def _keys(programs: list[RankProgram]) -> tuple[list[tuple], list[str | None]]:
    """Per global row its identity key (None: unmatched) and, per program, why not."""
    keys: list[tuple | None] = []
    reasons: list[str | None] = []
    for prog in programs:
        reasons.append(prog.unmatched)
        rows = prog.rows
        if prog.unmatched is not None:
            keys += [None] * len(rows)
            continue
        names = [prog.groups[g] if g >= 0 else None for g in rows["group"].tolist()]
        if prog.device == "gpu":
            keys += [
                None if g is None or seq < 0 else ("nccl", g, seq)
                for g, seq in zip(names, rows["seq"].tolist(), strict=True)
            ]
        else:
            index: dict[int, int] = {}
            for g, step in zip(names, rows["step"].tolist(), strict=True):
                k = index.get(step, 0)
                index[step] = k + 1
                keys.append(None if g is None else ("gloo", g, step, k))
    return keys, reasons


def match(programs: list[RankProgram]) -> Matching:
    """Match every program's collectives across ranks (see the module docstring)."""
    keys, reasons = _keys(programs)
    sizes = [len(p.rows) for p in programs]
    row_program = np.repeat(np.arange(len(programs)), sizes)
    row_rank = np.repeat([p.rank for p in programs], sizes).astype(np.int64)
    first_row = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    unmatched: dict[str, int] = {}
    for prog, reason in zip(programs, reasons, strict=True):
        if reason is not None:
            unmatched[reason] = unmatched.get(reason, 0) + len(prog.rows)
    ids: dict[tuple, int] = {}
    instance = np.full(len(keys), -1, np.int64)
    for row, key in enumerate(keys):
        if key is not None:
            instance[row] = ids.setdefault(key, len(ids))
    # A collective needs every rank of its group, once.
    expected: dict[str, set[int]] = {}
    for prog in programs:
        for name, ranks in prog.group_ranks.items():
            expected.setdefault(name, set(ranks))
    names = list(ids)
    seen: dict[int, list[int]] = {}
    for row in np.flatnonzero(instance >= 0).tolist():
        seen.setdefault(int(instance[row]), []).append(row)
    keep = np.zeros(len(ids), bool)
    for inst, rows in seen.items():
        ranks = row_rank[rows].tolist()
        group = names[inst][1]
        want = expected.get(group, set(ranks))
        if len(set(ranks)) == len(ranks) == len(want) and set(ranks) == want and len(ranks) > 1:
            keep[inst] = True
        else:
            why = (
                f"group {group}: collectives seen on ranks that are not the whole group "
                f"(a trace missing or skipped?)"
                if len(ranks) > 1 or len(want) > 1
                else f"group {group} has one rank: nothing to wait for"
            )
            unmatched[why] = unmatched.get(why, 0) + len(rows)
    renumber = np.full(len(ids) + 1, -1, np.int64)
    renumber[np.flatnonzero(keep)] = np.arange(int(keep.sum()))
    instance = np.where(instance >= 0, renumber[instance], -1)
    count = int(keep.sum())
    order = np.argsort(instance, kind="stable")
    sorted_inst = instance[order]
    start = np.searchsorted(sorted_inst, np.arange(count))
    stop = np.searchsorted(sorted_inst, np.arange(count), side="right")
    members = [order[a:b] for a, b in zip(start.tolist(), stop.tolist(), strict=True)]
    matching = Matching(
        programs=programs,
        row_program=row_program,
        row_rank=row_rank,
        instance=instance,
        instances=count,
        members=members,
        first_row=first_row,
        unmatched=unmatched,
    )
    align(matching)
    return matching


def align(matching: Matching) -> None:
    """Estimate every rank's clock offset from the matched collectives' ends (in place)."""
    host_of = {}
    for p in sorted(matching.programs, key=lambda p: p.rank):
        host_of.setdefault(p.rank, p.host if p.host is not None else f"rank {p.rank}")
    ranks = sorted(host_of)
    hosts = list(dict.fromkeys(host_of[r] for r in ranks))  # in order of their lowest rank
    host_index = {h: i for i, h in enumerate(hosts)}
    rank_index = {r: i for i, r in enumerate(ranks)}
    matched = matching.instance >= 0
    if not matched.any():
        matching.offsets_us = {r: 0.0 for r in ranks}
        return
    ends = matching.column("end")[matched]
    inst = matching.instance[matched]
    who = np.array([rank_index[int(r)] for r in matching.row_rank[matched]])
    where = np.array([host_index[host_of[int(r)]] for r in matching.row_rank[matched]])
    offsets = np.zeros(len(hosts))
    anchors = _component_anchors(where, inst, len(hosts), matching.instances)
    for _ in range(_ALIGN_ROUNDS if len(hosts) > 1 else 0):
        common = group_median(ends - offsets[where], inst, matching.instances)
        shift = group_median(ends - common[inst] - offsets[where], where, len(hosts))
        offsets += np.nan_to_num(shift)
        offsets -= offsets[anchors]
    common = group_median(ends - offsets[where], inst, matching.instances)
    residual = np.abs(ends - offsets[where] - common[inst])
    matching.offsets_us = {r: float(offsets[host_index[host_of[r]]]) for r in ranks}
    med = group_median(residual, who, len(ranks))
    largest = np.zeros(len(ranks))
    np.maximum.at(largest, who, residual)
    matching.residual_us = {
        r: (float(np.nan_to_num(med[i])), float(largest[i])) for r, i in rank_index.items()
    }


def _component_anchors(who: np.ndarray, inst: np.ndarray, ranks: int, instances: int) -> np.ndarray:
    """Per host (``who``: each row's), the first host it is connected to through collectives."""
    parent = list(range(ranks))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first = np.full(instances, -1)
    for w, i in zip(who.tolist(), inst.tolist(), strict=True):
        if first[i] < 0:
            first[i] = w
        else:
            a, b = find(w), find(int(first[i]))
            if a != b:
                parent[max(a, b)] = min(a, b)
    return np.array([find(r) for r in range(ranks)])


@dataclass(slots=True)
class CollectiveView:
    """Per matched collective, on the aligned clock (µs): see the module docstring."""

    last_arriver: np.ndarray
    latest_start: np.ndarray
    transfer_us: np.ndarray
    wait_us: np.ndarray
    """Per global row: the latest start of its collective less its own (0 when unmatched)."""


def view(matching: Matching) -> CollectiveView:
    """Last arrivers, transfers and waits of every matched collective."""
    start, end = matching.aligned("start"), matching.aligned("end")
    count = matching.instances
    matched = matching.instance >= 0
    inst = matching.instance[matched]
    latest = np.full(count, -np.inf)
    np.maximum.at(latest, inst, start[matched])
    last = np.full(count, -1, np.int64)
    is_last = start[matched] >= latest[inst]
    rows = np.flatnonzero(matched)[is_last]
    last[matching.instance[rows]] = matching.row_rank[rows]
    transfer = group_median(end[matched] - latest[inst], inst, count)
    wait = np.zeros(len(start))
    wait[matched] = latest[inst] - start[matched]
    return CollectiveView(
        last_arriver=last, latest_start=latest, transfer_us=transfer, wait_us=wait
    )
