"""``GradBucketer(model, optimizer=opt)``: the optimizer applied bucket by bucket, overlapping the
all-reduce tail with the next forward.

The loop::

    loss.backward()      # buckets are all-reduced asynchronously as their gradients are ready
    bucketer.step()      # replaces wait(); optimizer.step(); optimizer.zero_grad()
    model(next_x)        # each module first waits for (and applies) the buckets of its own
                         # parameters only; the rest of the all-reduces keep running

``GradBucketer`` builds a ``PerBucketStep`` over its bucket reducer and forwards ``step()`` and
``synchronize()`` to it; the scheduler sees the reducer only through the ``BucketReduction``
Protocol (``overlapkit.optim.protocols``): its launch order, ``end_backward``, per-bucket
``reduction_complete`` / ``finish_bucket``, the gradient views and a grad-ready hook.

**What runs where.** ``step()`` snapshots every param group's hyper-parameters (so an LR
scheduler stepped right after it changes the *next* step, as with ``optimizer.step()``), then:

- on CUDA, issues every bucket's update on a side stream at once: the stream waits for the
  bucket's all-reduce (NCCL work) and runs the optimizer, so the GPU updates each bucket as soon
  as its all-reduce completes; a module's forward pre-hook makes the compute stream wait for the
  events of its buckets only;
- on CPU (gloo), applies on the training thread, never concurrently with user code: at
  ``step()`` the buckets whose all-reduce already completed; later, in a module's forward
  pre-hook, its own buckets (first applying any other bucket whose all-reduce has completed
  while it waits). Applying on the training thread means nothing races with the user's
  ``zero_grad``, LR scheduler or checkpoint code, and the CPU work is the same as the
  synchronous path's, moved into the time it would spend waiting.

Anything else that reads parameters sees every update applied: ``model.state_dict()``,
``load_state_dict()``, ``optimizer.state_dict()`` / ``load_state_dict()`` (so DCP checkpoints
too) call ``synchronize()`` through pre-hooks; so does ``bucketer.synchronize()``. Code that reads
``param`` tensors directly between ``step()`` and the next forward must call ``synchronize()``.

**The optimizer is the user's.** A bucket is updated by ``overlapkit.optim.subset.step_subset``:
the optimizer class's own ``step`` on a view restricted to the bucket's parameters, with the
hyper-parameters snapshotted at ``step()`` and the user's ``optimizer.state``. The result is
bitwise equal to ``wait(); optimizer.step(); optimizer.zero_grad()`` and
``optimizer.state_dict()`` is the same object either way.

**What cannot be overlapped is refused** (each error says why and what to use instead): global
gradient-norm clipping, ``GradScaler`` and anything that edits gradients between backward and
``step()`` (detected by the gradients' version counters), since they need every reduced gradient
before any update; ``optimizer.step()`` called directly; optimizers whose step needs a closure
(LBFGS) or that carry step hooks; ``check_finite`` with ``on_nonfinite="skip"`` (a skip decision
needs every bucket); ``bucket_mb="auto"``; tensor-parallel (DTensor) parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from overlapkit.optim.protocols import BucketReduction, MissingGradients
from overlapkit.optim.subset import group_of, hyper_parameters, mark_stepped, step_subset

logger = logging.getLogger(__name__)

CALLER = "ok.GradBucketer(optimizer=...)"
DEFAULT_TAIL = 2
"""Buckets at the end of backward launched first-layer first (``forward_order_tail=None``)."""
_SYNCHRONOUS_FORM = (
    "use the synchronous form instead: ok.GradBucketer(model) (no optimizer=), then "
    "loss.backward(); bucketer.wait(); <clip/unscale>; optimizer.step()"
)


class OverlapConflict(RuntimeError):
    """Something needs every reduced gradient before any update, which per-bucket updates lack."""


def validate_optimizer(
    optimizer: object, params: list[torch.nn.Parameter], names: list[str]
) -> torch.optim.Optimizer:
    """Check that ``optimizer`` can be applied per bucket to the bucketer's parameters.

    Raises:
        TypeError: not a ``torch.optim.Optimizer``.
        ValueError: LBFGS, step hooks registered, a parameter the bucketer does not reduce,
            or DTensor parameters.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{CALLER}: optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            f"{CALLER}: LBFGS's step(closure) re-evaluates the loss over every parameter, so it "
            f"cannot run per bucket; {_SYNCHRONOUS_FORM}"
        )
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        raise ValueError(
            f"{CALLER}: the optimizer has step pre/post hooks, which would run once per bucket; "
            "remove them or use GradBucketer without optimizer="
        )
    ours = {id(p) for p in params}
    for g, group in enumerate(optimizer.param_groups):
        for k, p in enumerate(group["params"]):
            if id(p) not in ours:
                raise ValueError(
                    f"{CALLER}: optimizer.param_groups[{g}]['params'][{k}] (shape "
                    f"{tuple(p.shape)}) is not a trainable parameter of the model given to the "
                    "bucketer, so no bucket would ever update it"
                )
    tensor_parallel = [n for n, p in zip(names, params, strict=True) if isinstance(p, DTensor)]
    if tensor_parallel:
        raise ValueError(
            f"{CALLER}: tensor-parallel (DTensor) parameters are not supported with per-bucket "
            f"updates (found {tensor_parallel[:3]}...); {_SYNCHRONOUS_FORM}"
        )
    return optimizer


