"""What one rank did between its collectives: the program the what-if replay runs again.

For each collective of the rank, in enqueue order (``RankProgram.rows``, times in µs on the
rank's own clock):

- ``arrival``: when the rank handed the collective over: the ``c10d::*`` op's start on gloo;
  on GPU the later of its launch and the end of the last compute kernel launched before it
  (the collective's stream waits for that work);
- ``start`` / ``end``: when its comm lane ran it (the ``gloo:*`` range, the NCCL kernel);
- the **segment** before it, from the previous arrival (or the profiled cycle's first step
  start) to this one. Where an earlier collective of the rank ended while its compute lane
  idled in the segment (``wait_on``: the latest such), the lane may have been waiting for it:
  the segment is cut at that end into the work before the idle stretch (``*_pre``), the idle
  time up to the end (``wait``) and the work from the end on (``*_post``), and ``confirmed``
  says whether the lane went on within ``WAIT_SLACK_US`` of the end (its wake-up). Whether an
  unconfirmed one was a wait followed by a host gap is for the replay to decide, from what the
  other ranks did (``replay``). Each part is split into ``busy`` (the compute lane: main-thread
  operators on CPU, compute kernels on GPU) and ``gap`` (idle: the host gap). ``loader`` is
  the part of the idle time (waits included) a DataLoader range covers; ``top_op`` /
  ``top_us`` the ``TOP_OPS`` operators or kernels that ran longest in the segment;
- ``fifo_prev``: the previous collective on the same comm lane (a stream, a gloo worker thread:
  each runs its collectives one after another), -1 for the first, or where this one started
  before that one ended (then the lane is not a queue).

``tail`` holds the same split for the time after the last collective to the end of the
cycle's last step.

**Identity** across ranks (``group``, ``seq``): NCCL's ``Process Group Name`` and ``Seq``; on gloo
the group is the only group of more than one rank that ``pg_config`` lists for the rank, and
``seq`` the position of the ``c10d::*`` op among the rank's enqueues in the cycle. Where that
cannot be told (no metadata, several such groups, c10d ops and gloo ranges that do not pair up)
``group`` is -1 and ``unmatched`` says why: never autograd's ``Sequence number``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from overlapkit.profiling import interval_arrays as ia
from overlapkit.profiling.rank_trace import COLLECTIVE_KINDS, RankTrace
from overlapkit.profiling.record_store import RecordTable

TOP_OPS = 5
WAIT_SLACK_US = {"cpu": 3000.0, "gpu": 50.0}
_FIFO_SLACK_US = {"cpu": 50.0, "gpu": 1.0}
_KIND_CODE = {kind: code for code, kind in enumerate(COLLECTIVE_KINDS)}

ROW_DTYPE = np.dtype(
    [
        ("step", "i8"),
        ("kind", "i4"),
        ("bytes", "i8"),
        ("group", "i4"),
        ("seq", "i8"),
        ("arrival", "f8"),
        ("start", "f8"),
        ("end", "f8"),
        ("prev", "f8"),
        ("busy_pre", "f8"),
        ("gap_pre", "f8"),
        ("busy_post", "f8"),
        ("gap_post", "f8"),
        ("loader", "f8"),
        ("wait", "f8"),
        ("wait_on", "i4"),
        ("confirmed", "?"),
        ("fifo_prev", "i4"),
        ("lane", "i4"),
        ("top_op", "i4", (TOP_OPS,)),
        ("top_us", "f8", (TOP_OPS,)),
    ]
)


@dataclass(slots=True)
class RankProgram:
    """One trace file's collectives and the segments between them (see the module docstring)."""

    rank: int
    file: str
    device: str
    rows: np.ndarray
    """``ROW_DTYPE``, one row per collective, in enqueue order."""
    cycle_start: float
    cycle_end: float
    tail: np.ndarray
    """One ``ROW_DTYPE`` row for the time after the last collective (``arrival`` = cycle end)."""
    groups: list[str]
    """Group name of each group code in ``rows["group"]``."""
    group_ranks: dict[str, list[int]]
    names: list[str]
    """Operator / kernel name of each code in ``top_op``."""
    steps: list[int]
    host: str | None = None
    """Where the rank ran (``host_name``); ranks of one host share a clock."""
    unmatched: str | None = None
    """Why the collectives cannot be matched across ranks (None when they can)."""
    warnings: list[str] = field(default_factory=list)


