"""One rank's trace file, reduced to classified time intervals: steps, compute, communication.

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
  which only hand work to gloo. A gloo range belongs to the step in which it started.
- **Backward compute** (for the tail): operators named ``autograd::engine::evaluate_function:*``
  on CPU; on GPU, kernels launched from inside such an operator (on any thread, since CUDA
  backward runs on autograd's device threads).

An event of a kept category whose time (``ts``, ``dur``), size (``In msg nelems``, ``Input Dims``),
id (``pid``, ``tid``, ``correlation``, ``External id``) or step number is present but not a value
of its kind (a time that is not a finite number, a size or step that is not a whole number in
``[0, 2**63)``, an id that is a list or an object) makes the file refused with a
``TraceFormatError`` naming the file, the event's index and name, the field and the value.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overlapkit.profiling import intervals
from overlapkit.profiling.trace_loader import EventError, TraceFormatError, read_trace

logger = logging.getLogger(__name__)

COLLECTIVE_KINDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
    "other",
)
# First match wins: NCCL runs all-to-all on SendRecv kernels, named by their metadata.
_KIND_PATTERNS = (
    ("all_reduce", re.compile(r"all_?reduce", re.IGNORECASE)),
    ("reduce_scatter", re.compile(r"reduce_?scatter", re.IGNORECASE)),
    ("all_gather", re.compile(r"all_?gather", re.IGNORECASE)),
    ("all_to_all", re.compile(r"all_?to_?all", re.IGNORECASE)),
    # Point-to-point (pipeline stages): gloo:send / gloo:recv ranges on the calling thread,
    # NCCL's SendRecv kernels and "send" / "recv" metadata.
    ("send_recv", re.compile(r"send|recv", re.IGNORECASE)),
)
_STEP_NAME = re.compile(r"ProfilerStep#(\d+)$")
_MAX_COUNT = 2**63 - 1
"""Largest element count, dimension, byte size or step number accepted: torch sizes are int64."""
_MAX_RANK = 2**31 - 1
_BACKWARD_PREFIX = "autograd::engine::evaluate_function"
# Enqueue ops of collectives on the calling thread: bookkeeping, not compute.
_COMM_OP_PREFIXES = ("c10d::", "record_param_comms", "nccl:", "gloo:")
_LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver"})
_KEPT_CATEGORIES = _LAUNCH_CATEGORIES | {"kernel", "cpu_op", "user_annotation"}
# Element sizes in bytes, as dtypes are spelled by record_param_comms (``dtype``) and by
# record_shapes (``Input type``).
DTYPE_BYTES = {
    "float": 4,
    "float32": 4,
    "double": 8,
    "float64": 8,
    "bfloat16": 2,
    "c10::bfloat16": 2,
    "half": 2,
    "float16": 2,
    "c10::half": 2,
    "int": 4,
    "int32": 4,
    "long": 8,
    "long int": 8,
    "int64": 8,
    "short": 2,
    "int16": 2,
    "char": 1,
    "signed char": 1,
    "int8": 1,
    "byte": 1,
    "unsigned char": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "c10::float8_e4m3fn": 1,
    "c10::float8_e5m2": 1,
}


def collective_kind(name: str) -> str:
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``send_recv`` or
    ``other``."""
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(name):
            return kind
    return "other"


def _shown(value: Any) -> str:
    """``repr(value)``, shortened: a refused value may be a 300-digit number."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"


def _time(value: Any, field: str) -> float:
    """``value`` in µs as a float; ``EventError`` unless it is a finite number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond 1.8e308: JSON allows any number of digits
            number = math.inf
        if math.isfinite(number):
            return number
    raise EventError(f"{field} is {_shown(value)}; expected a finite number of µs")


