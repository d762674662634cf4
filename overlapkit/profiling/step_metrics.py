"""Exposed communication of every step of one rank, from its compact records, in array passes.

For each step, with ``comm`` the collectives assigned to the step (by launch on GPU, by start on
CPU) and ``compute`` the compute intervals assigned to it:

- ``compute_ms`` = |∪ compute|, ``comm_ms`` = |∪ comm|;
- ``exposed_comm_ms`` = |∪ comm ∖ ∪ all compute of the trace|: a collective of step N hidden
  behind step N+1's forward is hidden, and no interval is counted in two steps;
- ``tail_ms`` = the exposed part after the end of the step's last backward compute (when the
  trace has no backward, after the last compute that starts before the step's comm ends);
- ``overlap_ratio`` = 1 - exposed / comm (None for a step without communication).

Compute is a table of intervals with the time that assigns them to a step (``anchor``): on CPU
the main thread's busy time (the union of its operators, less the collectives' enqueue ops and
the waits overlapkit marks), on GPU the compute kernels, anchored at their launch.
``compute_table`` builds it block by block from the record tables, and ``step_rows`` computes
windows of steps at a time (all of them when nothing was spilled), each in a few array
operations whatever its number of steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from overlapkit.group.dim_labels import COMM_DIMS
from overlapkit.profiling import interval_arrays as ia
from overlapkit.profiling.comm_dims import DIM_CODE, comm_dims
from overlapkit.profiling.rank_trace import COLLECTIVE_KINDS, RankTrace
from overlapkit.profiling.record_store import RecordTable

COMPUTE_DTYPE = np.dtype(
    [("start", "f8"), ("end", "f8"), ("anchor", "f8"), ("backward", "?"), ("lane", "i4")]
)
STEP_DTYPE = np.dtype(
    [
        ("step", "i8"),
        ("start", "f8"),
        ("end", "f8"),
        ("compute_ms", "f8"),
        ("comm_ms", "f8"),
        ("exposed_comm_ms", "f8"),
        ("tail_ms", "f8"),
        ("tail_from", "f8"),
    ]
)
KIND_DTYPE = np.dtype(
    [
        ("step", "i8"),
        ("kind", "i4"),  # a COLLECTIVE_KINDS code; in the dims table, a COMM_DIMS code
        ("count", "i8"),
        ("bytes", "i8"),
        ("time_ms", "f8"),
        ("exposed_ms", "f8"),
    ]
)
_KIND_CODE = {kind: code for code, kind in enumerate(COLLECTIVE_KINDS)}


@dataclass(frozen=True, slots=True)
class StepLanes:
    """The intervals (µs) behind one step's numbers; what the timeline draws."""

    rank: int
    step: int
    file: str
    pid: object
    """The main thread's process id in the trace (where counter tracks are drawn)."""
    start: float
    end: float
    compute: list[tuple[float, float]]
    comm: list[tuple[float, float]]
    exposed: list[tuple[float, float]]
    tail_from: float | None
    """Where the tail starts (end of the last backward compute), µs; None without comm."""


def _rows(dtype: np.dtype, columns: dict[str, np.ndarray]) -> np.ndarray:
    n = len(next(iter(columns.values())))
    rows = np.zeros(n, dtype)
    for name, values in columns.items():
        rows[name] = values
    return rows