def _gloo_identity(trace: RankTrace) -> tuple[str | None, str | None]:
    """The one multi-rank group of this gloo rank, or None and the reason."""
    if not trace.groups:
        return None, "the trace has no distributedInfo.pg_config, so its gloo groups are unknown"
    multi = [g for g in trace.groups if len(g["ranks"]) > 1 and trace.rank in g["ranks"]]
    if len(multi) == 1:
        return multi[0]["pg_name"], None
    if not multi:
        return None, f"rank {trace.rank} is in no gloo group of more than one rank"
    names = ", ".join(g["pg_name"] for g in multi)
    return None, (
        f"rank {trace.rank} is in {len(multi)} gloo groups of more than one rank ({names}); "
        "a gloo trace does not say which group a c10d op ran on"
    )


def _collectives(trace: RankTrace, compute: np.ndarray) -> tuple[list[tuple], str | None]:
    """``(arrival, start, end, kind, bytes, group, seq, lane)`` per collective, and why they
    cannot be matched (None when they can)."""
    if trace.device == "cpu":
        group, reason = _gloo_identity(trace)
        gloo = sorted(trace.comm, key=lambda op: op.start)
        enq = [
            q
            for q in trace.enqueues
            if q.thread == trace.main_thread and q.name.startswith("c10d::")
        ]
        enq.sort(key=lambda q: q.start)
        if reason is None and len(enq) != len(gloo):
            reason = (
                f"rank {trace.rank}: {len(enq)} c10d ops on the main thread but {len(gloo)} "
                "gloo ranges; the enqueue order cannot be paired with the work"
            )
        if reason is None:
            for q, op in zip(enq, gloo, strict=True):
                if q.elements is not None and op.elements is not None and q.elements != op.elements:
                    reason = (
                        f"rank {trace.rank}: the c10d op at {q.start:.1f} us hands over "
                        f"{q.elements} elements but the gloo range paired with it has "
                        f"{op.elements}"
                    )
                    break
        pairs = zip(enq, gloo, strict=True) if reason is None else ((op, op) for op in gloo)
        out = []
        for seq, (q, op) in enumerate(pairs):
            arrival = min(q.start, op.start)
            out.append((arrival, op.start, op.end, op.kind, op.nbytes, group, seq, op.lane))
        return out, reason
    order = np.argsort(compute["anchor"], kind="stable")
    anchors, ends = compute["anchor"][order], compute["end"][order]
    out, missing = [], 0
    for op in sorted(trace.comm, key=lambda op: op.anchor):
        k = np.searchsorted(anchors, op.anchor, side="left") - 1
        ready = max(op.anchor, float(ends[k])) if k >= 0 else op.anchor
        missing += op.group is None or op.seq is None
        out.append(
            (min(ready, op.start), op.start, op.end, op.kind, op.nbytes, op.group, op.seq, op.lane)
        )
    reason = None
    if missing:
        reason = (
            f"rank {trace.rank}: {missing} of {len(out)} NCCL collectives carry no "
            '"Process Group Name" and "Seq" (older torch, or point-to-point ops)'
        )
    return out, reason