def _count(value: Any, field: str) -> int:
    """``value`` as an int; ``EventError`` unless it is a whole number in ``[0, 2**63)``."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or not 0 <= value <= _MAX_COUNT:
        raise EventError(f"{field} is {_shown(value)}; expected a whole number in [0, 2**63)")
    return int(value)


def _identifier(value: Any, field: str) -> Any:
    """``value`` if it can key a dict (ids match launches to kernels); else ``EventError``."""
    if isinstance(value, (list, dict)):
        raise EventError(f"{field} is {_shown(value)}; expected a number or a string")
    return value


def _element_bytes(dtype: Any) -> int | None:
    return DTYPE_BYTES.get(str(dtype).strip().lower()) if dtype is not None else None


def _byte_count(elements: int, size: int, field: str) -> int:
    if elements * size > _MAX_COUNT:
        raise EventError(f"{field} gives {elements * size:.3e} bytes; more than any tensor holds")
    return elements * size


def _metadata_bytes(args: dict[str, Any]) -> int | None:
    """Input bytes from NCCL collective metadata (``In msg nelems`` × ``dtype``)."""
    nelems = args.get("In msg nelems")
    if nelems is None:
        return None
    count = _count(nelems, '"In msg nelems"')
    size = _element_bytes(args.get("dtype"))
    return None if size is None else _byte_count(count, size, '"In msg nelems"')


def _shape_bytes(args: dict[str, Any]) -> int | None:
    """Input bytes from ``record_shapes`` data (``Input Dims`` × ``Input type``) of a gloo range."""
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not isinstance(dims, list) or not isinstance(types, list) or not dims:
        return None
    nbytes = 0
    for index, (shape, dtype) in enumerate(zip(dims, types, strict=False)):
        size = _element_bytes(dtype)
        if size is None:
            return None
        field = f'"Input Dims"[{index}]'
        if not isinstance(shape, list):
            raise EventError(f"{field} is {_shown(shape)}; expected the list of a tensor's sizes")
        elements = 1
        for d in shape:
            elements = min(elements * _count(d, field), _MAX_COUNT + 1)
        nbytes += _byte_count(elements, size, field)
    return _byte_count(nbytes, 1, '"Input Dims"')


@dataclass(slots=True)
class CommOp:
    """One collective (a NCCL kernel or a gloo range). Times in µs on the trace's clock."""

    start: float
    end: float
    anchor: float
    """The time that decides its step: the launch on GPU, the start on CPU."""
    kind: str
    nbytes: int | None
    """Input bytes this rank hands to the collective; None when the trace does not say."""


@dataclass(slots=True)
class RankTrace:
    """The classified intervals of one trace file (one rank, one profiling cycle)."""

    path: Path
    rank: int
    world_size: int | None
    device: str
    """``"gpu"`` when the trace has kernels, else ``"cpu"``."""
    steps: list[tuple[int, float, float]]
    """``(step number, start µs, end µs)`` of each ``ProfilerStep#N`` on the main thread."""
    comm: list[CommOp]
    compute: list[tuple[float, float, float]]
    """``(start µs, end µs, anchor µs)`` of each compute kernel or main-thread operator."""
    backward: list[tuple[float, float, float]]
    """The subset of ``compute`` that is backward compute."""
    main_pid: Any = None
    warnings: list[str] = field(default_factory=list)


class _Collector:
    """Receives events one by one and keeps only what the analysis needs, compactly."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float, float, Any, Any]] = []
        # (start, end, correlation, External id, None or (kind, bytes) for a collective)
        self.kernels: list[tuple[float, float, Any, Any, tuple | None]] = []
        self.launches: dict[Any, tuple[float, Any, Any]] = {}
        self.gloo: list[tuple[float, float, str, int | None]] = []
        self.comm_metadata: dict[Any, tuple[str, int | None]] = {}
        self.ops: dict[tuple[Any, Any], list[tuple[float, float, bool]]] = defaultdict(list)
        self.comm_ops: dict[tuple[Any, Any], list[intervals.Interval]] = defaultdict(list)

    def __call__(self, event: Any) -> None:
        if type(event) is not dict or event.get("ph") != "X":
            return
        cat = event.get("cat")
        cat = cat.lower() if isinstance(cat, str) else ""
        if cat not in _KEPT_CATEGORIES or event.get("ts") is None:
            return
        name = event.get("name")
        name = name if isinstance(name, str) else str(name)
        try:
            self._classify(event, cat, name)
        except EventError as err:
            raise EventError(f"{_shown(name)}: {err}") from None

    def _classify(self, event: dict[str, Any], cat: str, name: str) -> None:
        ts = _time(event["ts"], '"ts"')
        dur = event.get("dur")
        end = ts if dur is None else _time(ts + _time(dur, '"dur"'), '"ts" + "dur"')
        pid = _identifier(event.get("pid"), '"pid"')
        tid = _identifier(event.get("tid"), '"tid"')
        args = event.get("args")
        args = args if isinstance(args, dict) else {}
        if cat == "kernel":
            self._kernel(ts, end, name, args)
        elif cat in _LAUNCH_CATEGORIES:
            correlation = _identifier(args.get("correlation"), '"correlation"')
            if correlation is not None:
                self.launches[correlation] = (ts, pid, tid)
        else:
            self._host_range(ts, end, cat, name, args, pid, tid)

    def _kernel(self, ts: float, end: float, name: str, args: dict[str, Any]) -> None:
        comm = None
        if "Collective name" in args:
            comm = (collective_kind(str(args["Collective name"])), _metadata_bytes(args))
        elif name[:4].lower() == "nccl":
            comm = (collective_kind(name), None)  # sized later from record_param_comms
        correlation = _identifier(args.get("correlation"), '"correlation"')
        external_id = _identifier(args.get("External id"), '"External id"')
        self.kernels.append((ts, end, correlation, external_id, comm))

    def _host_range(self, ts, end, cat, name, args, pid, tid) -> None:
        step = _STEP_NAME.match(name)
        if step:
            digits = step.group(1)
            if len(digits) > 18:  # beyond int64 (and int() refuses strings past 4300 digits)
                raise EventError(f"step number {_shown(digits)} has more than 18 digits")
            self.steps.append((int(digits), ts, end, pid, tid))
        elif name.startswith("gloo:"):
            self.gloo.append((ts, end, collective_kind(name), _shape_bytes(args)))
        elif cat == "cpu_op":
            if name == "record_param_comms":
                kind = collective_kind(str(args.get("Collective name", "")))
                external_id = _identifier(args.get("External id"), '"External id"')
                self.comm_metadata[external_id] = (kind, _metadata_bytes(args))
            if name.startswith(_COMM_OP_PREFIXES):
                self.comm_ops[(pid, tid)].append((ts, end))
            else:
                self.ops[(pid, tid)].append((ts, end, name.startswith(_BACKWARD_PREFIX)))


def _main_thread(steps: list[tuple[int, float, float, Any, Any]]) -> tuple[Any, Any]:
    """The (pid, tid) that recorded the most ``ProfilerStep#N`` ranges."""
    return Counter((pid, tid) for _, _, _, pid, tid in steps).most_common(1)[0][0]


