"""``GradBucketer(model, optimizer=opt)``'s optimizer side: ``PerBucketStep`` applies the user's
optimizer bucket by bucket, each as its all-reduce lands, overlapping the tail with the next
forward. How, why and what was measured: docs/optimizer-overlap.md.

The contract (``GradBucketer`` builds one over its reducer, seen only as ``BucketReduction``):

- ``step()`` equals ``wait(); optimizer.step(); optimizer.zero_grad()`` bitwise (with its
  clip and scaler: ``PerBucketStep.step``); the hyper-parameters are those at ``step()``.
- Every update of a step is applied before anything reads its parameters or state: a module's
  forward (one global forward pre-hook: ``overlapkit.optim.forward_reads``), ``state_dict()`` /
  ``load_state_dict()`` of the model or the optimizer, ``synchronize()``, the interpreter's
  exit. Code that reads ``param`` tensors directly before the next forward calls
  ``synchronize()``.
- The optimizer's and the global step hooks run once per ``step()``: pre-hooks in it,
  post-hooks once every update is applied.
- Where the work runs (training thread, CUDA side stream): ``overlapkit.optim.issue_paths``;
  what cannot be overlapped is refused: ``overlapkit.optim.overlap_checks``.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Iterable

import torch
from torch.utils.hooks import RemovableHandle

from overlapkit.optim.clip_request import ClipRequest, request_clip, whole_model_clip
from overlapkit.optim.forward_reads import global_forward_pre_hook, reads_of
from overlapkit.optim.gate import UpdateGate
from overlapkit.optim.grad_scaling import ScaledStep, scaler_in_use
from overlapkit.optim.issue_paths import CpuIssuePath, CudaIssuePath, IssuePath
from overlapkit.optim.overlap_checks import (
    CALLER,
    SYNCHRONOUS_FORM,
    OverlapConflict,
    refuse_compiled_step,
    stale_read_conflict,
)
from overlapkit.optim.pending_step import PendingStep
from overlapkit.optim.protocols import BucketReduction
from overlapkit.optim.subset import (
    group_of,
    hyper_parameters,
    mark_stepped,
    run_step_hooks,
    step_hooks,
    step_subset,
)

logger = logging.getLogger(__name__)

__all__ = ["OverlapConflict", "PerBucketStep"]

_live: weakref.WeakSet[PerBucketStep] = weakref.WeakSet()


@atexit.register
def _synchronize_at_exit() -> None:
    """Apply every pending update before the interpreter shuts down (a loop that ends with
    ``bucketer.step()`` exits 0 with its last step applied; see ``overlapkit.ddp.reducer``'s
    exit hook for why an all-reduce must not be left in flight)."""
    for scheduler in list(_live):
        try:
            scheduler.synchronize()
        except Exception as error:  # a dead peer at exit: report, do not abort the exit
            logger.warning("%s: the last step's updates failed at exit: %s", CALLER, error)


def _update_gate(clip: ClipRequest | None, scaled: ScaledStep | None) -> UpdateGate:
    """What holds every update until every bucket has landed: the clip's norm, the scaler's
    unscale and inf check, or the bucketer's NaN/Inf check."""
    return UpdateGate(
        max_norm=None if clip is None else clip.max_norm,
        norm_type=2.0 if clip is None else clip.norm_type,
        error_if_nonfinite=clip is not None and clip.error_if_nonfinite,
        scaled=scaled,
        caller="ok.GradBucketer.step",
    )


