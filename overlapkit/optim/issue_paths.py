"""Where and when a per-bucket step's work runs: on the training thread, or on a CUDA side stream.

``PerBucketStep`` (``overlapkit.optim.per_bucket``) keeps a step's state and does each bucket's
work (``land``, ``decide``, ``update``); its issue path, chosen once from the parameters' device,
runs that work:

- ``CudaIssuePath`` issues the updates on a side stream at once: the stream waits for each
  bucket's all-reduce (NCCL work) and runs the optimizer; a module's forward pre-hook makes the
  compute stream wait for the events of its buckets only. Nothing in ``step()`` waits on the
  host, except what cannot be decided on the device: with ``check_finite`` or a GradScaler and
  an optimizer that cannot take ``found_inf`` itself (not ``fused=True``), one host read of the
  verdict, made where the next forward first needs an update; a bucket holding a parameter this
  rank did not use, whose used-flags are read on the host at the same point (in ``step()``
  itself when a GradScaler needs every bucket there); ``error_if_nonfinite=True``, which reads
  the norm in ``step()``, as torch does. With a scaler, the current stream waits for the last
  bucket at ``step()``, so that ``scaler.update()`` reads the final ``found_inf``.
- ``CpuIssuePath`` (gloo) applies on the training thread, never concurrently with user code:
  at ``step()`` the buckets whose all-reduce already completed (without a gate; with one, their
  norms); later, in a forward pre-hook, those the module needs. With a scaler or
  ``error_if_nonfinite``, ``step()`` itself waits for every bucket, since ``scaler.update()``
  (or the error) comes right after.

A path reaches the scheduler through its public methods only. An error in the work it runs
makes the scheduler forget the step (``PerBucketStep.abandon``) before it propagates, so every
bucket is left ready for the next backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from overlapkit.optim.overlap_checks import refuse_host_synced_lr
from overlapkit.optim.pending_step import PendingStep
from overlapkit.optim.protocols import BucketReduction


class BucketWork(Protocol):
    """What an issue path asks of the step's owner (``PerBucketStep``): the pending step and the
    work on each bucket, which the path runs when, and on which stream, its device allows.

    ``land``, ``decide`` and ``update`` are called only while ``job`` is not None; ``update(b)``
    only after ``land(b)``, and with a gate only after ``decide()``.
    """

    @property
    def job(self) -> PendingStep | None:
        """The step whose updates are pending; None between steps."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The user's optimizer (its ``state`` holds what an update created)."""
        ...

    def land(self, b: int) -> None:
        """Finish bucket ``b``'s reduction and take its gradients."""
        ...

    def decide(self) -> None:
        """Every bucket has landed: the total norm, the clip and the skip."""
        ...

    def update(self, b: int) -> None:
        """Update bucket ``b``'s parameters (it has landed)."""
        ...

    def finish(self) -> None:
        """Every update is applied: forget the step, run the post-hooks."""
        ...

    def abandon(self) -> None:
        """After an error: forget the step, leave every bucket ready for the next backward."""
        ...

    def synchronize(self) -> None:
        """Apply every pending update."""
        ...


class IssuePath(Protocol):
    """What ``PerBucketStep`` asks of the path of its device.

    ``wait_for``, ``synchronize`` and ``decide_now`` are called only while a step is pending
    (``scheduler.job`` is not None); ``decide_now`` only while its gate clips, undecided.
    """

    def refuse(self, hyper: list[dict]) -> None:
        """At ``step()``: refuse hyper-parameters this path could not run without a host sync."""
        ...

    def at_step(self) -> None:
        """What ``step()`` itself runs or issues of the step just made pending (not of a
        rebuild step, which the scheduler runs at once on the current stream)."""
        ...

    def wait_for(self, buckets: set[int]) -> None:
        """Make the updates of ``buckets`` visible to the caller (apply them, or wait)."""
        ...

    def synchronize(self) -> None:
        """Apply every pending update (on CUDA: order the current stream after them)."""
        ...

    def decide_now(self) -> None:
        """Land every bucket and decide the gate, so that the total norm is final."""
        ...

    def keep_norm(self, norm: torch.Tensor) -> None:
        """Hold the total norm the scheduler's ``decide()`` just computed."""
        ...

    def kept_norm(self) -> torch.Tensor | None:
        """The last norm kept, ready for the caller to read; None before any."""
        ...

    def updated(self, fresh: list[torch.Tensor]) -> None:
        """After an update: ``fresh`` are the parameters whose optimizer state it created."""
        ...


