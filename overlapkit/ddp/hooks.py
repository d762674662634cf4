"""DDP communication hooks that record per-bucket timings.

Every hook here reduces like its PyTorch counterpart in
``torch.distributed.algorithms.ddp_comm_hooks`` and additionally writes the bucket's launch and
completion time into the state's ``CommRecorder`` (no device sync; see ``comm_stats``).

The compression hooks differ from PyTorch's ``fp16_compress_hook``/``bf16_compress_hook`` in three
ways: they work on gloo as well as NCCL, they reuse one low-precision buffer per bucket instead
of allocating one every step, and they divide and cast in one kernel where PyTorch casts and
then divides in low precision (two kernels; ``tests/test_compress_hooks.py`` counts them).
They are named ``*_allreduce_hook`` because ``DistributedDataParallel.register_comm_hook``
refuses any hook *named* ``bf16_compress_hook`` unless CUDA and NCCL are present, whatever the
hook does.
"""

# No ``from __future__ import annotations`` here: DDP inspects the hook's annotations at
# registration and needs ``dist.GradBucket`` itself, not its string.

import logging
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from overlapkit.ddp.comm_stats import CommRecorder
from overlapkit.ddp.failure_relay import FailureRelay
from overlapkit.group.dim_labels import comm_dim
from overlapkit.group.failures import FailureScope

__all__ = [
    "CommHookState",
    "PowerSGDHookState",
    "allreduce_hook",
    "bf16_allreduce_hook",
    "fp16_allreduce_hook",
    "powersgd_hook",
]

logger = logging.getLogger(__name__)