class PerBucketStep:
    """The optimizer side of ``GradBucketer(optimizer=...)``; see the module docstring.

    Its per-bucket work (``job``, ``land``, ``decide``, ``update``, ``finish``, ``abandon``) is
    public for its issue path (``overlapkit.optim.issue_paths``), which decides when and on which
    stream each piece runs; the rest of the public methods are the bucketer's.

    Args:
        reduction (BucketReduction): the bucketer's reducer (its buckets, launch order, hooks).
        model (nn.Module): the model given to the bucketer (whose modules' forwards wait).
        optimizer (torch.optim.Optimizer): validated by ``validate_optimizer``.
    """

    def __init__(
        self, reduction: BucketReduction, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ):
        self._reduction = reduction
        self.optimizer = optimizer
        self._job: PendingStep | None = None
        self._handed: dict[int, tuple[torch.Tensor, int]] = {}
        self._clip: ClipRequest | None = None
        """Asked for by ``clip_grad_norm_()`` since the last ``step()``."""
        self._found_inf: torch.Tensor | None = None
        """The last step's GradScaler inf flag (None: no scaler)."""
        self._dropped = False
        """Whether the last step was dropped whole (``check_finite``, ``on_nonfinite="skip"``)."""
        params = reduction.params
        self._device = params[0].device
        # Chosen once: validate_optimizer refused parameters on more than one device.
        self._path: IssuePath = (
            CudaIssuePath(self, reduction, self._device)
            if self._device.type == "cuda"
            else CpuIssuePath(self, reduction)
        )
        self._reads = weakref.WeakKeyDictionary(reads_of(model, list(params)))
        direct = optimizer.register_step_pre_hook(self._refuse_direct_step)
        self._own_hook_ids = (direct.id,)
        self._handles: list[RemovableHandle] = [
            reduction.register_grad_ready_hook(self.grad_handed_over),
            global_forward_pre_hook(self),
            direct,
        ]
        sync = self._synchronize_hook
        self._handles += [
            model.register_state_dict_pre_hook(sync),
            model.register_load_state_dict_pre_hook(sync),
            optimizer.register_state_dict_pre_hook(sync),
            optimizer.register_load_state_dict_pre_hook(sync),
        ]
        _live.add(self)

    # -- the training loop's side ------------------------------------------------------------

    def grad_handed_over(self, index: int, param: torch.Tensor) -> None:
        """From the reduction's grad-ready hook, before the gradient is copied into its bucket."""
        # The first gradient of a backward finishes the previous step: what the forward did not
        # need (a module it skipped) is applied now, before any bucket buffer is reused.
        self.synchronize()
        if param.grad is None:
            # Its own bucket of the last step landed just now and took the fresh gradient: the
            # forward read the parameter before its pending update (not through its module). A
            # stale read whose gradient comes after another's is not seen here.
            raise stale_read_conflict(self._reduction.names[index])
        if param.grad.data_ptr() == self._reduction.grad_view(index).data_ptr():
            # Already its bucket view (a parameter the optimizer does not update keeps it): the
            # bucket's own division bumps its version, so versions say nothing here.
            return
        self._handed[index] = (param.grad, param.grad._version)

    def clip_grad_norm_(
        self,
        parameters: Iterable[torch.Tensor] | torch.Tensor,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Ask the coming ``step()`` to clip over ``parameters``, in their order (module doc of
        ``overlapkit.optim.clip_request``); returns the tensor that will hold the norm."""
        if not self._reduction.in_step:
            raise RuntimeError(
                "ok.GradBucketer.clip_grad_norm_() was called but no backward has produced "
                "gradients since the last step() (or all ran inside no_sync()); clip after the "
                "backward of a step, before bucketer.step()"
            )
        if self._clip is not None:
            raise RuntimeError(
                "ok.GradBucketer.clip_grad_norm_() was already called for this step; clip once "
                "per step (the next step() applies it)"
            )
        self._clip = request_clip(
            parameters,
            max_norm,
            norm_type,
            error_if_nonfinite,
            params=self._reduction.params,
            caller="ok.GradBucketer.clip_grad_norm_",
        )
        return self._clip.out

    def step(
        self,
        *,
        clip_grad_norm: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        """Hand this step's buckets over for per-bucket updates, and return.

        Bitwise ``wait(); scaler.unscale_(optimizer); clip_grad_norm_(model.parameters(),
        clip_grad_norm, norm_type, error_if_nonfinite); scaler.step(optimizer);
        optimizer.zero_grad()``, leaving out what is not passed; each bucket's update runs once
        its all-reduce has landed (with a clip, a scaler or ``check_finite``: once every bucket
        has), at the latest when something reads its parameters.

        Args:
            clip_grad_norm (float | None): clip the global norm of every reduced gradient to
                this; None: no clip (or the one ``clip_grad_norm_()`` asked for).
            norm_type (float): the norm's type, as ``clip_grad_norm_``'s. Defaults to 2.0.
            error_if_nonfinite (bool): raise, in ``step()``, where the norm is NaN or inf.
            scaler (GradScaler | None): unscale, skip an inf step, as ``scaler.step``; the
                caller calls ``scaler.update()`` after.

        Raises:
            RuntimeError: no backward produced gradients since the last ``step()``.
            ValueError: a clip asked twice, or ``scaler`` with ``check_finite``.
            OverlapConflict: what per-bucket updates cannot overlap (``overlap_checks``).
        """
        reduction = self._reduction
        if not reduction.in_step:
            raise RuntimeError(
                "ok.GradBucketer.step() was called but no backward has produced gradients since "
                "the last step() (or all ran inside no_sync()); call loss.backward() first"
            )
        clip = self._take_clip(clip_grad_norm, norm_type, error_if_nonfinite)
        scaler = scaler_in_use(scaler, caller="ok.GradBucketer.step")
        if scaler is not None and reduction.checks_finite:
            raise ValueError(
                "ok.GradBucketer.step: scaler= and check_finite=True both look for NaN/Inf "
                "gradients; GradScaler already skips such steps (and backs the scale off), so "
                "build the bucketer without check_finite"
            )
        optimizer = self.optimizer
        refuse_compiled_step(optimizer)
        self._refuse_edited_gradients()
        hyper = hyper_parameters(optimizer)
        groups = group_of(optimizer)
        self._path.refuse(hyper)
        scaled = None if scaler is None else self._scaled_step(scaler, clip, groups)
        pre_hooks, post_hooks = step_hooks(optimizer, skip=self._own_hook_ids)
        run_step_hooks(optimizer, pre_hooks)
        mark_stepped(optimizer)
        gate = None
        if clip is not None or scaled is not None or reduction.checks_finite:
            gate = _update_gate(clip, scaled)
        self._found_inf = None if scaled is None else scaled.found_inf
        self._dropped = False
        missing, step = reduction.end_backward()
        order = list(reduction.launch_order)
        self._job = PendingStep(
            step, hyper, groups, missing, order, list(order), gate, post_hooks, clip
        )
        if scaled is not None:
            scaled.hand_to_scaler()
        self._start(step)

    def _take_clip(
        self, clip_grad_norm: float | None, norm_type: float, error_if_nonfinite: bool
    ) -> ClipRequest | None:
        """The step's clip: the one ``clip_grad_norm_()`` asked for, or ``clip_grad_norm``'s
        over the whole model (not both)."""
        clip, self._clip = self._clip, None
        if clip_grad_norm is None:
            return clip
        if clip is not None:
            raise ValueError(
                f"ok.GradBucketer.step: clip_grad_norm={clip_grad_norm!r} was given, but "
                "bucketer.clip_grad_norm_() already asked for a clip in this step; clip once"
            )
        return whole_model_clip(
            clip_grad_norm, norm_type, error_if_nonfinite, caller="ok.GradBucketer.step"
        )

    def _scaled_step(
        self, scaler: torch.amp.GradScaler, clip: ClipRequest | None, groups: dict[int, int]
    ) -> ScaledStep:
        """GradScaler's part of the step: unscale where a clip needs it or the optimizer
        cannot take ``found_inf`` itself; the optimizer's gradients checked first."""
        optimizer, reduction = self.optimizer, self._reduction
        takes_flags = getattr(optimizer, "_step_supports_amp_scaling", False)
        scaled = ScaledStep(
            scaler,
            optimizer,
            self._device,
            unscale=clip is not None or not takes_flags,
            caller="ok.GradBucketer.step",
        )
        mine = [i for i, p in enumerate(reduction.params) if id(p) in groups]
        scaled.check_gradients(
            [reduction.names[i] for i in mine], [reduction.params[i] for i in mine]
        )
        return scaled

    def _start(self, step: int) -> None:
        """Run the pending step's first work: the bucket rebuild step all of it, now (every
        update lands first); otherwise what the issue path runs at ``step()``. An error
        forgets the step before it propagates."""
        reduction = self._reduction
        try:
            if reduction.rebuild_pending:
                # The first step rebuilds the buckets in rank 0's order: every update lands first.
                self._run_now()
                reduction.end_step(step)
            else:
                self._path.at_step()
        except BaseException:
            self.abandon()
            raise

    def synchronize(self) -> None:
        """Apply every pending update (on CUDA: order the current stream after them)."""
        if self._job is not None:
            self._path.synchronize()

    def wait_for(self, buckets: set[int]) -> None:
        """Make the updates of ``buckets`` visible to the caller (apply them, or wait on CUDA)."""
        if self._job is not None:
            self._path.wait_for(buckets)

    def total_norm(self) -> torch.Tensor:
        """The last clipped step's total gradient norm, a 0-dim tensor, ready to read.

        On CPU this finishes what the norm needs (every bucket's all-reduce); on CUDA the
        current stream waits for the norm's event, so ``.item()`` reads the final value.

        Raises:
            RuntimeError: no ``step(clip_grad_norm=...)`` yet.
        """
        job = self._job
        if job is not None and job.gate is not None and job.gate.clips and not job.gate.decided:
            self._path.decide_now()
        norm = self._path.kept_norm()
        if norm is None:
            raise RuntimeError(
                "ok.GradBucketer.total_norm(): no step clipped yet; call "
                "bucketer.step(clip_grad_norm=max_norm) first"
            )
        return norm

    def step_skipped(self) -> bool:
        """Whether the last ``step()`` applied no update: its GradScaler found inf/NaN, or
        ``check_finite`` dropped it (``on_nonfinite="skip"``).

        Decides the step if it is not decided yet (lands every bucket); the scaler's verdict is
        one host read of its ``found_inf`` (on CUDA a device sync: it waits for the last
        bucket's all-reduce and unscale).
        """
        job = self._job
        if job is not None and job.gate is not None and not job.gate.decided:
            self._path.decide_now()
        if self._dropped:
            return True
        return self._found_inf is not None and bool(self._found_inf.item())

    def remove(self) -> None:
        """Apply what is pending and detach every hook."""
        self.synchronize()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        _live.discard(self)

    # -- hooks ---------------------------------------------------------------------------------

    def pre_forward(self, module: torch.nn.Module) -> None:
        """Before ``module``'s forward (or code that computes as it would without calling it):
        wait for the updates of the parameters it reads."""
        if self._job is None:
            return
        reads = self._reads.get(module)
        if reads is not None:
            # Bucket positions are re-read per call: the layout can be rebuilt.
            self.wait_for({self._reduction.bucket_of(i) for i in reads})

    def _synchronize_hook(self, *_: object, **__: object) -> None:
        self.synchronize()

    def _refuse_direct_step(self, *_: object) -> None:
        # Outside a step (no gradients handed over, nothing pending) a direct step is someone
        # initialising state, e.g. DCP's ``get_state_dict`` on a fresh optimizer: let it run.
        if not self._reduction.in_step and self._job is None:
            return
        raise OverlapConflict(
            f"optimizer.step() was called on the optimizer given to {CALLER}; bucketer.step() "
            "applies it per bucket (and zeroes the gradients). With GradScaler, pass it: "
            "bucketer.step(clip_grad_norm=..., scaler=scaler), then scaler.update()"
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
                    "change would be lost. Clip and unscale through the step instead: "
                    "bucketer.step(clip_grad_norm=max_norm, scaler=scaler); for other edits "
                    f"{SYNCHRONOUS_FORM}"
                )

    # -- the per-bucket work, run by the issue path --------------------------------------------

    @property
    def job(self) -> PendingStep | None:
        """The step whose updates are pending; None between steps."""
        return self._job

    def land(self, b: int) -> None:
        """Finish bucket ``b``'s reduction, take its gradients; with a gate, unscale, measure."""
        job = self._job
        reduction = self._reduction
        job.to_land.remove(b)
        reduction.finish_bucket(b, job.missing)
        keys, grads, mine = [], [], []
        for i in reduction.bucket_indices(b):
            param = reduction.params[i]
            if param.grad is None:
                continue
            keys.append(i)
            grads.append(param.grad)
            mine.append(id(param) in job.group_of)
            job.grads[i] = param.grad
            if mine[-1]:
                param.grad = None
        if job.gate is not None:
            clip = job.clip
            job.gate.landed(keys, grads, mine, [clip is None or clip.covers(i) for i in keys])

    def decide(self) -> None:
        """Every bucket has landed: act on NaN/Inf, then the total norm and the skip."""
        job = self._job
        if self._reduction.settle_nonfinite(job.step):  # raises, or drops the step (skip)
            job.grads.clear()
            self._dropped = True
        scaled = job.gate.scaled
        # The clip's order: model.parameters()'s, unless clip_grad_norm_() gave its own.
        keys = sorted(job.grads) if job.clip is None else job.clip.norm_keys(job.grads)
        job.gate.decide(
            keys,
            [job.grads[i] for i in keys],
            host_skip=scaled is not None and not scaled.takes_flags,
        )
        if job.gate.clips:
            if job.clip.out is not None:
                job.clip.out.copy_(job.gate.total)  # before keep_norm's event, on CUDA
            self._path.keep_norm(job.gate.total)

    def update(self, b: int) -> None:
        """Clip bucket ``b``'s gradients (with a gate), update its parameters; ``b`` has landed."""
        job = self._job
        reduction = self._reduction
        job.to_update.remove(b)
        indices = [i for i in reduction.bucket_indices(b) if i in job.grads]
        gate = job.gate
        if gate is not None:
            clip = job.clip
            gate.prepare([job.grads[i] for i in indices if clip is None or clip.covers(i)])
        mine = [reduction.params[i] for i in indices if id(reduction.params[i]) in job.group_of]
        if gate is None or not gate.skip:
            flags = None
            if gate is not None and gate.scaled is not None and gate.scaled.takes_flags:
                flags = gate.scaled.optimizer_flags()
            fresh = [p for p in mine if not self.optimizer.state.get(p)]
            for i in indices:
                reduction.params[i].grad = job.grads[i]
            step_subset(self.optimizer, mine, hyper=job.hyper, groups=job.group_of, flags=flags)
            self._path.updated(fresh)
        for p in mine:
            p.grad = None  # optimizer.zero_grad()'s default, for this bucket's parameters
        for i in indices:
            del job.grads[i]

    def finish(self) -> None:
        """Every update is applied (on CUDA: waited for): forget the step, run the post-hooks."""
        job, self._job = self._job, None
        if job is not None:
            run_step_hooks(self.optimizer, job.post_hooks)

    def abandon(self) -> None:
        """After an error: forget the step, leave every bucket ready for the next backward.

        Buckets not finished are reset without waiting (after a failed collective, waiting
        for the others could take a timeout each); the optimizer's gradients are dropped, as
        ``step()`` would have, so that nothing of the failed step accumulates into the next.
        """
        job, self._job = self._job, None
        if job is None:
            return
        for b in job.to_land:
            self._reduction.reset_bucket(b)
        for p in self._reduction.params:
            if id(p) in job.group_of:
                p.grad = None
        job.grads.clear()

    def _run_now(self) -> None:
        """Land, decide and update every bucket now, on the current stream."""
        job = self._job
        for b in list(job.to_land):
            self.land(b)
            if job.gate is None:
                self.update(b)
        if job.gate is not None:
            self.decide()
            for b in list(job.to_update):
                self.update(b)
        self.finish()
