"""``ok.GradBucketer``: bucketed asynchronous gradient all-reduce for models not wrapped in DDP.

The overlap loop::

    loss.backward()      # each parameter's post-accumulate-grad hook copies its gradient into
                         # its bucket; a full bucket's all-reduce is issued at once (async)
    bucketer.wait()      # issue what is left, wait, gradients now hold the average
    optimizer.step()

Buckets are issued in bucket order on every rank, because gloo and NCCL match collectives by the
order they are issued in. The first step uses reverse registration order (the usual order of
readiness); after it, the buckets are rebuilt once in the order rank 0 saw gradients become ready
and every rank adopts that layout. Flat buffers are allocated per layout, never per step, and after
``wait()`` each ``param.grad`` is a view into its bucket, so the next backward accumulates in place
and needs no copy (unless the optimizer sets gradients to None, in which case one copy is made).

A parameter that gets no gradient on a rank in a step contributes zeros. Each bucket carries one
"used" flag per parameter, reduced with the gradients, so every rank agrees on which parameters
got a gradient somewhere: those receive the average; parameters unused on every rank keep their
``.grad`` unchanged (None stays None), as DDP does.

Tensor-parallel (DTensor) parameters are reduced shard by shard: each rank's bucket holds its own
local shards and the all-reduce runs over the bucketer's (data-parallel) group only; gradients
are handed back as DTensors with the parameter's placements.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from overlapkit.ddp.bucket_size import resolve_bucket_mb
from overlapkit.ddp.comm_stats import CommRecorder, register_recorder
from overlapkit.ddp.finite import FiniteCheck, validate_finite_options
from overlapkit.ddp.options import trainable_parameters, validate_bucket_mb
from overlapkit.ddp.overlapped_step import (
    OverlappedStep,
    resolve_overlap_options,
    tail_launch_order,
    validate_optimizer,
)
from overlapkit.ddp.tuning import attach_bucketer_tuner, wants_auto_bucket_mb
from overlapkit.group.consistency import check_consistent
from overlapkit.group.failures import FailureScope
from overlapkit.group.process_group import resolve_process_group

logger = logging.getLogger(__name__)

MiB = 1024 * 1024


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a tensor-parallel parameter or gradient), else the tensor.

    The bucketer reduces over its own group (data parallel), so it works on local shards: the
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


class GradBucketer:
    """Average gradients across a process group with bucketed all-reduces issued during backward.

    Args:
        model (nn.Module): the local replica; its trainable parameters are reduced.
        bucket_mb (float | None): bucket size in MiB; a bucket is closed once it holds at least
            this much (DDP's rule). None (the default) means about 1/8 of the model's gradient,
            between 1 and 25 MiB (see ``overlapkit.ddp.bucket_size``). ``"auto"`` tries a few
            sizes during the first steps and keeps the fastest (``ok.tuning_report``).
        process_group (ProcessGroup | None): group to average over (for example the ``dp`` group
            of a device mesh); None means the world.
        check_finite (bool): after reduction, look for NaN/Inf in every bucket (one
            sum per bucket); all ranks see the same result (``overlapkit.ddp.finite``).
            Defaults to False: nothing is checked, at no cost.
        on_nonfinite (str): with ``check_finite``: ``"raise"`` (``NonFiniteGradients`` from
            ``wait()`` on every rank, naming the parameters) or ``"skip"`` (every ``.grad`` set
            to None, so ``optimizer.step()`` changes nothing; the step is listed in
            ``ok.comm_stats(bucketer).skipped_steps``). Defaults to ``"raise"``.
        optimizer (torch.optim.Optimizer | None): attach the optimizer of the model's
            parameters: ``bucketer.step()`` then replaces ``wait(); optimizer.step();
            optimizer.zero_grad()``, applying each bucket's update once its all-reduce is done
            and letting the next forward start before the last buckets are reduced
            (``overlapkit.ddp.overlapped_step``). Defaults to None (``wait()`` as usual).
        forward_order_tail (int | None): with ``optimizer``: the last this-many buckets of
            backward (the first layers) are launched first-layer first, so the next forward's
            first modules wait for less. None (the default) means 2; 0 keeps backward order.

    Raises:
        ValueError: ``bucket_mb <= 0`` or the model has no trainable parameters.
        RuntimeError: torch.distributed is not initialised.
        ConfigMismatch: the ranks of the group passed different options or models
            (``overlapkit.group.consistency``; one 32-byte all-gather when they agree).

    Example::
        >>> bucketer = ok.GradBucketer(model, bucket_mb=4)
        >>> loss_fn(model(x), y).backward()
        >>> bucketer.wait()
        >>> optimizer.step()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        bucket_mb: float | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        check_finite: bool = False,
        on_nonfinite: str = "raise",
        optimizer: torch.optim.Optimizer | None = None,
        forward_order_tail: int | None = None,
    ):
        self._params = trainable_parameters(model, caller="ok.GradBucketer")
        validate_finite_options(check_finite, on_nonfinite, caller="ok.GradBucketer")
        auto = wants_auto_bucket_mb(bucket_mb, caller="ok.GradBucketer")
        self._tail = resolve_overlap_options(
            optimizer, forward_order_tail, auto_bucket_mb=auto, on_nonfinite=on_nonfinite
        )
        self.bucket_mb = resolve_bucket_mb(
            None if auto else bucket_mb, self._params, caller="ok.GradBucketer"
        )
        self.process_group = resolve_process_group(process_group, caller="ok.GradBucketer")
        check_consistent(
            model,
            self.process_group,
            caller="ok.GradBucketer",
            options={
                "bucket_mb": bucket_mb,
                "check_finite": check_finite,
                "on_nonfinite": on_nonfinite,
                "optimizer": None if optimizer is None else type(optimizer).__name__,
                "forward_order_tail": self._tail,
            },
        )
        ids = {id(p) for p in self._params}
        self._names = [n for n, p in model.named_parameters() if id(p) in ids]
        if optimizer is not None:
            validate_optimizer(optimizer, self._params, self._names)
        self._group_size = self.process_group.size()
        self._recorder = CommRecorder(device=self._params[0].device)
        self._failures = FailureScope("ok.GradBucketer", lambda: self._recorder.step)
        self._finite = (
            FiniteCheck(
                "ok.GradBucketer",
                on_nonfinite,
                self._recorder,
                zip(self._names, self._params, strict=True),
            )
            if check_finite
            else None
        )
        self._sync = True
        self._in_step = False
        self._ready = [False] * len(self._params)
        self._ready_order: list[int] | None = []
        self._next_to_launch = 0
        self._build(list(reversed(range(len(self._params)))))
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self._params)
        ]
        register_recorder(self, self._recorder)
        self._tuner = attach_bucketer_tuner(self) if auto else None
        self._overlap = None if optimizer is None else OverlappedStep(self, model, optimizer)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def bucket_parameter_names(self) -> list[list[str]]:
        """The parameter names in each bucket, in launch order."""
        return [[self._names[i] for i in b.indices] for b in self._buckets]

    def state_dict(self) -> dict[str, object]:
        """The bucket layout, to save with a checkpoint (plain values only).

        The buckets are rebuilt once, after the first step, in the order rank 0 saw gradients
        become ready; a new bucketer starts from reverse registration order. The ring
        all-reduce's summation order follows the flat layout, so a resumed run needs the
        layout back to reduce bit for bit as the uninterrupted run does.

        Returns:
            dict: ``"parameters"``: parameter names in layout order (bucket after bucket);
            ``"bucket_mb"``: the bucket size in MiB; ``"ready_order_adopted"``: whether the
            rebuild in rank 0's ready order has happened (if not, it happens after the next
            step).
        """
        return {
            "parameters": [self._names[i] for bucket in self._buckets for i in bucket.indices],
            "bucket_mb": self.bucket_mb,
            "ready_order_adopted": self._ready_order is None,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Rebuild the buckets in a layout from ``state_dict()``; between steps, on every rank.

        With ``bucket_mb="auto"`` the tuner still starts over, and may change the size again.

        Raises:
            RuntimeError: called between a backward and ``wait()``.
            ValueError: the layout names other parameters than this bucketer reduces, or
                ``bucket_mb`` is not a positive finite number of MiB.
            TypeError: ``bucket_mb`` is not a number.
        """
        if self._in_step:
            raise RuntimeError(
                "ok.GradBucketer.load_state_dict() was called between a backward and wait(); "
                "load the layout before training, or after wait()"
            )
        names = list(state["parameters"])
        if sorted(names) != sorted(self._names):
            extra = sorted(set(names) - set(self._names))
            absent = sorted(set(self._names) - set(names))
            raise ValueError(
                "ok.GradBucketer.load_state_dict: the saved layout is of another model: it names "
                f"{extra} that this bucketer does not reduce and lacks {absent} "
                f"({len(names)} saved names, {len(self._names)} here)"
            )
        self.bucket_mb = validate_bucket_mb(
            state["bucket_mb"], caller="ok.GradBucketer.load_state_dict"
        )
        self._ready_order = None if state["ready_order_adopted"] else []
        index = {name: i for i, name in enumerate(self._names)}
        self._rebuild_keeping_grads([index[name] for name in names])

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

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(index, param)

        return hook

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        if not self._sync:
            return
        if self._ready[index]:
            raise RuntimeError(
                f"ok.GradBucketer: parameter {self._names[index]!r} got a second gradient before "
                "wait(); call bucketer.wait() after each backward, or accumulate micro-batches "
                "inside `with bucketer.no_sync():`"
            )
        if self._overlap is not None:
            self._overlap.grad_handed_over(index, param)
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
        bucket.work = site.wrap(
            dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)
        )
        wire_bytes = bucket.flat.numel() * bucket.flat.element_size()
        slot = self._recorder.launch(b, bucket.grad_bytes, wire_bytes)
        self._recorder.watch(slot, bucket.work.get_future())

    def wait(self) -> None:
        """Finish this step's reduction; afterwards every ``.grad`` holds the group average.

        Raises:
            RuntimeError: no backward has produced gradients since the last ``wait()``.
            NonFiniteGradients: ``check_finite=True, on_nonfinite="raise"`` and a bucket held
                NaN/Inf after the all-reduce (on every rank alike).
            CollectiveFailure: an all-reduce failed: a rank died or is stuck (named).
        """
        if self._overlap is not None:
            raise RuntimeError(
                "ok.GradBucketer.wait() is the synchronous form; this bucketer was given "
                "optimizer=, so call bucketer.step() (it replaces wait(), optimizer.step() and "
                "optimizer.zero_grad())"
            )
        if not self._in_step:
            raise RuntimeError(
                "ok.GradBucketer.wait() was called but no backward has produced gradients since "
                "the last wait() (or all ran inside no_sync()); call loss.backward() first"
            )
        missing, step = self._end_backward()
        for b in self._launch_order:
            self._finish_bucket(b, missing)
        self._end_step(step)

    def step(self) -> None:
        """With ``optimizer=``: start this step's per-bucket updates and return at once.

        Replaces ``wait(); optimizer.step(); optimizer.zero_grad()``; parameters are final when
        a module's forward reaches them, or after ``synchronize()`` (see
        ``overlapkit.ddp.overlapped_step``).

        Raises:
            RuntimeError: no ``optimizer=`` was given, or no backward since the last step.
            OverlapConflict: gradients were edited after backward (clipping, ``GradScaler``).
        """
        if self._overlap is None:
            raise RuntimeError(
                "ok.GradBucketer.step() needs the optimizer: ok.GradBucketer(model, "
                "optimizer=opt); without it call bucketer.wait() and then optimizer.step()"
            )
        self._overlap.step()

    def synchronize(self) -> None:
        """With ``optimizer=``: apply every pending update now (no-op otherwise)."""
        if self._overlap is not None:
            self._overlap.synchronize()

    def _end_backward(self) -> tuple[dict[int, torch.Tensor | None], int]:
        """Close the step's backward: every bucket launched; returns (missing, step)."""
        missing = self._zero_missing_gradients()
        self._launch_ready()
        step = self._recorder.step
        self._recorder.end_step()
        self._ready = [False] * len(self._params)
        self._next_to_launch = 0
        self._in_step = False
        return missing, step

    def _finish_bucket(self, b: int, missing: dict[int, torch.Tensor | None]) -> None:
        """Wait for bucket ``b``'s all-reduce; point the gradients at it; reset it."""
        bucket = self._buckets[b]
        bucket.work.wait()
        bucket.work = None
        if self._finite is not None:
            self._finite.inspect(
                f"bucket {b}",
                bucket.flat,
                lambda: [
                    (self._names[i], view)
                    for i, view in zip(bucket.indices, bucket.views, strict=True)
                ],
            )
        # Flags are read back only where this rank lacked a gradient: a parameter it used
        # itself is used somewhere by definition, and skipping the read avoids a device sync.
        used = bucket.flags.tolist() if any(i in missing for i in bucket.indices) else None
        for pos, i in enumerate(bucket.indices):
            param, view = self._params[i], bucket.views[pos]
            if i not in missing or used[pos] > 0:
                if not _holds(param, view):
                    _set_grad(param, view)
            elif missing[i] is not None:
                view.copy_(missing[i])
        bucket.flags.fill_(1)
        bucket.pending = len(bucket.indices)

    def _end_step(self, step: int) -> None:
        if self._ready_order is not None:
            self._adopt_rank0_order()
        if self._tuner is not None:
            self._tuner.step_ended(self._recorder.step - 1)
        if self._finite is not None:
            self._finite.finish_step(step)

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
            "ok.GradBucketer: rebuilt %d buckets in rank 0's gradient-ready order",
            len(self._buckets),
        )

    def _rebuild_keeping_grads(self, order: list[int]) -> None:
        old_grads = [p.grad for p in self._params]
        self._build(order)
        for i, grad in enumerate(old_grads):
            if grad is not None:
                b, pos = self._bucket_of[i]
                view = self._buckets[b].views[pos]
                view.copy_(_local(grad))
                _set_grad(self._params[i], view)

    def _set_bucket_mb(self, bucket_mb: float) -> None:
        """Rebuild the buckets at ``bucket_mb`` MiB in the current order (between steps)."""
        self.bucket_mb = bucket_mb
        self._rebuild_keeping_grads([i for bucket in self._buckets for i in bucket.indices])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backwards inside the block issue no communication.

        The first backward after the block reduces everything accumulated.
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def remove(self) -> None:
        """Detach the gradient hooks (with ``optimizer=``: after applying what is pending)."""
        if self._overlap is not None:
            self._overlap.remove()
        for handle in self._handles:
            handle.remove()
        self._handles = []
