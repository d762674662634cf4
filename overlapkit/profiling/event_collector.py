"""Trace events → compact records: what the analysis keeps of each kernel, operator and launch.

``EventCollector`` receives the batches ``trace_loader.read_trace_batches`` decodes and keeps,
per kernel, operator and launch, a few numbers in ``record_store`` tables (times, a thread, a
name code, a correlation id), and steps, collectives and their enqueue ops in lists.
``rank_trace`` says what counts as what; this module does it fast: a category at a time with
list comprehensions and numpy, and what depends on a name (is it a step, a backward op, a
collective's enqueue?) decided once per distinct name.

The checks that need two fields of an event are made here, on both decoding paths: ``"ts" +
"dur"`` finite, bytes = elements x element size within int64, step numbers within int64.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from overlapkit.group.dim_labels import LABEL_PREFIX, WAIT_LABEL, dim_of_label
from overlapkit.group.wait_hooks import KINDS
from overlapkit.profiling.record_store import RecordTable, SpillStore
from overlapkit.profiling.trace_events import (
    LAUNCH_CATEGORIES,
    MAX_COUNT,
    NO_ARGS,
    EventError,
    TraceEvent,
    check_count,
    raw_value,
    shown,
)

COLLECTIVE_KINDS = KINDS
"""The kinds a collective is reported under (the live monitor counts waits under the same)."""
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
_BACKWARD_PREFIX = "autograd::engine::evaluate_function"
_DATALOADER_PREFIX = "enumerate(DataLoader)#"
# Enqueue ops of collectives on the calling thread: bookkeeping, not compute (torch's functional
# collectives wrap the c10d:: op in one of theirs).
_COMM_OP_PREFIXES = ("c10d::", "record_param_comms", "nccl:", "gloo:", "_c10d_functional::")
# Waits for a collective: the calling thread blocked, not computing (comm_wait's range, and the
# functional collectives' wait op).
_WAIT_NAMES = (WAIT_LABEL, "_c10d_functional::wait_tensor")
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

OP_DTYPE = np.dtype(
    [("start", "f8"), ("end", "f8"), ("thread", "i4"), ("name", "i4"), ("backward", "?")]
)
KERNEL_DTYPE = np.dtype(
    [("start", "f8"), ("end", "f8"), ("corr", "i8"), ("name", "i4"), ("stream", "i4")]
)
LAUNCH_DTYPE = np.dtype([("corr", "i8"), ("start", "f8"), ("end", "f8"), ("thread", "i4")])
NO_CORRELATION = -1
"""The ``corr`` of a record without a correlation id."""
_CODED = 1 << 62  # correlation ids that are not small ints are coded from here on


def collective_kind(name: str) -> str:
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``send_recv`` or
    ``other``."""
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(name):
            return kind
    return "other"


def _element_bytes(dtype: Any) -> int | None:
    return DTYPE_BYTES.get(str(dtype).strip().lower()) if dtype is not None else None


def _byte_count(elements: int, size: int, field: str) -> int:
    if elements * size > MAX_COUNT:
        raise EventError(f"{field} gives {elements * size:.3e} bytes; more than any tensor holds")
    return elements * size


def _metadata_bytes(args: Any) -> int | None:
    """Input bytes from NCCL collective metadata (``In msg nelems`` × ``dtype``)."""
    if args.nelems is None:
        return None
    size = _element_bytes(args.dtype)
    return None if size is None else _byte_count(args.nelems, size, '"In msg nelems"')


def _shape_bytes(args: Any) -> int | None:
    """Input bytes from ``record_shapes`` data (``Input Dims`` × ``Input type``) of a gloo range."""
    dims, types = raw_value(args.input_dims), raw_value(args.input_types)
    if not isinstance(dims, list) or not isinstance(types, list) or not dims:
        return None
    nbytes = 0
    for index, (shape, dtype) in enumerate(zip(dims, types, strict=False)):
        size = _element_bytes(dtype)
        if size is None:
            return None
        field = f'"Input Dims"[{index}]'
        if not isinstance(shape, list):
            raise EventError(f"{field} is {shown(shape)}; expected the list of a tensor's sizes")
        elements = 1
        for d in shape:
            elements = min(elements * check_count(d, field), MAX_COUNT + 1)
        nbytes += _byte_count(elements, size, field)
    return _byte_count(nbytes, 1, '"Input Dims"')


