"""The bucket reducer under ``ok.GradBucketer``: buckets, launch order, async all-reduce, finish.

During backward each parameter's post-accumulate-grad hook copies its gradient into its bucket;
a full bucket's all-reduce is issued at once (async). ``end_backward()`` launches what is left,
``finish_bucket(b)`` waits for bucket ``b`` and points the gradients at it, ``end_step()`` closes
the step. ``GradBucketer`` drives these in ``wait()``; the per-bucket optimizer scheduler
(``overlapkit.optim.per_bucket``) drives them bucket by bucket, through the public methods only
(the ``BucketReduction`` Protocol of ``overlapkit.optim.protocols``).

Buckets are issued in launch order on every rank, because gloo and NCCL match collectives by the
order they are issued in. The first step uses reverse registration order (the usual order of
readiness); after it, the buckets are rebuilt once in the order rank 0 saw gradients become ready
and every rank adopts that layout. Flat buffers are allocated per layout, never per step, and after
``finish_bucket`` each ``param.grad`` is a view into its bucket, so the next backward accumulates
in place and needs no copy (unless the optimizer sets gradients to None: then one copy is made).

A parameter that gets no gradient on a rank in a step contributes zeros. Each bucket carries one
"used" flag per parameter, reduced with the gradients, so every rank agrees on which parameters
got a gradient somewhere: those receive the average; parameters unused on every rank keep their
``.grad`` unchanged (None stays None), as DDP does.

Tensor-parallel (DTensor) parameters are reduced shard by shard: each rank's bucket holds its own
local shards and the all-reduce runs over the reducer's (data-parallel) group only; gradients
are handed back as DTensors with the parameter's placements.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from overlapkit.ddp.comm_stats import CommRecorder
from overlapkit.ddp.finite import FiniteCheck
from overlapkit.group.dim_labels import comm_dim
from overlapkit.group.failures import FailureScope

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
CALLER = "ok.GradBucketer"
"""The API the reducer serves, as errors and logs name it."""

_live: weakref.WeakSet[BucketReducer] = weakref.WeakSet()


@atexit.register
def _wait_in_flight_at_exit() -> None:
    """Wait for every all-reduce still in flight before the interpreter shuts down.

    A gloo all-reduce completes on one of the process group's worker threads, which then runs
    the Python callbacks of its future (``CommRecorder.watch``'s completion timestamp). If that
    happens while the interpreter finalizes, the thread's attempt to take the GIL ends it with
    ``pthread_exit``, whose unwinding through torch's ``noexcept`` future code calls
    ``std::terminate``: the process dies of SIGABRT ("terminate called without an active
    exception") after the script has finished. ``atexit`` runs before finalization, while
    threads can still take the GIL, so waiting here lets every callback run in time.

    Waiting for the all-reduce is not enough on its own: a waiter wakes before the future's
    callbacks run, and after each callback the worker takes the GIL once more to release it.
    So this also waits, the GIL released, until every callback has run, and a little longer.
    """
    reducers = list(_live)
    for reducer in reducers:
        reducer.wait_in_flight()
    deadline = time.monotonic() + EXIT_CALLBACKS_TIMEOUT_S
    while time.monotonic() < deadline and any(r.recorder.callbacks_pending() for r in reducers):
        time.sleep(0.001)
    if reducers:
        time.sleep(EXIT_CALLBACK_RELEASE_S)


EXIT_CALLBACKS_TIMEOUT_S = 5.0
"""At exit, how long to wait for the completion callbacks of finished all-reduces (a failed
group's may never run)."""
EXIT_CALLBACK_RELEASE_S = 0.05
"""At exit, how long the worker threads get after the last callback to release it."""


def tail_launch_order(num_buckets: int, tail: int) -> list[int]:
    """Buckets in launch order: gradient-ready order, except the last ``tail`` in reverse.

    Buckets are built in the order gradients become ready, so the last ones hold the model's
    first layers, which the next forward needs first. Launching the last ``tail`` of them in
    reverse puts the first layer's bucket ahead of the others in the (FIFO) collective queue: the
    next forward's first modules start while the other tail buckets are still on the wire. The
    cost is that those buckets start only when backward ends; when the network is busy at the
    end of backward anyway (comm-bound steps) they would have queued regardless.
    """
    split = max(num_buckets - tail, 0)
    return list(range(split)) + list(range(num_buckets - 1, split - 1, -1))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a tensor-parallel parameter or gradient), else the tensor.

    The reducer reduces over its own group (data parallel), so it works on local shards: the
    other mesh dimensions (tensor parallel) are already accounted for by the shard itself.
    """
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _holds(param: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``param.grad`` already lives in ``view`` (so nothing needs copying)."""
    return param.grad is not None and _local(param.grad).data_ptr() == view.data_ptr()


def _set_grad(param: torch.Tensor, view: torch.Tensor) -> None:
    """Make ``view`` the gradient of ``param``, wrapped like ``param`` when it is a DTensor."""
    if isinstance(param, DTensor):
        param.grad = DTensor.from_local(
            view,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    else:
        param.grad = view


class _Bucket:
    """Parameters reduced together: one flat buffer of their gradients plus one flag each.

    A flag is 1 while its parameter has a gradient this step and 0 once it is known to have none;
    after the all-reduce it is positive exactly when some rank had a gradient.
    """

    __slots__ = ("flags", "flat", "grad_bytes", "indices", "pending", "views", "work")

    def __init__(self, indices: list[int], params: list[torch.nn.Parameter]):
        self.indices = indices
        shards = [_local(params[i]) for i in indices]
        numels = [shard.numel() for shard in shards]
        first = shards[0]
        grad_numel = sum(numels)
        self.flat = torch.zeros(grad_numel + len(indices), dtype=first.dtype, device=first.device)
        self.flags = self.flat[grad_numel:]
        self.flags.fill_(1)
        self.views: list[torch.Tensor] = []
        offset = 0
        for shard, numel in zip(shards, numels, strict=True):
            self.views.append(self.flat[offset : offset + numel].view_as(shard))
            offset += numel
        self.grad_bytes = grad_numel * first.element_size()
        self.pending = len(indices)
        self.work: dist.Work | None = None


class BucketReducer:
    """Average the gradients of ``params`` over a group, in buckets launched during backward.

    Registers a post-accumulate-grad hook on every parameter (``remove()`` detaches them).
    Arguments are checked by the caller (``ok.GradBucketer``).

    Args:
        params (list[Parameter]): the trainable parameters, in registration order.
        names (list[str]): their names, for errors.
        process_group (ProcessGroup): the group to average over.
        bucket_mb (float): bucket size in MiB; a bucket is closed once it holds at least this.
        tail (int): the last this-many buckets of backward are launched first-layer first
            (``tail_launch_order``); 0 keeps backward order.
        recorder (CommRecorder): records each launch and completion (``ok.comm_stats``).
        failures (FailureScope): explains a failed all-reduce (``CollectiveFailure``).
        finite (FiniteCheck | None): checks each finished bucket for NaN/Inf; None checks
            nothing.

    Attributes:
        process_group (ProcessGroup): the group averaged over.
        bucket_mb (float): the current bucket size in MiB.
        recorder (CommRecorder): the launch and completion records.
        sync (bool): False while gradients are to be left alone (``GradBucketer.no_sync()``):
            backward then hands nothing over and launches nothing.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        names: list[str],
        process_group: dist.ProcessGroup,
        *,
        bucket_mb: float,
        tail: int,
        recorder: CommRecorder,
        failures: FailureScope,
        finite: FiniteCheck | None,
    ):
        self._params = params
        self._names = names
        self.process_group = process_group
        self.bucket_mb = bucket_mb
        self.recorder = recorder
        self.sync = True
        self._tail = tail
        self._failures = failures
        self._finite = finite
        self._group_size = process_group.size()
        self._in_step = False
        self._ready = [False] * len(params)
        self._ready_order: list[int] | None = []
        self._next_to_launch = 0
        self._grad_ready_hooks: OrderedDict[int, Callable[[int, torch.Tensor], None]] = (
            OrderedDict()
        )
        self._step_end_hooks: OrderedDict[int, Callable[[int], None]] = OrderedDict()
        self._build(list(reversed(range(len(params)))))
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)
        ]
        _live.add(self)

    # -- the layout ----------------------------------------------------------------------------

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The reduced parameters, in registration order (indices refer to this list)."""
        return self._params

    @property
    def names(self) -> list[str]:
        """The parameters' names, in the same order."""
        return self._names

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def launch_order(self) -> list[int]:
        """The buckets in the order their all-reduces are launched (the same on every rank)."""
        return self._launch_order

    def bucket_indices(self, bucket: int) -> list[int]:
        """The parameters (indices into ``params``) in ``bucket``, in buffer order."""
        return self._buckets[bucket].indices

    def bucket_of(self, index: int) -> int:
        """The bucket holding parameter ``index`` in the current layout."""
        return self._bucket_of[index][0]

    def grad_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s slice of its bucket's flat buffer (its local shard's shape)."""
        b, pos = self._bucket_of[index]
        return self._buckets[b].views[pos]

    def bucket_flat(self, bucket: int) -> torch.Tensor:
        """``bucket``'s flat buffer: the gradients back to back, then one used-flag each."""
        return self._buckets[bucket].flat

    def bucket_parameter_names(self) -> list[list[str]]:
        """The parameter names in each bucket, bucket by bucket."""
        return [[self._names[i] for i in b.indices] for b in self._buckets]

    @property
    def rebuild_pending(self) -> bool:
        """Whether the next ``end_step`` rebuilds the buckets in rank 0's gradient-ready order."""
        return self._ready_order is not None

    def set_bucket_mb(self, bucket_mb: float) -> None:
        """Rebuild the buckets at ``bucket_mb`` MiB in the current order (between steps)."""
        self.bucket_mb = bucket_mb
        self._rebuild_keeping_grads([i for bucket in self._buckets for i in bucket.indices])

    def load_layout(self, order: list[int], *, bucket_mb: float, order_adopted: bool) -> None:
        """Rebuild the buckets in ``order`` (parameter indices) at ``bucket_mb`` MiB.

        Args:
            order (list[int]): every parameter index once, in layout order.
            bucket_mb (float): the bucket size in MiB (checked by the caller).
            order_adopted (bool): whether the layout already is rank 0's gradient-ready order;
                if not, the next step's end adopts it.
        """
        self.bucket_mb = bucket_mb
        self._ready_order = None if order_adopted else []
        self._rebuild_keeping_grads(order)

    def _build(self, order: list[int]) -> None:
        # DDP's rule: a bucket takes parameters until it holds at least ``bucket_mb`` (so a bias
        # joins its weight instead of travelling alone); dtype or device changes start a new one.
        cap = self.bucket_mb * MiB
        groups: list[list[int]] = []
        size = cap
        for i in order:
            p = _local(self._params[i])
            if groups:
                last = _local(self._params[groups[-1][0]])
                if last.dtype != p.dtype or last.device != p.device:
                    size = cap
            if size >= cap:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += p.numel() * p.element_size()
        self._buckets = [_Bucket(g, self._params) for g in groups]
        self._launch_order = tail_launch_order(len(self._buckets), self._tail)
        self._bucket_of = [(0, 0)] * len(self._params)
        for b, bucket in enumerate(self._buckets):
            for pos, i in enumerate(bucket.indices):
                self._bucket_of[i] = (b, pos)

    def _rebuild_keeping_grads(self, order: list[int]) -> None:
        old_grads = [p.grad for p in self._params]
        self._build(order)
        for i, grad in enumerate(old_grads):
            if grad is not None:
                b, pos = self._bucket_of[i]
                view = self._buckets[b].views[pos]
                view.copy_(_local(grad))
                _set_grad(self._params[i], view)

    # -- backward ------------------------------------------------------------------------------

    @property
    def in_step(self) -> bool:
        """Whether a backward has handed over gradients since the last ``end_backward()``."""
        return self._in_step

    def register_grad_ready_hook(
        self, hook: Callable[[int, torch.Tensor], None]
    ) -> RemovableHandle:
        """Call ``hook(index, param)`` when a gradient is ready, before it enters its bucket.

        Returns:
            RemovableHandle: ``handle.remove()`` unregisters it.
        """
        handle = RemovableHandle(self._grad_ready_hooks)
        self._grad_ready_hooks[handle.id] = hook
        return handle

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(index, param)

        return hook

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        if not self.sync:
            return
        if self._ready[index]:
            raise RuntimeError(
                f"{CALLER}: parameter {self._names[index]!r} got a second gradient before "
                "wait(); call bucketer.wait() after each backward, or accumulate micro-batches "
                "inside `with bucketer.no_sync():`"
            )
        for grad_ready in self._grad_ready_hooks.values():
            grad_ready(index, param)
        self._ready[index] = True
        self._in_step = True
        if self._ready_order is not None:
            self._ready_order.append(index)
        b, pos = self._bucket_of[index]
        bucket = self._buckets[b]
        view = bucket.views[pos]
        if not _holds(param, view):
            view.copy_(_local(param.grad))
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Issue every ready bucket from the next one in launch order, up to the first not ready."""
        order = self._launch_order
        while (
            self._next_to_launch < len(order)
            and self._buckets[order[self._next_to_launch]].pending == 0
        ):
            self._launch(order[self._next_to_launch])
            self._next_to_launch += 1

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        # Divide before summing, as DDP does, so low-precision buckets do not overflow.
        bucket.flat.div_(self._group_size)
        site = self._failures.site(self.process_group, "all_reduce", f"bucket {b}")
        with comm_dim("dp"):  # the report's dims tell it from tp's all-reduces (gloo)
            work = dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)
        bucket.work = site.wrap(work)
        wire_bytes = bucket.flat.numel() * bucket.flat.element_size()
        slot = self.recorder.launch(b, bucket.grad_bytes, wire_bytes)
        self.recorder.watch(slot, bucket.work.get_future())

    def end_backward(self) -> tuple[dict[int, torch.Tensor | None], int]:
        """Close the step's backward: every bucket launched.

        Returns:
            tuple: the parameters without a gradient this step (pass them to
            ``finish_bucket``) and the step index.
        """
        missing = self._zero_missing_gradients()
        self._launch_ready()
        step = self.recorder.step
        self.recorder.end_step()
        self._ready = [False] * len(self._params)
        self._next_to_launch = 0
        self._in_step = False
        return missing, step

    def _zero_missing_gradients(self) -> dict[int, torch.Tensor | None]:
        """Mark parameters with no gradient this step ready, contributing zeros.

        Returns them by index, with a copy of the old ``.grad`` where it lives in the bucket (so
        it can be put back if no rank used the parameter), else None.
        """
        kept: dict[int, torch.Tensor | None] = {}
        for i, ready in enumerate(self._ready):
            if ready:
                continue
            b, pos = self._bucket_of[i]
            bucket = self._buckets[b]
            view = bucket.views[pos]
            kept[i] = view.clone() if _holds(self._params[i], view) else None
            view.zero_()
            bucket.flags[pos] = 0
            bucket.pending -= 1
        return kept

    # -- after backward ------------------------------------------------------------------------

    def reduction_complete(self, bucket: int) -> bool:
        """Whether ``bucket``'s all-reduce has completed (``finish_bucket`` will not block)."""
        return self._buckets[bucket].work.is_completed()

    def finish_bucket(self, bucket: int, missing: Mapping[int, torch.Tensor | None]) -> None:
        """Wait for ``bucket``'s all-reduce; point the gradients at it; reset it.

        Raises:
            CollectiveFailure: the all-reduce failed: a rank died or is stuck (named).
        """
        entry = self._buckets[bucket]
        entry.work.wait()
        entry.work = None
        if self._finite is not None:
            self._finite.inspect(
                f"bucket {bucket}",
                entry.flat,
                lambda: [
                    (self._names[i], view)
                    for i, view in zip(entry.indices, entry.views, strict=True)
                ],
            )
        # Flags are read back only where this rank lacked a gradient: a parameter it used
        # itself is used somewhere by definition, and skipping the read avoids a device sync.
        used = entry.flags.tolist() if any(i in missing for i in entry.indices) else None
        for pos, i in enumerate(entry.indices):
            param, view = self._params[i], entry.views[pos]
            if i not in missing or used[pos] > 0:
                if not _holds(param, view):
                    _set_grad(param, view)
            elif missing[i] is not None:
                view.copy_(missing[i])
        entry.flags.fill_(1)
        entry.pending = len(entry.indices)

    def wait_in_flight(self) -> None:
        """Wait for every launched all-reduce that nobody has waited for; errors are logged.

        Leaves the buckets as they are (``finish_bucket`` still hands the results over).
        """
        for b, entry in enumerate(self._buckets):
            if entry.work is None:
                continue
            try:
                entry.work.wait()
            except Exception as error:  # a dead peer: nothing left to save at this point
                logger.warning("%s: all-reduce of bucket %d failed at exit: %s", CALLER, b, error)
                entry.work = None

    def reset_bucket(self, bucket: int) -> None:
        """Forget ``bucket``'s all-reduce without waiting for it and make it ready for a backward.

        For a step given up after a failure (a dead rank): its gradients are left as they are,
        and an all-reduce still in flight may yet write into the buffer, which no longer matters
        once the group has failed.
        """
        entry = self._buckets[bucket]
        entry.work = None
        entry.flags.fill_(1)
        entry.pending = len(entry.indices)

    @property
    def checks_finite(self) -> bool:
        """Whether finished buckets are checked for NaN/Inf (``check_finite=True``)."""
        return self._finite is not None

    def settle_nonfinite(self, step: int) -> bool:
        """Act now on the NaN/Inf that the finished buckets of ``step`` held, if checked.

        Returns:
            bool: whether the step was skipped (``on_nonfinite="skip"``: gradients dropped).

        Raises:
            NonFiniteGradients: ``check_finite`` with ``on_nonfinite="raise"`` found some.
        """
        return self._finite is not None and self._finite.finish_step(step)

    def register_step_end_hook(self, hook: Callable[[int], None]) -> RemovableHandle:
        """Call ``hook(step)`` at each ``end_step``, after a pending rebuild (the auto-tuner).

        Returns:
            RemovableHandle: ``handle.remove()`` unregisters it (also from inside the hook).
        """
        handle = RemovableHandle(self._step_end_hooks)
        self._step_end_hooks[handle.id] = hook
        return handle

    def end_step(self, step: int) -> None:
        """Close ``step`` once every bucket is finished: adopt rank 0's order if pending, run the
        step-end hooks, settle NaN/Inf.

        Raises:
            NonFiniteGradients: as ``settle_nonfinite``.
        """
        if self._ready_order is not None:
            self._adopt_rank0_order()
        for hook in list(self._step_end_hooks.values()):
            hook(step)
        self.settle_nonfinite(step)

    def _adopt_rank0_order(self) -> None:
        """Rebuild the buckets once in the gradient-ready order rank 0 observed."""
        seen = self._ready_order
        order = seen + [i for i in reversed(range(len(self._params))) if i not in set(seen)]
        self._ready_order = None
        order_t = torch.tensor(order, dtype=torch.int64, device=self._buckets[0].flat.device)
        dist.broadcast(
            order_t, src=dist.get_global_rank(self.process_group, 0), group=self.process_group
        )
        self._rebuild_keeping_grads(order_t.tolist())
        logger.info(
            "%s: rebuilt %d buckets in rank 0's gradient-ready order", CALLER, len(self._buckets)
        )

    def remove(self) -> None:
        """Detach the gradient hooks from the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