def _distributed_info(header: dict[str, Any], path: Path) -> tuple[int, int | None, list[str]]:
    info = header.get("distributedInfo")
    if isinstance(info, dict) and _is_int(info.get("rank")):
        rank, world = info["rank"], info.get("world_size")
        world = world if _is_int(world) else None
        if not 0 <= rank <= _MAX_RANK or (world is not None and not 1 <= world <= _MAX_RANK):
            raise TraceFormatError(
                f"{path}: distributedInfo has rank {_shown(rank)} and world_size "
                f"{_shown(world)}; expected a rank in [0, {_MAX_RANK}] and a world_size in "
                f"[1, {_MAX_RANK}]"
            )
        return rank, world, []
    message = (
        f"{path.name}: no distributedInfo (rank) in the trace; treating it as rank 0. "
        "Traces of a single process without torch.distributed look like this."
    )
    logger.warning("%s", message)
    return 0, None, [message]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _gpu_intervals(col: _Collector) -> tuple[list, list, list]:
    backward_ranges = {
        thread: intervals.union((s, e) for s, e, is_bwd in ops if is_bwd)
        for thread, ops in col.ops.items()
    }
    comm, compute, backward = [], [], []
    for ts, end, correlation, external_id, collective in col.kernels:
        launch = col.launches.get(correlation) if correlation is not None else None
        anchor = launch[0] if launch is not None else ts
        if collective is not None:
            kind, nbytes = collective
            if nbytes is None:
                kind, nbytes = col.comm_metadata.get(external_id, (kind, None))
            comm.append(CommOp(ts, end, anchor, kind, nbytes))
            continue
        compute.append((ts, end, anchor))
        if launch is not None:
            ranges = backward_ranges.get((launch[1], launch[2]))
            if ranges and intervals.contains(ranges, launch[0]):
                backward.append((ts, end, anchor))
    return comm, compute, backward


def _cpu_intervals(col: _Collector, main: tuple[Any, Any]) -> tuple[list, list, list]:
    comm = [CommOp(ts, end, ts, kind, nbytes) for ts, end, kind, nbytes in col.gloo]
    ops = col.ops.get(main, [])
    # An enqueue op often sits inside a compute op (a grad hook inside AccumulateGrad), so it is
    # cut out of the union rather than merely left out of it.
    enqueue = intervals.union(col.comm_ops.get(main, []))
    busy = intervals.subtract(intervals.union((s, e) for s, e, _ in ops), enqueue)
    bwd = intervals.subtract(intervals.union((s, e) for s, e, b in ops if b), enqueue)
    return comm, [(s, e, s) for s, e in busy], [(s, e, s) for s, e in bwd]


def load_rank_trace(path: str | Path) -> RankTrace:
    """Read one trace file and classify its intervals (see the module docstring).

    Raises:
        TraceFormatError: unreadable, truncated, not a trace, or no ``ProfilerStep#N`` ranges.
    """
    path = Path(path)
    col = _Collector()
    header = read_trace(path, col)
    if not col.steps:
        raise TraceFormatError(
            f"{path}: no ProfilerStep#N ranges; record with a profiler schedule and call "
            "prof.step() once per iteration (ok.profile does both)"
        )
    rank, world_size, warnings = _distributed_info(header, path)
    main = _main_thread(col.steps)
    steps: dict[int, tuple[int, float, float]] = {}
    for number, ts, end, pid, tid in col.steps:
        if (pid, tid) == main:
            steps[number] = (number, ts, end)
    if col.kernels:
        comm, compute, backward = _gpu_intervals(col)
        device = "gpu"
    else:
        comm, compute, backward = _cpu_intervals(col, main)
        device = "cpu"
    return RankTrace(
        path=path,
        rank=rank,
        world_size=world_size,
        device=device,
        steps=sorted(steps.values(), key=lambda s: s[1]),
        comm=comm,
        compute=compute,
        backward=backward,
        main_pid=main[0],
        warnings=warnings,
    )