def _elements(shapes: Any) -> int | None:
    """Elements in a list of tensor shapes (None unless it is one), to pair gloo work with the
    ``c10d::*`` op that enqueued it; never refuses the file."""
    if not isinstance(shapes, list):
        return None
    total = 0
    for shape in shapes:
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            return None
        total += math.prod(shape)
    return total


@dataclass(slots=True)
class EnqueueOp:
    """A ``c10d::*`` / ``record_param_comms`` op: where a collective was handed over."""

    start: float
    end: float
    thread: int
    name: str
    elements: int | None
    """Elements of the tensors it hands over (``c10d::*`` ops recorded with shapes)."""


# What a host range (cpu_op / user_annotation) is, decided once per distinct name.
_OP, _STEP, _GLOO, _LOADER, _ENQUEUE, _OTHER, _LABEL, _WAIT = range(8)


def _host_class(name: str) -> int:
    if name in _WAIT_NAMES:
        return _WAIT
    if name.startswith(LABEL_PREFIX) and dim_of_label(name) is not None:
        return _LABEL
    if _STEP_NAME.match(name):
        return _STEP
    if name.startswith("gloo:"):
        return _GLOO
    if name.startswith(_DATALOADER_PREFIX):
        return _LOADER
    if name.startswith(_COMM_OP_PREFIXES):
        return _ENQUEUE
    return _OP