def _guarded(scheduler: BucketWork, work: Callable[[], None]) -> None:
    """Run ``work`` outside inference mode; on any error, forget the step before it propagates.

    Deferred updates run wherever the next forward or a checkpoint needs them, which may be
    inside ``torch.inference_mode()`` (an evaluation, a callback's sample): optimizer state created
    there would be an inference tensor, which the next step may not update in place.
    """
    try:
        with torch.inference_mode(False), torch.no_grad():
            work()
    except BaseException:
        scheduler.abandon()
        raise


class CpuIssuePath:
    """The training thread runs every update, at ``step()`` or in a forward pre-hook.

    Args:
        scheduler (BucketWork): the step's owner (``PerBucketStep``).
        reduction (BucketReduction): its reducer (whose all-reduces have completed).
    """

    def __init__(self, scheduler: BucketWork, reduction: BucketReduction):
        self._scheduler = scheduler
        self._reduction = reduction
        self._norm: torch.Tensor | None = None

    def refuse(self, hyper: list[dict]) -> None:
        """Nothing: a tensor ``lr`` read on the host costs no device sync here."""

    def at_step(self) -> None:
        gate = self._scheduler.job.gate
        if gate is not None and (gate.scaled is not None or gate.error_if_nonfinite):
            # scaler.update() (or the error) comes right after step(): decide now.
            self._decide()
            return
        self._land_completed(set())

    def wait_for(self, buckets: set[int]) -> None:
        _guarded(self._scheduler, lambda: self._wait_for(buckets))

    def synchronize(self) -> None:
        job = self._scheduler.job
        self.wait_for(set(job.to_land) | set(job.to_update))

    def decide_now(self) -> None:
        _guarded(self._scheduler, self._decide)

    def keep_norm(self, norm: torch.Tensor) -> None:
        self._norm = norm

    def kept_norm(self) -> torch.Tensor | None:
        return self._norm

    def updated(self, fresh: list[torch.Tensor]) -> None:
        """Nothing: state made on this thread is read on it."""

    def _land_completed(self, skip: set[int]) -> None:
        """Land (without a gate: and update) every bucket whose all-reduce has completed."""
        scheduler = self._scheduler
        job = scheduler.job
        for b in list(job.to_land):
            if b not in skip and self._reduction.reduction_complete(b):
                scheduler.land(b)
                if job.gate is None:
                    scheduler.update(b)
        if job.gate is None and not job.to_update:
            scheduler.finish()

    def _decide(self) -> None:
        scheduler = self._scheduler
        for b in list(scheduler.job.to_land):
            scheduler.land(b)
        scheduler.decide()

    def _wait_for(self, buckets: set[int]) -> None:
        scheduler = self._scheduler
        job = scheduler.job
        if job.gate is None:
            for b in [b for b in job.to_land if b in buckets]:
                if b not in job.to_land:  # landed below, while waiting for an earlier one
                    continue
                if not self._reduction.reduction_complete(b):
                    # Fill the wait with updates whose all-reduce has already finished.
                    self._land_completed(buckets)
                    if scheduler.job is None:
                        return
                scheduler.land(b)
                scheduler.update(b)
        else:
            if not job.gate.decided:
                self._decide()
            for b in [b for b in job.to_update if b in buckets]:
                scheduler.update(b)
        if not job.to_update:
            scheduler.finish()