def resolve_overlap_options(
    optimizer: object, forward_order_tail: int | None, *, auto_bucket_mb: bool, on_nonfinite: str
) -> int:
    """Check the bucketer options that interact with ``optimizer=``; returns the tail length.

    Raises:
        ValueError: ``forward_order_tail`` without ``optimizer``, or not an int >= 0;
            ``bucket_mb="auto"`` or ``on_nonfinite="skip"`` with ``optimizer``.
    """
    if optimizer is None:
        if forward_order_tail not in (None, 0):
            raise ValueError(
                f"ok.GradBucketer: forward_order_tail={forward_order_tail!r} only applies with "
                "optimizer= (it orders the launches for the next forward)"
            )
        return 0
    if auto_bucket_mb:
        raise ValueError(
            f"{CALLER}: bucket_mb='auto' rebuilds the buckets between steps while updates are "
            "pending; pass a size in MiB (or None for the default)"
        )
    if on_nonfinite == "skip":
        raise ValueError(
            f"{CALLER}: on_nonfinite='skip' drops a whole step when any bucket holds NaN/Inf, "
            "which needs every bucket before any update; use on_nonfinite='raise' (the bucket "
            "with NaN/Inf is not applied and step()/forward raises) or GradBucketer without "
            "optimizer="
        )
    if forward_order_tail is None:
        return DEFAULT_TAIL
    if (
        isinstance(forward_order_tail, bool)
        or not isinstance(forward_order_tail, int)
        or forward_order_tail < 0
    ):
        raise ValueError(
            f"{CALLER}: forward_order_tail must be an int >= 0, got {forward_order_tail!r}"
        )
    return forward_order_tail


@dataclass
class _Job:
    """One ``step()``'s pending bucket updates."""

    step: int
    hyper: list[dict]
    """Per user param group, its hyper-parameters at ``step()`` (without ``params``)."""
    group_of: dict[int, int]
    """``id(param)`` -> index of the user's param group holding it."""
    missing: MissingGradients
    """The reduction's parameters without a gradient this step (``end_backward()``)."""
    pending: list[int]
    """Buckets not applied yet, in launch order."""
    events: dict[int, torch.Event] = field(default_factory=dict)
    """On CUDA: per bucket, the side-stream event after its update."""