def _streamed_union(blocks: Iterator[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The union of the intervals of consecutive blocks, one block at a time.

    Kineto writes each thread's events in time order, so an interval of a later block can only
    merge with the last interval found so far, which is held back until it cannot grow. Blocks
    out of order (a hand-written trace) are all unioned at once instead.
    """
    pending: list[np.ndarray] = []
    carry_s = carry_e = None
    last_start = -np.inf
    for rows in blocks:
        if len(rows) == 0:
            continue
        if rows["start"].min() < last_start:  # out of order: union everything together
            pending.append(rows)
            continue
        if pending:
            pending.append(rows)
            continue
        last_start = float(rows["start"].max())
        s, e = rows["start"], rows["end"]
        if carry_s is not None:
            s, e = np.append(s, carry_s), np.append(e, carry_e)
        us, ue = ia.union(s, e)
        if len(us) == 0:
            continue
        carry_s, carry_e = us[-1], ue[-1]
        yield us[:-1], ue[:-1]
    if pending:
        rest = np.concatenate(pending)
        s, e = rest["start"], rest["end"]
        if carry_s is not None:
            s, e = np.append(s, carry_s), np.append(e, carry_e)
        yield ia.union(s, e)
    elif carry_s is not None:
        yield np.array([carry_s]), np.array([carry_e])


def _cpu_compute(trace: RankTrace, out: RecordTable) -> None:
    """The main thread's busy intervals: its operators' union less the enqueue ops' and the
    marked waits'; then its backward intervals, the same way (the table holds both; unions
    count them once)."""
    main = trace.main_thread
    enqueue = [(q.start, q.end) for q in trace.enqueues if q.thread == main]
    enqueue += [(start, end) for start, end, thread in trace.waits if thread == main]
    cut_s, cut_e = ia.union(
        np.array([s for s, _ in enqueue], float), np.array([e for _, e in enqueue], float)
    )
    for backward in (False, True):
        blocks = (
            rows[(rows["thread"] == main) & (rows["backward"] | (not backward))]
            for rows in trace.ops.iter_blocks()
        )
        for us, ue in _streamed_union(blocks):
            s, e = ia.subtract(us, ue, cut_s, cut_e)
            rows = _rows(COMPUTE_DTYPE, {"start": s, "end": e, "anchor": s})
            rows["backward"], rows["lane"] = backward, main
            out.append(rows)
    out.flush()


def _gpu_compute(trace: RankTrace, out: RecordTable) -> None:
    """Compute kernels anchored at their launch; backward when launched inside a backward op."""
    for kernels in trace.kernels.iter_blocks():
        corr = kernels["corr"]
        known = corr[corr >= 0]
        anchor = kernels["start"].copy()
        launch_thread = np.full(len(kernels), -1, np.int32)
        if len(known):
            launches = trace.launches.select("corr", float(known.min()), float(known.max()) + 1)
            order = np.argsort(launches["corr"], kind="stable")
            sorted_corr = launches["corr"][order]
            at = np.searchsorted(sorted_corr, corr)
            at_ok = np.minimum(at, max(len(sorted_corr) - 1, 0))
            hit = (at < len(sorted_corr)) & (sorted_corr[at_ok] == corr) & (corr >= 0)
            anchor[hit] = launches["start"][order][at_ok[hit]]
            launch_thread[hit] = launches["thread"][order][at_ok[hit]]
        backward = np.zeros(len(kernels), bool)
        launched = launch_thread >= 0
        if launched.any():
            lo, hi = anchor[launched].min(), anchor[launched].max()
            ops = trace.ops.overlapping(float(lo), float(np.nextafter(hi, np.inf)))
            ops = ops[ops["backward"]]
            for thread in np.unique(ops["thread"]):
                mine = ops[ops["thread"] == thread]
                s, e = ia.union(mine["start"], mine["end"])
                pick = launched & (launch_thread == thread)
                backward[pick] = ia.contains(s, e, anchor[pick])
        rows = _rows(
            COMPUTE_DTYPE,
            {
                "start": kernels["start"],
                "end": kernels["end"],
                "anchor": anchor,
                "backward": backward,
                "lane": kernels["stream"],
            },
        )
        out.append(rows)
    out.flush()


def compute_table(trace: RankTrace) -> RecordTable:
    """The trace's compute intervals with their anchors (see the module docstring)."""
    out = RecordTable(COMPUTE_DTYPE, ("start", "end", "anchor"), trace.store)
    (_gpu_compute if trace.device == "gpu" else _cpu_compute)(trace, out)
    return out


def _windows(trace: RankTrace, compute: RecordTable) -> Iterator[tuple[int, int]]:
    """Ranges of step indices to analyse together: all at once unless records were spilled,
    then as many steps as hold about a budget's worth of compute records."""
    n = len(trace.steps)
    if trace.store.spilled_bytes == 0 or n == 0:
        yield 0, n
        return
    per_step = max(1.0, len(compute) / n)
    size = max(1, int(trace.store.budget_bytes / (4 * COMPUTE_DTYPE.itemsize * per_step)))
    for first in range(0, n, size):
        yield first, min(n, first + size)


def _assign(anchor: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Index of the step window holding each anchor, or -1."""
    window = np.searchsorted(starts, anchor, side="right") - 1
    inside = (window >= 0) & (anchor < ends[np.maximum(window, 0)])
    return np.where(inside, window, -1)


def step_rows(
    trace: RankTrace, compute: RecordTable, lanes_for: set[int] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[StepLanes]]:
    """Per step numbers (``STEP_DTYPE``, ms), per step and kind stats (``KIND_DTYPE``), per step
    and parallel dimension stats (``KIND_DTYPE``, ``kind`` a ``COMM_DIMS`` code; ``comm_dims``
    says which collective served which), and the intervals of the steps numbered in
    ``lanes_for``."""
    steps = np.array([(n, s, e) for n, s, e in trace.steps], float).reshape(-1, 3)
    comm_start = np.array([op.start for op in trace.comm], float)
    comm_end = np.array([op.end for op in trace.comm], float)
    comm_anchor = np.array([op.anchor for op in trace.comm], float)
    comm_kind = np.array([_KIND_CODE[op.kind] for op in trace.comm], np.int64)
    comm_bytes = np.array([-1 if op.nbytes is None else op.nbytes for op in trace.comm], np.int64)
    comm_dim = np.array([DIM_CODE[d] for d in comm_dims(trace)], np.int64)
    out_steps, out_kinds, out_dims, lanes = [], [], [], []
    for first, last in _windows(trace, compute):
        window = steps[first:last]
        t0, t1 = window[:, 1].min(), window[:, 2].max()
        s_start, s_end = window[:, 1], window[:, 2]
        n = len(window)
        mine = compute.select("anchor", t0, t1)
        ci = _assign(mine["anchor"], s_start, s_end)
        keep = ci >= 0
        mine, ci = mine[keep], ci[keep]
        g, cs, ce = ia.grouped_union(ci, mine["start"], mine["end"])
        compute_us = np.bincount(g, weights=ce - cs, minlength=n)
        qi = _assign(comm_anchor, s_start, s_end)
        sel = qi >= 0
        q_i, q_s, q_e = qi[sel], comm_start[sel], comm_end[sel]
        kind, nbytes, dim = comm_kind[sel], comm_bytes[sel], comm_dim[sel]
        gq, us, ue = ia.grouped_union(q_i, q_s, q_e)
        comm_us = np.bincount(gq, weights=ue - us, minlength=n)
        # All compute near the window's comm, whatever its step: it hides comm too.
        if len(us):
            near = compute.overlapping(float(us.min()), float(ue.max()))
            all_s, all_e = ia.union(near["start"], near["end"])
            # The tail's fallback looks back for the last compute before the comm ends: over
            # the whole trace when it is analysed at once, over the window otherwise.
            lo = -np.inf if (first, last) == (0, len(steps)) else float(t0)
            wide = compute.overlapping(lo, float(ue.max()))
        else:
            all_s = all_e = np.empty(0)
            wide = np.empty(0, COMPUTE_DTYPE)
        cover = ia.Coverage(all_s, all_e)
        exposed_us = np.bincount(gq, weights=(ue - us) - cover.covered(us, ue), minlength=n)
        tail_from = _tail_from(mine, ci, gq, us, ue, n, wide)
        tf = tail_from[gq]
        ts = np.maximum(us, tf)
        tail_part = np.maximum(ue - ts, 0.0) - cover.covered(ts, np.maximum(ue, ts))
        tail_us = np.bincount(gq, weights=tail_part, minlength=n)
        out_steps.append(
            _rows(
                STEP_DTYPE,
                {
                    "step": window[:, 0].astype(np.int64),
                    "start": s_start,
                    "end": s_end,
                    "compute_ms": compute_us / 1e3,
                    "comm_ms": comm_us / 1e3,
                    "exposed_comm_ms": exposed_us / 1e3,
                    "tail_ms": tail_us / 1e3,
                    "tail_from": tail_from,
                },
            )
        )
        intervals = (q_i, q_s, q_e)
        out_kinds.append(_code_rows(window, intervals, kind, len(COLLECTIVE_KINDS), nbytes, cover))
        out_dims.append(_code_rows(window, intervals, dim, len(COMM_DIMS), nbytes, cover))
        if lanes_for:
            lanes += _lanes(
                trace, window, lanes_for, (ci, mine), (gq, us, ue), (all_s, all_e), tail_from
            )
    return (
        np.concatenate(out_steps) if out_steps else np.empty(0, STEP_DTYPE),
        np.concatenate(out_kinds) if out_kinds else np.empty(0, KIND_DTYPE),
        np.concatenate(out_dims) if out_dims else np.empty(0, KIND_DTYPE),
        lanes,
    )


def _tail_from(mine, ci, gq, us, ue, n, wide) -> np.ndarray:
    """Per step: the end of its last backward compute, else the end of the last compute that
    starts before its comm ends, else its first comm start (NaN without comm)."""
    tail_from = np.full(n, np.nan)
    has_comm = np.zeros(n, bool)
    has_comm[gq] = True
    bwd = mine["backward"]
    last_bwd = np.full(n, -np.inf)
    np.maximum.at(last_bwd, ci[bwd], mine["end"][bwd])
    with_bwd = np.isfinite(last_bwd) & has_comm
    tail_from[with_bwd] = last_bwd[with_bwd]
    rest = has_comm & ~with_bwd
    if rest.any():
        comm_last_end = np.full(n, -np.inf)
        np.maximum.at(comm_last_end, gq, ue)
        comm_first = np.full(n, np.inf)
        np.minimum.at(comm_first, gq, us)
        all_s, all_e = ia.union(wide["start"], wide["end"])
        found = ia.Coverage(all_s, all_e).last_end_before(comm_last_end[rest], comm_first[rest])
        tail_from[rest] = found
    return tail_from


def _code_rows(window, intervals, code, nk: int, nbytes, cover: ia.Coverage) -> np.ndarray:
    """Per step and code (a collective kind, a dimension; ``nk`` of them): count, bytes (-1
    when some are unknown), |∪ intervals| and the part of it no compute covers (ms)."""
    q_i, q_s, q_e = intervals
    key = q_i * nk + code
    count = np.bincount(key, minlength=len(window) * nk)
    known = np.bincount(key, weights=(nbytes >= 0).astype(float), minlength=len(window) * nk)
    total = np.bincount(
        key, weights=np.maximum(nbytes, 0).astype(float), minlength=len(window) * nk
    )
    g, s, e = ia.grouped_union(key, q_s, q_e)
    time_us = np.bincount(g, weights=e - s, minlength=len(window) * nk)
    exposed_us = np.bincount(g, weights=(e - s) - cover.covered(s, e), minlength=len(window) * nk)
    present = np.flatnonzero(count)
    return _rows(
        KIND_DTYPE,
        {
            "step": window[present // nk, 0].astype(np.int64),
            "kind": present % nk,
            "count": count[present],
            "bytes": np.where(known[present] == count[present], total[present], -1).astype(
                np.int64
            ),
            "time_ms": time_us[present] / 1e3,
            "exposed_ms": exposed_us[present] / 1e3,
        },
    )


def _lanes(trace, window, lanes_for, compute, comm, hiding, tail_from) -> list[StepLanes]:
    from overlapkit.profiling import intervals

    ci, mine = compute
    gq, us, ue = comm
    all_s, all_e = hiding
    out = []
    for i, (number, start, end) in enumerate(window):
        if int(number) not in lanes_for:
            continue
        chosen = mine[ci == i]
        cs, ce = ia.union(chosen["start"], chosen["end"])
        comm_list = list(zip(us[gq == i].tolist(), ue[gq == i].tolist(), strict=True))
        hide = list(zip(all_s.tolist(), all_e.tolist(), strict=True))
        exposed = intervals.subtract(comm_list, hide) if comm_list else []
        out.append(
            StepLanes(
                rank=trace.rank,
                step=int(number),
                file=trace.path.name,
                pid=trace.main_pid,
                start=float(start),
                end=float(end),
                compute=list(zip(cs.tolist(), ce.tolist(), strict=True)),
                comm=comm_list,
                exposed=exposed,
                tail_from=None if np.isnan(tail_from[i]) else float(tail_from[i]),
            )
        )
    return out