class CudaIssuePath:
    """A side stream runs every update, issued at ``step()`` or where the host must decide first.

    Invariant: a bucket gets its event in ``job.events`` when its update is issued on
    ``stream``; the compute stream waits for ``stream`` only through events.

    Args:
        scheduler (BucketWork): the step's owner (``PerBucketStep``).
        reduction (BucketReduction): its reducer (which buckets' flags need a host read).
        device (torch.device): the parameters' CUDA device.
    """

    def __init__(self, scheduler: BucketWork, reduction: BucketReduction, device: torch.device):
        self._scheduler = scheduler
        self._reduction = reduction
        self._device = device
        self.stream = torch.cuda.Stream(device)
        """The side stream the updates run on."""
        self._compute: torch.cuda.Stream | None = None
        self._norm: tuple[torch.Tensor, torch.Event] | None = None

    def refuse(self, hyper: list[dict]) -> None:
        refuse_host_synced_lr(hyper)

    def at_step(self) -> None:
        scheduler = self._scheduler
        job = scheduler.job
        stream = self.stream
        self._compute = current = torch.cuda.current_stream(stream.device)
        stream.wait_stream(current)
        # Made on the compute stream, read on the side stream, freed with the job: keep their
        # memory from being reused before the side stream is done with them.
        for kept in job.missing.values():
            if kept is not None:
                kept.record_stream(stream)
        for group in job.hyper:
            for value in group.values():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(stream)
        gate = job.gate
        if gate is not None and gate.scaled is not None:
            for made_here in (gate.scaled.found_inf, gate.scaled.inv_scale, gate.scaled.grad_scale):
                if made_here is not None:
                    made_here.record_stream(stream)
        if job.clip is not None and job.clip.out is not None and job.clip.out.is_cuda:
            job.clip.out.record_stream(stream)  # clip_grad_norm_()'s norm, written by decide()
        # A bucket with a parameter this rank did not use reads its used-flags on the host; that
        # waits for its all-reduce, so it is left to the first forward that needs an update,
        # unless a scaler needs every bucket now.
        defer = gate is None or gate.scaled is None
        with torch.cuda.stream(stream):
            for b in list(job.to_land):
                if defer and self._needs_host_flags(b):
                    continue
                scheduler.land(b)
                if gate is None:
                    scheduler.update(b)
                    job.events[b] = stream.record_event()
            host_decision = gate is not None and (
                self._reduction.checks_finite
                or (gate.scaled is not None and not gate.scaled.takes_flags)
            )
            decide_now = gate is not None and (gate.error_if_nonfinite or not host_decision)
            if decide_now and not job.to_land:
                scheduler.decide()
                self._issue_updates()
        if gate is not None and gate.scaled is not None:
            # scaler.update() reads found_inf on this stream right after step().
            current.wait_event(stream.record_event())
        if job.post_hooks:
            scheduler.synchronize()  # post-hooks see every update applied

    def wait_for(self, buckets: set[int]) -> None:
        job = self._scheduler.job
        if any(b not in job.events for b in buckets if b in job.to_update or b in job.to_land):
            _guarded(self._scheduler, self._issue_rest)
        current = torch.cuda.current_stream(self.stream.device)
        for b in buckets:
            if b in job.events:
                current.wait_event(job.events[b])

    def synchronize(self) -> None:
        job = self._scheduler.job
        _guarded(self._scheduler, self._issue_rest)
        current = torch.cuda.current_stream(self.stream.device)
        for event in job.events.values():
            current.wait_event(event)
        self._scheduler.finish()

    def decide_now(self) -> None:
        _guarded(self._scheduler, self._issue_rest)

    def keep_norm(self, norm: torch.Tensor) -> None:
        self._norm = (norm, self.stream.record_event())

    def kept_norm(self) -> torch.Tensor | None:
        """The norm, once the current stream has waited for it (so ``.item()`` is final)."""
        if self._norm is None:
            return None
        norm, event = self._norm
        current = torch.cuda.current_stream(self.stream.device)
        current.wait_event(event)
        norm.record_stream(current)
        return norm

    def updated(self, fresh: list[torch.Tensor]) -> None:
        # Optimizer state created lazily by this update lives in the side stream's pool but is
        # read on the compute stream later (state_dict, the next step): tell the allocator. An
        # update on the compute stream itself (a rebuild step's) needs nothing.
        if torch.cuda.current_stream(self._device) == self.stream:
            state = self._scheduler.optimizer.state
            for p in fresh:
                for value in state.get(p, {}).values():
                    if isinstance(value, torch.Tensor) and value.is_cuda:
                        value.record_stream(self._compute)

    def _issue_rest(self) -> None:
        """Issue what ``step()`` left for later: deferred buckets, the decision, the updates."""
        scheduler = self._scheduler
        job = scheduler.job
        if not (job.to_land or job.to_update):
            return
        stream = self.stream
        with torch.cuda.stream(stream):
            for b in list(job.to_land):
                scheduler.land(b)
                if job.gate is None:
                    scheduler.update(b)
                    job.events[b] = stream.record_event()
            if job.gate is not None:
                if not job.gate.decided:
                    scheduler.decide()
                self._issue_updates()

    def _issue_updates(self) -> None:
        # Gated updates go in the order the next forward needs them: the last bucket of backward
        # holds the first layers.
        job = self._scheduler.job
        for b in sorted(job.to_update, reverse=True):
            self._scheduler.update(b)
            job.events[b] = self.stream.record_event()

    def _needs_host_flags(self, b: int) -> bool:
        return any(i in self._scheduler.job.missing for i in self._reduction.bucket_indices(b))