class PerBucketStep:
    """The optimizer side of ``GradBucketer(optimizer=...)``; see the module docstring.

    Args:
        reduction (BucketReduction): the bucketer's reducer (its buckets, launch order, hooks).
        model (nn.Module): the model given to the bucketer (forward pre-hooks go on its modules).
        optimizer (torch.optim.Optimizer): validated by ``validate_optimizer``.
    """

    def __init__(
        self, reduction: BucketReduction, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ):
        self._reduction = reduction
        self.optimizer = optimizer
        self._job: _Job | None = None
        self._handed: dict[int, tuple[torch.Tensor, int]] = {}
        params = reduction.params
        device = params[0].device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        index = {id(p): i for i, p in enumerate(params)}
        self._handles: list[RemovableHandle] = [
            reduction.register_grad_ready_hook(self.grad_handed_over)
        ]
        for module in model.modules():
            own = sorted({index[id(p)] for p in module.parameters(recurse=False) if id(p) in index})
            if own:
                self._handles.append(module.register_forward_pre_hook(self._pre_forward(own)))
        sync = self._synchronize_hook
        self._handles += [
            model.register_state_dict_pre_hook(sync),
            model.register_load_state_dict_pre_hook(sync),
            optimizer.register_state_dict_pre_hook(sync),
            optimizer.register_load_state_dict_pre_hook(sync),
            optimizer.register_step_pre_hook(self._refuse_direct_step),
        ]

    # -- the training loop's side ------------------------------------------------------------

    def grad_handed_over(self, index: int, param: torch.Tensor) -> None:
        """From the reduction's grad-ready hook, before the gradient is copied into its bucket."""
        # The first gradient of a backward finishes the previous step: what the forward did not
        # need (a module it skipped) is applied now, before any bucket buffer is reused.
        self.synchronize()
        if param.grad.data_ptr() == self._reduction.grad_view(index).data_ptr():
            # Already its bucket view (a parameter the optimizer does not update keeps it): the
            # bucket's own division bumps its version, so versions say nothing here.
            return
        self._handed[index] = (param.grad, param.grad._version)

    def step(self) -> None:
        """Hand this step's buckets over for per-bucket updates and return (see module doc)."""
        reduction = self._reduction
        if not reduction.in_step:
            raise RuntimeError(
                "ok.GradBucketer.step() was called but no backward has produced gradients since "
                "the last step() (or all ran inside no_sync()); call loss.backward() first"
            )
        self._refuse_edited_gradients()
        hyper = hyper_parameters(self.optimizer)
        groups = group_of(self.optimizer)
        mark_stepped(self.optimizer)
        missing, step = reduction.end_backward()
        self._job = _Job(step, hyper, groups, missing, list(reduction.launch_order))
        if reduction.rebuild_pending:
            # The first step rebuilds the buckets in rank 0's order: every update must land first.
            for b in list(self._job.pending):
                self._apply(b)
            self._job = None
            reduction.end_step(step)
        elif self._stream is not None:
            self._issue_on_side_stream()
        else:
            self._apply_completed()

    def synchronize(self) -> None:
        """Apply every pending update (on CUDA: order the current stream after them)."""
        job = self._job
        if job is None:
            return
        if self._stream is not None:
            current = torch.cuda.current_stream(self._stream.device)
            for event in job.events.values():
                current.wait_event(event)
        else:
            self.wait_for(set(job.pending))
        self._job = None

    def wait_for(self, buckets: set[int]) -> None:
        """Make the updates of ``buckets`` visible to the caller (apply them, or wait on CUDA)."""
        job = self._job
        if job is None:
            return
        if self._stream is not None:
            current = torch.cuda.current_stream(self._stream.device)
            for b in buckets:
                current.wait_event(job.events[b])
            return
        for b in [b for b in job.pending if b in buckets]:
            if b not in job.pending:  # applied below, while waiting for an earlier one
                continue
            if not self._reduction.reduction_complete(b):
                # Fill the wait with updates whose all-reduce has already finished.
                self._apply_completed(skip=buckets)
            self._apply(b)

    def remove(self) -> None:
        """Apply what is pending and detach every hook."""
        self.synchronize()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- internals ---------------------------------------------------------------------------

    def _pre_forward(self, own: list[int]) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: object) -> None:
            if self._job is not None:
                # Bucket positions are re-read per call: the layout can be rebuilt.
                self.wait_for({self._reduction.bucket_of(i) for i in own})

        return hook

    def _synchronize_hook(self, *_: object, **__: object) -> None:
        self.synchronize()

    def _refuse_direct_step(self, *_: object) -> None:
        # Outside a step (no gradients handed over, nothing pending) a direct step is someone
        # initialising state, e.g. DCP's ``get_state_dict`` on a fresh optimizer: let it run.
        if not self._reduction.in_step and self._job is None:
            return
        raise OverlapConflict(
            f"optimizer.step() was called on the optimizer given to {CALLER}; bucketer.step() "
            "applies it per bucket (and zeroes the gradients). If this is GradScaler's "
            "scaler.step(optimizer): its inf-check needs every reduced gradient before any "
            f"update, which per-bucket updates cannot offer; {_SYNCHRONOUS_FORM}"
        )

    def _refuse_edited_gradients(self) -> None:
        handed, self._handed = self._handed, {}
        for i, (grad, version) in handed.items():
            param = self._reduction.params[i]
            if param.grad is None:
                continue  # zeroed: the reduced bucket is applied regardless, as in wait()
            if param.grad is not grad or grad._version != version:
                raise OverlapConflict(
                    f"{CALLER}: the gradient of {self._reduction.names[i]!r} was changed after "
                    "backward handed it to its bucket (clip_grad_norm_, GradScaler.unscale_ or "
                    "an in-place edit?). bucketer.step() applies the all-reduced bucket, so the "
                    "change would be lost. Global-norm clipping and GradScaler need every reduced "
                    "gradient before any update; clipping each bucket by its own norm is "
                    f"different math, so it is not offered; {_SYNCHRONOUS_FORM}"
                )

    def _apply_completed(self, skip: set[int] = frozenset()) -> None:
        job = self._job
        for b in list(job.pending):
            if b not in skip and self._reduction.reduction_complete(b):
                self._apply(b)

    def _issue_on_side_stream(self) -> None:
        job = self._job
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        # Made on the compute stream, read on the side stream, freed with the job: keep their
        # memory from being reused before the side stream is done with them.
        for kept in job.missing.values():
            if kept is not None:
                kept.record_stream(stream)
        for group in job.hyper:
            for value in group.values():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(stream)
        with torch.cuda.stream(stream):
            for b in list(job.pending):
                self._apply(b)  # work.wait() here only makes the side stream wait for NCCL
                job.events[b] = stream.record_event()

    def _apply(self, b: int) -> None:
        """Finish bucket ``b``'s reduction, update its parameters, drop their gradients."""
        job = self._job
        reduction = self._reduction
        job.pending.remove(b)
        reduction.finish_bucket(b, job.missing)
        reduction.settle_nonfinite(job.step)  # raise mode: this bucket's NaN/Inf, now
        params = [reduction.params[i] for i in reduction.bucket_indices(b)]
        mine = [p for p in params if id(p) in job.group_of]
        step_subset(self.optimizer, mine, hyper=job.hyper, groups=job.group_of)
        for p in mine:
            p.grad = None  # optimizer.zero_grad()'s default, for this bucket's parameters
        if not job.pending and self._stream is None:
            self._job = None
