"""How long the training thread waits on collectives: every ``Work.wait`` and ``Future.wait``.

Every path that waits on a collective from Python goes through one of two methods of torch's
process-group layer: ``torch.distributed.Work.wait`` (synchronous collectives wait on their own
work in ``distributed_c10d``; FSDP2's all-gathers and reduce-scatters, the pipeline's send/recv
and the MoE all-to-alls wait on theirs) and ``torch.Future.wait`` (``GradBucketer``, and
``ok.ddp``, whose end of backward waits on each bucket's future in Python:
``ddp/failure_relay.py``). ``WaitTimer`` wraps both once per process, for as long as a timer is
installed, and adds the blocked wall time of each wait to the timer of the thread that waited,
by the collective's kind (the trace report's ``COLLECTIVE_KINDS`` names). Torch 2.13 has no
process-group hook on gloo (``_register_on_completion_hook`` is NCCL-only) and the Flight
Recorder keeps only when a collective was created, not how long anyone waited; hence the wrap.

overlapkit's own waits that no Python wrap sees (tensor parallel's functional collectives wait
in ``wait_tensor``, a C++ op) are marked with ``group.dim_labels.comm_wait(kind)``, whose
observer (``wait_hooks``) this module sets to the waiting thread's timer: one mechanism for all
of overlapkit's waits. A timer counts only the outermost of nested waits (a ``Work.wait`` inside
a ``comm_wait`` block counts once).

The timing path is chosen once, from the device the collectives run on: the host's blocked
wall time on the CPU; on CUDA, where a wait only makes the current stream wait, the stream's
stall, from CUDA events read without a host sync (``device_waits``).

What it does not see: a wait inside C++ that overlapkit does not mark (plain
``DistributedDataParallel``'s reducer with a built-in hook; torch's own tensor and context
parallel's functional collectives).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import OpType

from overlapkit.group import wait_hooks
from overlapkit.group.wait_hooks import KINDS
from overlapkit.live.device_waits import DeviceWaits

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, SEND_RECV, OTHER = range(len(KINDS))

_KIND_OF_OP_TYPE = {
    OpType.ALLREDUCE: ALL_REDUCE,
    OpType.ALLREDUCE_COALESCED: ALL_REDUCE,
    OpType.REDUCE: ALL_REDUCE,
    OpType.ALLGATHER: ALL_GATHER,
    OpType._ALLGATHER_BASE: ALL_GATHER,
    OpType.ALLGATHER_COALESCED: ALL_GATHER,
    OpType.REDUCE_SCATTER: REDUCE_SCATTER,
    OpType._REDUCE_SCATTER_BASE: REDUCE_SCATTER,
    OpType.REDUCE_SCATTER_TENSOR_COALESCED: REDUCE_SCATTER,
    OpType.ALLTOALL: ALL_TO_ALL,
    OpType.ALLTOALL_BASE: ALL_TO_ALL,
    OpType.SEND: SEND_RECV,
    OpType.RECV: SEND_RECV,
    OpType.RECVANYSOURCE: SEND_RECV,
}
# ``Work._get_op_type()`` returns the enum's value, an int.
_KIND_OF_OP = {int(op.value): kind for op, kind in _KIND_OF_OP_TYPE.items()}

# The timers by the thread they time; the originals while any timer is installed.
_timers: dict[int, WaitTimer] = {}
_originals: dict[type, Any] = {}
_lock = threading.Lock()


class ThreadRunTime:
    """The calling thread's time running or runnable, ms: on Linux the first two fields of
    ``/proc/thread-self/schedstat`` (on a CPU, waiting on a run queue; one ``pread``, about a
    microsecond); elsewhere ``time.thread_time`` (on a CPU only). Create it on the thread to
    time; ``close()`` releases the file."""

    __slots__ = ("_fd",)

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def ms(self) -> float:
        if self._fd is None:
            return time.thread_time() * 1e3
        on_cpu, queued, _ = os.pread(self._fd, 64, 0).split()
        return (int(on_cpu) + int(queued)) / 1e6

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class WaitTimer:
    """Milliseconds of one thread's collective waits, by kind, while ``active``.

    Create and install it (``install()``) on the thread to time; it counts only while ``active``
    is True (the monitor's phases), so its own gathers and a checkpoint's collectives are left
    out. On the host path a wait counts its wall time less the thread's run time meanwhile
    (``run_time``): on an oversubscribed host a thread woken by the collective's end may queue
    for a CPU, and that is not waiting on the collective. ``drain()`` closes a step: it returns
    the host counts since the last drain and zeroes them. On the device path (``device`` CUDA)
    the waits are event pairs that ``resolved()`` reads later, tagged with their step.

    Args:
        device (torch.device | None): where the collectives run; CUDA chooses the device path.
    """

    __slots__ = ("active", "closed", "depth", "device_waits", "ms", "run_time", "thread")

    def __init__(self, device: torch.device | None = None) -> None:
        self.active = False
        self.ms = [0.0] * len(KINDS)
        self.thread = threading.get_ident()
        self.run_time = ThreadRunTime()
        self.depth = 0
        """Waits open on the thread (a ``Work.wait`` inside a ``comm_wait`` block: 2)."""
        self.closed = 0
        """Steps drained so far: the index of the step a wait now is in."""
        on_cuda = device is not None and torch.device(device).type == "cuda"
        self.device_waits = DeviceWaits() if on_cuda else None

    def add(self, kind: int, ms: float) -> None:
        """Count ``ms`` of waiting on a collective of ``kind`` (a ``KINDS`` index)."""
        if self.active:
            self.ms[kind] += ms

    def begin(self, kind: int) -> Any:
        """A wait on a collective of ``kind`` starts on this thread; the token for ``end``
        (None: not counted, being inactive or inside another wait)."""
        self.depth += 1
        if not self.active or self.depth > 1:
            return None
        if self.device_waits is not None:
            return self.device_waits.begin(kind)
        return kind, time.perf_counter(), self.run_time.ms()

    def end(self, token: Any) -> None:
        """The wait ``begin`` returned ``token`` for has ended."""
        self.depth -= 1
        if token is None:
            return
        if self.device_waits is not None:
            self.device_waits.end(token, self.closed)
            return
        kind, start, ran = token
        wall = (time.perf_counter() - start) * 1e3
        self.add(kind, max(wall - (self.run_time.ms() - ran), 0.0))

    def drain(self) -> list[float]:
        """Close a step: the host ms waited per kind since the last drain; zeroes the counts."""
        out, self.ms = self.ms, [0.0] * len(KINDS)
        self.closed += 1
        return out

    def resolved(self) -> list[tuple[int, int, float]]:
        """Device waits done since the last call, ``(step index, kind, ms)``; none on the host
        path. Never waits for the device."""
        return self.device_waits.resolve() if self.device_waits is not None else []

    def install(self) -> None:
        """Time the waits of the thread that calls this (one timer per thread)."""
        self.thread = threading.get_ident()
        with _lock:
            if not _timers:
                _wrap()
            _timers[self.thread] = self

    def uninstall(self) -> None:
        """Stop timing (idempotent); the wraps go when the last timer does."""
        with _lock:
            if _timers.get(self.thread) is self:
                del _timers[self.thread]
            if not _timers:
                _unwrap()
        self.run_time.close()


def _timed(original: Any, kind_of: Any) -> Any:
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        timer = _timers.get(threading.get_ident())
        if timer is None or not timer.active:
            return original(self, *args, **kwargs)
        token = timer.begin(kind_of(self))
        try:
            return original(self, *args, **kwargs)
        finally:
            timer.end(token)

    wait.__doc__ = original.__doc__
    return wait


class _ThreadsTimer:
    """``comm_wait``'s observer: the waiting thread's timer, if it has one."""

    def begin(self, kind: int) -> Any:
        timer = _timers.get(threading.get_ident())
        return None if timer is None else (timer, timer.begin(kind))

    def end(self, token: Any) -> None:
        if token is not None:
            timer, inner = token
            timer.end(inner)


_OBSERVER = _ThreadsTimer()


def _work_kind(work: Any) -> int:
    try:
        return _KIND_OF_OP.get(int(work._get_op_type()), OTHER)
    except RuntimeError:  # a work type that does not say
        return OTHER


def _future_kind(_future: Any) -> int:
    # In a training step the futures waited on are the gradient all-reduces' (comm hooks,
    # GradBucketer); a future does not say what it carries.
    return ALL_REDUCE


def _wrap() -> None:
    for cls, kind_of in ((dist.Work, _work_kind), (torch._C.Future, _future_kind)):
        _originals[cls] = cls.wait
        cls.wait = _timed(cls.wait, kind_of)
    wait_hooks.set_observer(_OBSERVER)


def _unwrap() -> None:
    wait_hooks.set_observer(None)
    for cls, original in _originals.items():
        cls.wait = original
    _originals.clear()