class CommHookState:
    """State of the all-reduce and compression hooks.

    Args:
        process_group (ProcessGroup): group to average over.
        recorder (CommRecorder): where per-bucket timings go; its step count also names the
            step in the error of a failed all-reduce (``overlapkit.group.failures``).
        parameters (Iterable[Tensor]): whose ``.grad`` is set to None when an all-reduce of the
            step fails (``overlapkit.ddp.failure_relay``). Defaults to none.

    Registered by hand rather than by ``ok.ddp``, also call ``state.relay.attach(ddp_model)``:
    after a failed step, DDP's reducer is then reset at the next forward.
    """

    __slots__ = ("_wire_buffers", "failures", "group_size", "process_group", "recorder", "relay")

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        recorder: CommRecorder,
        parameters: Iterable[torch.Tensor] = (),
    ):
        self.process_group = process_group
        self.group_size = process_group.size()
        self.recorder = recorder
        self.failures = FailureScope("ok.ddp", lambda: recorder.step)
        self.relay = FailureRelay(parameters)
        self._wire_buffers: dict[int, torch.Tensor] = {}

    def wire_buffer(
        self, bucket_index: int, like: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """A reusable ``dtype`` buffer shaped like ``like`` for ``bucket_index``.

        Reallocated only when the bucket changes size (DDP's rebuild after the first step).
        """
        buf = self._wire_buffers.get(bucket_index)
        if buf is None or buf.numel() != like.numel() or buf.dtype != dtype:
            buf = torch.empty(like.shape, dtype=dtype, device=like.device)
            self._wire_buffers[bucket_index] = buf
        return buf

    def __getstate__(self):
        # A process group cannot be pickled; it is reattached by ``ok.ddp``.
        return {"group_size": self.group_size}

    def __setstate__(self, state):
        self.process_group = None
        self.group_size = state["group_size"]
        self.recorder = CommRecorder()
        self.failures = FailureScope("ok.ddp", lambda: self.recorder.step)
        self.relay = FailureRelay()
        self._wire_buffers = {}


class PowerSGDHookState:
    """PyTorch's ``PowerSGDState`` plus the recorder that times each bucket.

    ``parameters``: as in ``CommHookState``.
    """

    __slots__ = ("failures", "powersgd", "recorder", "relay")

    def __init__(
        self,
        powersgd_state: powersgd.PowerSGDState,
        recorder: CommRecorder,
        parameters: Iterable[torch.Tensor] = (),
    ):
        self.powersgd = powersgd_state
        self.recorder = recorder
        self.failures = FailureScope("ok.ddp", lambda: recorder.step)
        self.relay = FailureRelay(parameters)


def _record(
    recorder: CommRecorder,
    bucket: dist.GradBucket,
    future: torch.futures.Future,
    wire_bytes: int | None,
) -> None:
    buffer = bucket.buffer()
    slot = recorder.launch(bucket.index(), buffer.numel() * buffer.element_size(), wire_bytes)
    recorder.watch(slot, future)
    if bucket.is_last():
        recorder.end_step()


def _allreduce_fut(
    state: CommHookState,
    bucket: dist.GradBucket,
    wire: torch.Tensor,
    finish: Callable[[torch.Tensor], torch.Tensor],
    collective: str = "all_reduce",
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce (sum) ``wire`` asynchronously, record the bucket's timing, then ``finish``.

    A failed all-reduce (a dead or stuck peer) makes ``loss.backward()`` raise
    ``CollectiveFailure`` naming the step's failed buckets and the missing ranks, with every
    ``.grad`` of the step dropped (``failure_relay``); the healthy path runs nothing but
    ``finish``.
    """
    site = state.failures.site(state.process_group, collective, f"bucket {bucket.index()}")
    state.relay.arm(state.recorder.step)
    with comm_dim("dp"):  # the report's dims tell it from tp's all-reduces (gloo)
        work = dist.all_reduce(wire, group=state.process_group, async_op=True)
    future = work.get_future()
    _record(state.recorder, bucket, future, wire.numel() * wire.element_size())

    def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            reduced = fut.value()[0]
        except RuntimeError as error:
            state.relay.record(site, bucket.index(), error)
            reduced = wire  # not averaged; the relay drops it and raises before DDP's end
        return finish(reduced)

    # The work too on host devices: gloo closes its profiler range after completing the future
    # (failure_relay). NCCL's works are left to their CUDA futures, as before.
    host_work = None if wire.is_cuda else work
    return state.relay.launched(future.then(done), last=bucket.is_last(), work=host_work)


def allreduce_hook(
    state: CommHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with one all-reduce and record when it was issued and completed.

    The bucket is divided by the process group size *before* the all-reduce, exactly as
    PyTorch's ``allreduce_hook``, so the result equals DDP without a hook.

    Example::
        >>> state = CommHookState(process_group, CommRecorder())
        >>> ddp_model.register_comm_hook(state, allreduce_hook)
    """
    buffer = bucket.buffer()
    buffer.div_(state.group_size)
    return _allreduce_fut(state, bucket, buffer, lambda reduced: reduced)


def _compress_hook(
    dtype: torch.dtype, state: CommHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    wire = state.wire_buffer(bucket.index(), buffer, dtype)
    # Divide and cast in one kernel: the division computes in the buffer's precision and writes
    # ``dtype`` (CUDA casts inside the kernel), so one rounding, no fp16 overflow before the
    # division, and one pass over the bucket fewer than PyTorch's cast-then-divide (two kernels)
    # or a divide in place followed by a cast (two kernels, the first over fp32 twice).
    torch.div(buffer, state.group_size, out=wire)

    def decompress(reduced: torch.Tensor) -> torch.Tensor:
        # Decompress in place into DDP's buffer: no full-precision temporary.
        buffer.copy_(reduced)
        return buffer

    return _allreduce_fut(state, bucket, wire, decompress, f"all_reduce ({dtype})")


def bf16_allreduce_hook(
    state: CommHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bfloat16: cast, all-reduce, cast back; divided by group size.

    Halves the bytes on the wire for fp32 gradients. Works on gloo and NCCL. The result differs
    from an fp32 all-reduce by bf16 rounding (8 mantissa bits: relative error about 2**-8 per
    element, plus one rounding per reduction step).

    Example::
        >>> ddp_model.register_comm_hook(CommHookState(pg, CommRecorder()), bf16_allreduce_hook)
    """
    return _compress_hook(torch.bfloat16, state, bucket)


def fp16_allreduce_hook(
    state: CommHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in float16: cast, all-reduce, cast back; divided by group size.

    Like ``bf16_allreduce_hook`` with 11 mantissa bits but a narrower range: gradients above
    65504 / group_size overflow.

    Example::
        >>> ddp_model.register_comm_hook(CommHookState(pg, CommRecorder()), fp16_allreduce_hook)
    """
    return _compress_hook(torch.float16, state, bucket)


def powersgd_hook(
    state: PowerSGDHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``powerSGD_hook`` unchanged, with the bucket's start and end recorded.

    ``wire_bytes`` is left unknown: PowerSGD sends several low-rank pieces per bucket.

    Example::
        >>> state = PowerSGDHookState(PowerSGDState(process_group=pg), CommRecorder())
        >>> ddp_model.register_comm_hook(state, powersgd_hook)
    """
    group = state.powersgd.process_group or dist.group.WORLD
    site = state.failures.site(group, "PowerSGD all_reduce", f"bucket {bucket.index()}")
    state.relay.arm(state.recorder.step)
    future = powersgd.powerSGD_hook(state.powersgd, bucket)
    _record(state.recorder, bucket, future, None)

    def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        try:
            return fut.value()
        except RuntimeError as error:
            state.relay.record(site, bucket.index(), error)
            return bucket.buffer()  # not averaged; the relay drops it and raises before DDP's end

    return state.relay.launched(future.then(done), last=bucket.is_last())
