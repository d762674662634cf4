"""One rank's trace file, reduced to compact records: steps, compute, launches, communication.

What counts as what (Kineto traces written by ``torch.profiler``):

- **Steps** are the ``ProfilerStep#N`` ranges of the thread that called ``prof.step()`` (the main
  thread). Every step is kept, the last one included.
- **GPU traces** (any ``cat == "kernel"`` event): a kernel is *communication* when its name starts
  with ``nccl`` or it carries collective metadata (``"Collective name"``), else *compute*. Memory
  copies and memsets are neither (as in HTA). ``gpu_user_annotation`` events are mirrors of CPU
  ranges drawn on the GPU lanes (``nccl:all_reduce`` spans the very kernel it launched), so they
  are never counted. A kernel belongs to the step in which it was *launched*: its
  ``correlation`` id leads to the ``cudaLaunchKernel``/``cuLaunchKernelEx`` call on the CPU.
- **CPU traces**: communication is the ``gloo:*`` ranges that gloo's worker threads
  (``pt_gloo_runloop``) record around each collective; compute is the main thread's operators
  (``cpu_op``), except the collectives' own enqueue ops (``c10d::*``, ``record_param_comms``),
  which only hand work to gloo, torch's functional collectives' ops around them
  (``_c10d_functional::*``), and the waits: ``_c10d_functional::wait_tensor`` and those
  overlapkit marks (``overlapkit.wait``: a thread blocked on a collective inside an operator,
  such as an autograd node's backward). A gloo
  range belongs to the step in which it started.
- **Backward compute** (for the tail): operators named ``autograd::engine::evaluate_function:*``
  on CPU; on GPU, kernels launched from inside such an operator (on any thread, since CUDA
  backward runs on autograd's device threads).
- **Collective identity** (for matching across ranks, ``collectives``): NCCL collectives carry
  ``Process Group Name`` and ``Seq`` (on the kernel or on its ``record_param_comms``); on gloo
  the main thread's ``c10d::*`` ops give the enqueue order and ``distributedInfo.pg_config``
  the groups.
- **Data loading**: ``enumerate(DataLoader)#...`` ranges (torch's DataLoader records them).

An event of a kept category whose time (``ts``, ``dur``), size (``In msg nelems``, ``Input Dims``),
id (``pid``, ``tid``, ``correlation``, ``External id``) or step number is present but not a value
of its kind (a time that is not a finite number, a size or step that is not a whole number in
``[0, 2**63)``, an id that is a list or an object) makes the file refused with a
``TraceFormatError`` naming the file, the event's index and name, the field and the value.

Kernels, operators and launches, the bulk of a trace, go to ``record_store`` tables (a few
numbers each, spilled to disk past a budget); the rest (steps, collectives) stays in lists.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from overlapkit.profiling.event_collector import (
    COLLECTIVE_KINDS,
    DTYPE_BYTES,
    NO_CORRELATION,
    EnqueueOp,
    EventCollector,
    collective_kind,
)
from overlapkit.profiling.record_store import RecordTable, SpillStore
from overlapkit.profiling.trace_events import shown
from overlapkit.profiling.trace_loader import TraceFormatError, read_trace_batches

__all__ = [
    "COLLECTIVE_KINDS",
    "DTYPE_BYTES",
    "CommOp",
    "EnqueueOp",
    "RankTrace",
    "collective_kind",
    "load_rank_trace",
]

logger = logging.getLogger(__name__)

_MAX_RANK = 2**31 - 1


@dataclass(slots=True)
class CommOp:
    """One collective on this rank (a NCCL kernel or a gloo range). Times in µs, trace clock."""

    start: float
    end: float
    anchor: float
    """The time that decides its step: the launch on GPU, the start on CPU."""
    kind: str
    nbytes: int | None
    """Input bytes this rank hands to the collective; None when the trace does not say."""
    group: str | None = None
    """``Process Group Name`` (NCCL); None when the trace does not say."""
    seq: int | None = None
    """The collective's sequence number in its group (NCCL ``Seq``)."""
    lane: Any = None
    """Where it ran: the stream (GPU) or gloo thread (CPU), a thread code."""
    elements: int | None = None
    """Elements of its input tensors (gloo ranges recorded with shapes)."""


