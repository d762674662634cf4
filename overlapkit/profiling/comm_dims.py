"""Which parallel dimension (tp, cp, ep, pp, dp, other) each collective of a rank's trace served.

The report's per-step ``dims`` need it; kinds cannot give it (on gloo a reduce-scatter is an
all-reduce, a ring step a ``send_recv`` like a pipeline's). Two sources, first that answers:

- **the process group** (NCCL): a kernel's ``Process Group Name``, whose ``pg_desc`` in the
  trace's ``distributedInfo.pg_config`` a ``DeviceMesh`` writes as ``mesh_<axis>``
  (``dim_labels.dim_of_group_desc``);
- **overlapkit's labels** (any backend): the ``overlapkit.dim:<dim>`` ranges its issuers record
  around the collectives they hand over (``dim_labels.comm_dim``). A collective whose own range
  lies in a label of its thread (a GPU kernel's launch; a gloo range on the calling thread, as
  point-to-point ones are) takes the innermost such label. gloo's worker-thread ranges carry
  nothing, so they are paired with the ``c10d::*`` ops that enqueued them: in start order, each
  range with the earliest unpaired earlier op of its kind (gloo runs a reduce-scatter's op as an
  all-reduce) handing over as many elements, else the earliest of its kind. A gloo worker
  thread belongs to one process group, so it serves one dimension: each thread takes the label
  most of its ranges' ops carry, which corrects a pairing that went wrong where groups' work
  interleaves.

Unlabelled collectives of a group that is no mesh axis are ``other``.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from overlapkit.group.dim_labels import COMM_DIMS, dim_of_group_desc
from overlapkit.profiling.rank_trace import RankTrace, collective_kind

OTHER = "other"
DIM_CODE = {dim: code for code, dim in enumerate(COMM_DIMS)}


class _Labels:
    """The label ranges of a trace, per thread, answering "innermost label at time t"."""

    def __init__(self, labels: list[tuple[float, float, int, str]]):
        self._by_thread: dict[int, tuple[np.ndarray, np.ndarray, list[str]]] = {}
        for thread in {t for _, _, t, _ in labels}:
            mine = sorted((s, e, d) for s, e, t, d in labels if t == thread)
            self._by_thread[thread] = (
                np.array([s for s, _, _ in mine]),
                np.array([e for _, e, _ in mine]),
                [d for _, _, d in mine],
            )

    def at(self, thread: int | None, t: float) -> str | None:
        """The dim of the innermost (latest started) label of ``thread`` holding ``t``."""
        found = self._by_thread.get(thread)
        if found is None:
            return None
        starts, ends, dims = found
        holding = np.flatnonzero((starts <= t) & (ends >= t))
        return dims[int(holding[-1])] if len(holding) else None

    def anywhere(self, t: float) -> str | None:
        """The innermost label holding ``t`` on any thread (a GPU kernel's launch thread is
        not kept with the kernel)."""
        best: tuple[float, str] | None = None
        for starts, ends, dims in self._by_thread.values():
            holding = np.flatnonzero((starts <= t) & (ends >= t))
            if len(holding) and (best is None or starts[holding[-1]] > best[0]):
                best = (float(starts[holding[-1]]), dims[int(holding[-1])])
        return None if best is None else best[1]


def comm_dims(trace: RankTrace) -> list[str]:
    """Per ``trace.comm`` entry, the dimension it served (see the module docstring)."""
    labels = _Labels(trace.labels)
    if trace.device == "gpu":
        desc = {g["pg_name"]: g.get("pg_desc") for g in trace.groups}
        return [
            dim_of_group_desc(desc.get(op.group)) or labels.anywhere(op.anchor) or OTHER
            for op in trace.comm
        ]
    return _gloo_dims(trace, labels)


def _gloo_dims(trace: RankTrace, labels: _Labels) -> list[str]:
    """gloo ranges: a label of their own thread, else their worker thread's majority label."""
    own = [labels.at(op.lane, op.start) for op in trace.comm]
    enqueued = sorted(
        (q for q in trace.enqueues if q.name.startswith("c10d::")), key=lambda q: q.start
    )
    enqueue_dim = [labels.at(q.thread, q.start) for q in enqueued]
    votes: dict[object, Counter] = {}
    waiting: list[int] = []  # unpaired enqueues, oldest first
    nxt = 0
    for i in sorted(range(len(trace.comm)), key=lambda i: trace.comm[i].start):
        op = trace.comm[i]
        while nxt < len(enqueued) and enqueued[nxt].start <= op.start:
            waiting.append(nxt)
            nxt += 1
        if own[i] is not None or not waiting:
            continue
        pick = _pair(op, [(q, enqueued[q]) for q in waiting])
        waiting.remove(pick)
        if enqueue_dim[pick] is not None:
            votes.setdefault(op.lane, Counter())[enqueue_dim[pick]] += 1
    lane_dim = {lane: count.most_common(1)[0][0] for lane, count in votes.items()}
    return [own[i] or lane_dim.get(op.lane, OTHER) for i, op in enumerate(trace.comm)]


def _pair(op, waiting: list) -> int:
    """The waiting enqueue ``(index, EnqueueOp)`` the gloo range ``op`` most likely ran: of
    its kind, then handing over as many elements, then the earliest."""
    kinds = {op.kind, "reduce_scatter"} if op.kind == "all_reduce" else {op.kind}
    alike = [(i, q) for i, q in waiting if collective_kind(q.name) in kinds] or waiting
    same = [i for i, q in alike if op.elements is not None and q.elements == op.elements]
    return same[0] if same else alike[0][0]