class EventCollector:
    """Receives event batches and keeps only what the analysis needs, compactly.

    A batch's complete events are handled in one pass of list comprehensions and numpy (times,
    names, threads, categories as arrays), each category then by array masks; what depends on a
    name (is it a step, a backward op, a collective's enqueue?) is decided once per distinct
    name, and what depends on a category string once per distinct string.
    """

    def __init__(self, store: SpillStore) -> None:
        self.steps: list[tuple[int, float, float, int]] = []
        self.threads: dict[tuple[Any, Any], int] = {}
        self.names: dict[Any, int] = {}
        self.name_list: list[str] = []
        self.name_backward = np.zeros(0, bool)
        self.name_class = np.zeros(0, np.int8)
        self.name_nccl = np.zeros(0, bool)
        self.codes: dict[Any, int] = {}
        self.categories: dict[Any, int] = {}
        self.ops = RecordTable(OP_DTYPE, ("start", "end", "thread"), store)
        self.kernels = RecordTable(KERNEL_DTYPE, ("start", "end", "corr"), store)
        self.launches = RecordTable(LAUNCH_DTYPE, ("corr", "start", "end"), store)
        # (start, end, correlation, External id, stream, kind, bytes, group, seq)
        self.comm_kernels: list[tuple] = []
        self.gloo: list[tuple[float, float, int, str, int | None, int | None]] = []
        self.metadata: dict[Any, tuple[str, int | None, str | None, int | None]] = {}
        self.enqueues: list[EnqueueOp] = []
        self.dataloader: list[tuple[float, float, int]] = []
        self.labels: list[tuple[float, float, int, str]] = []
        """``comm_dim`` ranges: (start, end, thread, dim)."""
        self.waits: list[tuple[float, float, int]] = []
        """``comm_wait`` ranges: (start, end, thread)."""
        self.batch: list = []

    def _thread_codes(self, items: list) -> np.ndarray:
        """The thread code of each event (its ``(pid, tid)``), with numpy when both are ints."""
        pids = np.array([e.pid for e in items])
        tids = np.array([e.tid for e in items])
        table = self.threads
        small = pids.dtype.kind == "i" and tids.dtype.kind == "i" and len(items)
        if (
            small
            and pids.min() >= 0
            and pids.max() < 2**31
            and tids.min() >= 0
            and tids.max() < 2**32
        ):
            keys, inverse = np.unique((pids << 32) | tids, return_inverse=True)
            codes = np.array(
                [table.setdefault((k >> 32, k & 0xFFFFFFFF), len(table)) for k in keys.tolist()],
                np.int64,
            )
            return codes[inverse.reshape(-1)]
        keys = list(zip(pids.tolist(), tids.tolist(), strict=True))
        for key in set(keys) - table.keys():
            table[key] = len(table)
        return np.array([table[key] for key in keys], np.int64)

    def _name_codes(self, items: list) -> np.ndarray:
        raw = [e.name for e in items]
        table = self.names
        new = set(raw) - table.keys()
        if new:
            added = []
            for value in new:
                table[value] = len(self.name_list)
                self.name_list.append(_text(value))
                added.append(self.name_list[-1])
            self.name_backward = np.append(
                self.name_backward, [n.startswith(_BACKWARD_PREFIX) for n in added]
            )
            self.name_class = np.append(self.name_class, [_host_class(n) for n in added])
            self.name_nccl = np.append(self.name_nccl, [n[:4].lower() == "nccl" for n in added])
        return np.array([table[value] for value in raw], np.int64)

    def _category_codes(self, items: list) -> np.ndarray:
        """Per event: 1 kernel, 2 launch, 3 cpu_op, 4 user_annotation, 0 another category."""
        raw = [e.cat for e in items]
        table = self.categories
        for cat in set(raw) - table.keys():
            kind = cat.lower() if isinstance(cat, str) else ""
            table[cat] = (
                1
                if kind == "kernel"
                else 2
                if kind in LAUNCH_CATEGORIES
                else 3
                if kind == "cpu_op"
                else 4
                if kind == "user_annotation"
                else 0
            )
        return np.array([table[cat] for cat in raw], np.int8)

    def _correlations(self, values: list) -> np.ndarray:
        codes = np.array(values)
        if codes.dtype.kind == "i" and (
            len(codes) == 0 or (codes.min() >= 0 and codes.max() < _CODED)
        ):
            return codes.astype(np.int64)
        return np.array([self._correlation(v) for v in values], np.int64)

    def _correlation(self, value: Any) -> int:
        if value is None:
            return NO_CORRELATION
        if type(value) is int and 0 <= value < _CODED:
            return value
        if type(value) is float and value.is_integer() and 0 <= value < _CODED:
            return int(value)  # a dict key equal to the int, as the ids compare in Python
        return self.codes.setdefault(value, _CODED + len(self.codes))

    def refuse(self, err: EventError, event: Any) -> EventError:
        """``err`` with ``at``, the event's position in the batch (what the reader reports)."""
        err.at = next(k for k, e in enumerate(self.batch) if e is event)
        return err

    def __call__(self, batch: list) -> None:
        self.batch = batch
        event = TraceEvent  # complete events; the other phases are other (empty) types
        items = [e for e in batch if type(e) is event and e.ts is not None]
        if not items:
            return
        category = self._category_codes(items)
        if not category.all():
            chosen = np.flatnonzero(category)
            items, category = [items[i] for i in chosen.tolist()], category[chosen]
            if not items:
                return
        start, end = self._times(items)
        threads = self._thread_codes(items)
        for code, handle in (
            (1, self._kernels),
            (2, self._launches),
            (3, self._host),
            (4, self._host),
        ):
            where = np.flatnonzero(category == code)
            if len(where):
                chosen = items if len(where) == len(items) else [items[i] for i in where.tolist()]
                # A launch's name (cudaLaunchKernel) is not needed: one pass fewer over them.
                names = None if code == 2 else self._name_codes(chosen)
                handle(chosen, start[where], end[where], names, threads[where], code == 3)

    def _times(self, items: list) -> tuple[np.ndarray, np.ndarray]:
        start = np.array([e.ts for e in items], float)
        dur = np.array([e.dur for e in items], float)  # None (no "dur") is NaN: a point, 0
        dur[np.isnan(dur)] = 0.0
        with np.errstate(over="ignore"):  # a sum beyond 1.8e308 is refused just below
            end = start + dur
        bad = ~np.isfinite(end)
        if bad.any():
            i = int(np.argmax(bad))
            raise self.refuse(
                EventError(
                    f'{shown(_text(items[i].name))}: "ts" + "dur" is {float(end[i])!r}; '
                    "expected a finite number of µs"
                ),
                items[i],
            )
        return start, end

    def _kernels(self, items, start, end, names, threads, _cpu_op) -> None:
        collective = [a.collective if (a := e.args) is not None else None for e in items]
        comm = self.name_nccl[names] | np.array([c is not None for c in collective], bool)
        for i in np.flatnonzero(comm).tolist():
            e, args = items[i], items[i].args or NO_ARGS
            try:
                kind, nbytes = collective_kind(self.name_list[names[i]]), None
                if args.collective is not None:
                    kind, nbytes = collective_kind(args.collective), _metadata_bytes(args)
            except EventError as err:
                raise self.refuse(_named(err, e.name), e) from None
            self.comm_kernels.append(
                (
                    start[i],
                    end[i],
                    self._correlation(args.correlation),
                    args.external_id,
                    int(threads[i]),
                    kind,
                    nbytes,
                    args.group_name,
                    args.seq,
                )
            )
        compute = np.flatnonzero(~comm)
        if len(compute):
            chosen = items if len(compute) == len(items) else [items[i] for i in compute.tolist()]
            rows = np.empty(len(compute), KERNEL_DTYPE)
            rows["start"], rows["end"], rows["name"] = start[compute], end[compute], names[compute]
            rows["corr"] = self._correlations(
                [a.correlation if (a := e.args) is not None else None for e in chosen]
            )
            rows["stream"] = threads[compute]
            self.kernels.append(rows)

    def _launches(self, items, start, end, names, threads, _cpu_op) -> None:
        rows = np.empty(len(items), LAUNCH_DTYPE)
        rows["corr"] = self._correlations(
            [a.correlation if (a := e.args) is not None else None for e in items]
        )
        rows["start"], rows["end"], rows["thread"] = start, end, threads
        self.launches.append(rows[rows["corr"] != NO_CORRELATION])

    def _host(self, items, start, end, names, threads, cpu_op) -> None:
        classes = self.name_class[names]
        if not cpu_op:  # operators and enqueue ops are cpu_ops; other annotations only mark
            classes = np.where((classes == _OP) | (classes == _ENQUEUE), _OTHER, classes)
        for i in np.flatnonzero((classes != _OP) & (classes != _OTHER)).tolist():
            e = items[i]
            try:
                self._special(
                    int(classes[i]), self.name_list[names[i]], e, start[i], end[i], int(threads[i])
                )
            except EventError as err:
                raise self.refuse(_named(err, e.name), e) from None
        ops = np.flatnonzero(classes == _OP)
        if len(ops):
            rows = np.empty(len(ops), OP_DTYPE)
            rows["start"], rows["end"], rows["name"] = start[ops], end[ops], names[ops]
            rows["thread"] = threads[ops]
            rows["backward"] = self.name_backward[names[ops]]
            self.ops.append(rows)

    def _special(self, kind: int, name: str, e: Any, start: float, end: float, thread: int) -> None:
        """File a step, gloo, DataLoader, dim label, wait or enqueue range."""
        args = e.args or NO_ARGS
        if kind == _STEP:
            digits = _STEP_NAME.match(name).group(1)
            if len(digits) > 18:  # beyond int64 (and int() refuses strings past 4300 digits)
                raise EventError(f"step number {shown(digits)} has more than 18 digits")
            self.steps.append((int(digits), start, end, thread))
        elif kind == _GLOO:
            nbytes = _shape_bytes(args)
            elements = _elements(raw_value(args.input_dims))
            self.gloo.append((start, end, thread, collective_kind(name), nbytes, elements))
        elif kind == _LOADER:
            self.dataloader.append((start, end, thread))
        elif kind == _LABEL:
            self.labels.append((start, end, thread, dim_of_label(name)))
        elif kind == _WAIT:
            self.waits.append((start, end, thread))
        else:  # an enqueue op
            if name == "record_param_comms":
                kind_name = collective_kind(str(args.collective or ""))
                self.metadata[args.external_id] = (
                    kind_name,
                    _metadata_bytes(args),
                    args.group_name,
                    args.seq,
                )
            elements = None
            if name.startswith("c10d::"):  # its first input is the TensorList it hands over
                dims = raw_value(args.input_dims)
                elements = _elements(dims[0]) if isinstance(dims, list) and dims else None
            self.enqueues.append(EnqueueOp(start, end, thread, name, elements))


def _text(name: Any) -> str:
    return name if isinstance(name, str) else str(name)


def _named(err: EventError, name: Any) -> EventError:
    return EventError(f"{shown(_text(name))}: {err}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