@dataclass(slots=True)
class RankTrace:
    """The compact records of one trace file (one rank, one profiling cycle).

    Call ``close()`` (or use it as a context manager) to remove spilled records.
    """

    path: Path
    rank: int
    world_size: int | None
    device: str
    """``"gpu"`` when the trace has kernels, else ``"cpu"``."""
    steps: list[tuple[int, float, float]]
    """``(step number, start µs, end µs)`` of each ``ProfilerStep#N`` on the main thread."""
    main_thread: int
    main_pid: Any
    threads: list[tuple[Any, Any]]
    """``(pid, tid)`` of each thread code used in the tables."""
    names: list[str]
    """Operator and kernel name of each name code."""
    ops: RecordTable
    kernels: RecordTable
    launches: RecordTable
    comm: list[CommOp]
    enqueues: list[EnqueueOp]
    dataloader: list[tuple[float, float, int]]
    groups: list[dict[str, Any]]
    """``distributedInfo.pg_config``: ``pg_name``, ``ranks`` (and ``pg_desc`` when given) of
    each group this rank is in."""
    backend: str | None
    host: str | None
    """The trace's ``host_name``: ranks on one host share one clock."""
    store: SpillStore
    warnings: list[str] = field(default_factory=list)
    labels: list[tuple[float, float, int, str]] = field(default_factory=list)
    """``comm_dim`` ranges, ``(start, end, thread, dim)``: which dimension the collectives
    issued inside serve (``overlapkit.group.dim_labels``)."""
    waits: list[tuple[float, float, int]] = field(default_factory=list)
    """``comm_wait`` ranges, ``(start, end, thread)``: a thread blocked on a collective."""

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> RankTrace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _distributed_info(header: dict[str, Any], path: Path) -> tuple[int, int | None, list[str]]:
    info = header.get("distributedInfo")
    if isinstance(info, dict) and _is_int(info.get("rank")):
        rank, world = info["rank"], info.get("world_size")
        world = world if _is_int(world) else None
        if not 0 <= rank <= _MAX_RANK or (world is not None and not 1 <= world <= _MAX_RANK):
            raise TraceFormatError(
                f"{path}: distributedInfo has rank {shown(rank)} and world_size "
                f"{shown(world)}; expected a rank in [0, {_MAX_RANK}] and a world_size in "
                f"[1, {_MAX_RANK}]"
            )
        return rank, world, []
    message = (
        f"{path.name}: no distributedInfo (rank) in the trace; treating it as rank 0. "
        "Traces of a single process without torch.distributed look like this."
    )
    logger.warning("%s", message)
    return 0, None, [message]


def _groups(header: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``pg_config`` entries with a name and a list of int ranks."""
    info = header.get("distributedInfo")
    config = info.get("pg_config") if isinstance(info, dict) else None
    if not isinstance(config, list):
        return []
    out = []
    for group in config:
        if not isinstance(group, dict):
            continue
        ranks = group.get("ranks")
        if isinstance(ranks, list) and all(_is_int(r) for r in ranks) and "pg_name" in group:
            entry = {"pg_name": str(group["pg_name"]), "ranks": ranks}
            if isinstance(group.get("pg_desc"), str):
                entry["pg_desc"] = group["pg_desc"]
            out.append(entry)
    return out


def _launch_times(launches: RecordTable, wanted: set[int]) -> dict[int, float]:
    """Launch time of each correlation id in ``wanted`` that has a launch, block by block."""
    found: dict[int, float] = {}
    keys = np.fromiter(wanted, np.int64, len(wanted))
    for rows in launches.iter_blocks():
        hit = rows[np.isin(rows["corr"], keys)]
        found.update(zip(hit["corr"].tolist(), hit["start"].tolist(), strict=True))
    return found


def _comm_ops(col: EventCollector, device: str) -> list[CommOp]:
    if device == "cpu":
        return [
            CommOp(s, e, s, kind, nbytes, lane=t, elements=n)
            for s, e, t, kind, nbytes, n in col.gloo
        ]
    launch_at = _launch_times(col.launches, {k[2] for k in col.comm_kernels} - {NO_CORRELATION})
    out = []
    for start, end, corr, external, stream, kind, nbytes, group, seq in col.comm_kernels:
        anchor = launch_at.get(corr, start)
        meta = col.metadata.get(external)
        if meta is not None:
            if nbytes is None:
                kind, nbytes = meta[0], meta[1]
            group = group if group is not None else meta[2]
            seq = seq if seq is not None else meta[3]
        out.append(CommOp(start, end, anchor, kind, nbytes, group, seq, lane=stream))
    return out


def load_rank_trace(path: str | Path, *, store: SpillStore | None = None) -> RankTrace:
    """Read one trace file and reduce it to compact records (see the module docstring).

    Args:
        path (str | Path): a ``.json`` or ``.json.gz`` trace.
        store (SpillStore | None): the memory budget for the records; a default one when None.

    Raises:
        TraceFormatError: unreadable, truncated, not a trace, or no ``ProfilerStep#N`` ranges.
    """
    path = Path(path)
    store = store if store is not None else SpillStore()
    col = EventCollector(store)
    try:
        header = read_trace_batches(path, col)
        if not col.steps:
            raise TraceFormatError(
                f"{path}: no ProfilerStep#N ranges; record with a profiler schedule and call "
                "prof.step() once per iteration (ok.profile does both)"
            )
        rank, world_size, warnings = _distributed_info(header, path)
    except BaseException:
        store.close()
        raise
    for table in (col.ops, col.kernels, col.launches):
        table.flush()
    main = Counter(thread for *_, thread in col.steps).most_common(1)[0][0]
    steps: dict[int, tuple[int, float, float]] = {}
    for number, ts, end, thread in col.steps:
        if thread == main:
            steps[number] = (number, ts, end)
    device = "gpu" if len(col.kernels) or col.comm_kernels else "cpu"
    info = header.get("distributedInfo")
    threads = list(col.threads)
    return RankTrace(
        path=path,
        rank=rank,
        world_size=world_size,
        device=device,
        steps=sorted(steps.values(), key=lambda s: s[1]),
        main_thread=main,
        main_pid=threads[main][0],
        threads=threads,
        names=col.name_list,
        ops=col.ops,
        kernels=col.kernels,
        launches=col.launches,
        comm=_comm_ops(col, device),
        enqueues=col.enqueues,
        dataloader=col.dataloader,
        groups=_groups(header),
        backend=str(info.get("backend")) if isinstance(info, dict) else None,
        host=header["host_name"] if isinstance(header.get("host_name"), str) else None,
        store=store,
        warnings=warnings,
        labels=col.labels,
        waits=col.waits,
    )