def _segment_ops(trace: RankTrace, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per segment (``bounds[i]`` to ``bounds[i + 1]``), the ``TOP_OPS`` names that ran longest
    in it (code, µs; -1 / 0 when fewer ran)."""
    n = len(bounds) - 1
    keys, sums = [], []
    source = trace.kernels if trace.device == "gpu" else trace.ops
    for rows in source.iter_blocks():
        if trace.device == "cpu":
            rows = rows[rows["thread"] == trace.main_thread]
        seg = np.searchsorted(bounds, rows["start"], side="right") - 1
        in_segment = (seg >= 0) & (seg < n)
        key = seg[in_segment].astype(np.int64) * (1 << 32) + rows["name"][in_segment]
        unique, inverse = np.unique(key, return_inverse=True)
        keys.append(unique)
        sums.append(np.bincount(inverse, weights=(rows["end"] - rows["start"])[in_segment]))
    top_op = np.full((n, TOP_OPS), -1, np.int32)
    top_us = np.zeros((n, TOP_OPS))
    if not keys:
        return top_op, top_us
    unique, inverse = np.unique(np.concatenate(keys), return_inverse=True)
    total = np.bincount(inverse, weights=np.concatenate(sums))
    seg, name = unique >> 32, unique & 0xFFFFFFFF
    order = np.lexsort((-total, seg))
    seg, name, total = seg[order], name[order], total[order]
    first = np.searchsorted(seg, seg, side="left")
    rank_in_seg = np.arange(len(seg)) - first
    pick = rank_in_seg < TOP_OPS
    top_op[seg[pick], rank_in_seg[pick]] = name[pick]
    top_us[seg[pick], rank_in_seg[pick]] = total[pick]
    return top_op, top_us


def rank_program(trace: RankTrace, compute: RecordTable) -> RankProgram:
    """The rank's collectives and segments (see the module docstring)."""
    lanes = compute.all()
    busy_rows = lanes if trace.device == "gpu" else lanes[~lanes["backward"]]
    busy_s, busy_e = ia.union(busy_rows["start"], busy_rows["end"])
    busy = ia.Coverage(busy_s, busy_e)
    cycle_start = trace.steps[0][1] if trace.steps else 0.0
    cycle_end = max(end for _, _, end in trace.steps) if trace.steps else 0.0
    found, unmatched = _collectives(trace, busy_rows)
    groups = sorted({g for *_, g, _, _ in found if g is not None}) if unmatched is None else []
    group_code = {g: i for i, g in enumerate(groups)}
    n = len(found)
    rows = np.zeros(n, ROW_DTYPE)
    rows["top_op"] = -1
    if n:
        cols = list(zip(*found, strict=True))
        rows["arrival"], rows["start"], rows["end"] = cols[0], cols[1], cols[2]
        rows["kind"] = [_KIND_CODE[k] for k in cols[3]]
        rows["bytes"] = [-1 if b is None else b for b in cols[4]]
        rows["group"] = [group_code.get(g, -1) if unmatched is None else -1 for g in cols[5]]
        rows["seq"] = [-1 if s is None else s for s in cols[6]]
        lane_ids = {lane: i for i, lane in enumerate(dict.fromkeys(cols[7]))}
        rows["lane"] = [lane_ids[lane] for lane in cols[7]]
    starts = np.array([s for _, s, _ in trace.steps])
    numbers = np.array([number for number, _, _ in trace.steps])
    step_of = np.searchsorted(starts, rows["arrival"], side="right") - 1
    rows["step"] = np.where(step_of >= 0, numbers[np.maximum(step_of, 0)], -1) if n else []
    # One compute lane hands collectives over in order, so arrivals never go back.
    rows["arrival"] = np.maximum.accumulate(np.maximum(rows["arrival"], cycle_start)) if n else []
    bounds = np.concatenate(([cycle_start], rows["arrival"], [max(cycle_end, cycle_start)]))
    bounds = np.maximum.accumulate(bounds)
    seg_lo, seg_hi = bounds[:-1], bounds[1:]
    segs = _segments(busy, rows["end"], seg_lo, seg_hi, WAIT_SLACK_US[trace.device])
    idle = segs["gap_pre"] + segs["gap_post"] + segs["wait"]
    segs["loader"] = np.minimum(_loader_cover(trace, seg_lo, seg_hi, busy), idle)
    segs["top_op"], segs["top_us"] = _segment_ops(trace, bounds)
    for name in SEGMENT_FIELDS:
        rows[name] = segs[name][:n]
    tail = segs[n : n + 1].copy()
    tail["arrival"] = tail["start"] = tail["end"] = max(cycle_end, cycle_start)
    rows["fifo_prev"] = _fifo(rows, trace.device)
    return RankProgram(
        rank=trace.rank,
        file=trace.path.name,
        device=trace.device,
        rows=rows,
        cycle_start=cycle_start,
        cycle_end=cycle_end,
        tail=tail,
        groups=groups,
        group_ranks={g["pg_name"]: g["ranks"] for g in trace.groups},
        names=trace.names,
        steps=[number for number, _, _ in trace.steps],
        host=trace.host,
        unmatched=unmatched,
    )


SEGMENT_FIELDS = (
    "prev",
    "busy_pre",
    "gap_pre",
    "busy_post",
    "gap_post",
    "loader",
    "wait",
    "wait_on",
    "confirmed",
    "top_op",
    "top_us",
)


def _segments(
    busy: ia.Coverage, ends: np.ndarray, lo: np.ndarray, hi: np.ndarray, slack: float
) -> np.ndarray:
    """Each segment ``[lo, hi]`` cut at the latest end of an earlier collective of the rank
    that falls in an idle stretch of it, if any (see the module docstring)."""
    n = len(ends)
    segs = np.zeros(len(lo), ROW_DTYPE)
    segs["prev"] = lo
    segs["wait_on"] = -1
    cut = hi.copy()  # the end waited for
    idle_from = hi.copy()  # where the idle stretch before it began
    if n:
        idle = ~ia.contains(busy.start, busy.end, ends)
        where = np.searchsorted(hi, ends, side="left")  # the segment holding the end
        inside = (where < len(lo)) & (where > np.arange(n))
        where_c = np.minimum(where, len(lo) - 1)
        inside &= ends > lo[where_c]
        k = np.searchsorted(busy.start, ends, side="left")
        nxt = np.inf
        if len(busy.start):
            nxt = np.where(
                k < len(busy.start), busy.start[np.minimum(k, len(busy.start) - 1)], np.inf
            )
        go_on = np.minimum(nxt, hi[where_c])
        since = np.maximum(busy.last_end_before(ends, lo[where_c]), lo[where_c])
        for q in np.flatnonzero(idle & inside)[
            np.argsort(ends[idle & inside], kind="stable")
        ].tolist():
            p = int(where[q])  # a later end in the same segment replaces an earlier one
            segs["wait_on"][p] = q
            segs["confirmed"][p] = go_on[q] - ends[q] <= slack
            cut[p], idle_from[p] = ends[q], since[q]
    has = segs["wait_on"] >= 0
    pre_end = np.where(has, idle_from, hi)
    segs["wait"] = np.where(has, cut - idle_from, 0.0)
    segs["busy_pre"] = busy.covered(lo, pre_end)
    segs["gap_pre"] = np.maximum(pre_end - lo - segs["busy_pre"], 0.0)
    segs["busy_post"] = np.where(has, busy.covered(cut, hi), 0.0)
    segs["gap_post"] = np.where(has, np.maximum(hi - cut - segs["busy_post"], 0.0), 0.0)
    return segs


def _fifo(rows: np.ndarray, device: str) -> np.ndarray:
    """Per collective, the previous one on its lane when it waited for it to end, else -1."""
    out = np.full(len(rows), -1, np.int32)
    last: dict[int, int] = {}
    for p, lane in enumerate(rows["lane"].tolist()):
        q = last.get(lane)
        if q is not None and rows["start"][p] >= rows["end"][q] - _FIFO_SLACK_US[device]:
            out[p] = q
        last[lane] = p
    return out


def _loader_cover(
    trace: RankTrace, lo: np.ndarray, hi: np.ndarray, busy: ia.Coverage
) -> np.ndarray:
    """Per segment, the idle time a DataLoader range covers (µs)."""
    if not trace.dataloader:
        return np.zeros(len(lo))
    s, e = ia.union(
        np.array([d[0] for d in trace.dataloader]), np.array([d[1] for d in trace.dataloader])
    )
    # Idle time under the ranges: their length in the segment less the busy time inside them.
    idle_s, idle_e = ia.subtract(s, e, busy.start, busy.end)
    return ia.Coverage(idle_s, idle_e).covered(lo, hi)
