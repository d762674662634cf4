"""``ok.GradBucketer``: bucketed asynchronous gradient all-reduce for models not wrapped in DDP.

The overlap loop::

    loss.backward()      # each parameter's post-accumulate-grad hook copies its gradient into
                         # its bucket; a full bucket's all-reduce is issued at once (async)
    bucketer.wait()      # issue what is left, wait, gradients now hold the average
    optimizer.step()

The facade: it checks the options, agrees on them across ranks, and offers ``wait()``,
``step()``/``synchronize()`` (with ``optimizer=``), ``no_sync()`` and the layout's
``state_dict()``. The buckets themselves (layout, launch order, hooks, unused parameters, rank
0's order) are ``overlapkit.ddp.reducer.BucketReducer``'s; the per-bucket optimizer updates are
``overlapkit.optim.per_bucket``'s, which drives the reducer, never this class.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from overlapkit.ddp.bucket_size import resolve_bucket_mb
from overlapkit.ddp.comm_stats import CommRecorder, register_recorder
from overlapkit.ddp.finite import FiniteCheck, validate_finite_options
from overlapkit.ddp.options import trainable_parameters, validate_bucket_mb
from overlapkit.ddp.reducer import BucketReducer
from overlapkit.ddp.tuning import attach_bucketer_tuner, wants_auto_bucket_mb
from overlapkit.group.consistency import check_consistent
from overlapkit.group.failures import CollectiveFailure, FailureScope
from overlapkit.group.process_group import resolve_process_group
from overlapkit.optim.overlap_checks import resolve_overlap_options, validate_optimizer
from overlapkit.optim.per_bucket import PerBucketStep

logger = logging.getLogger(__name__)


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
            optimizer.zero_grad()`` (with global-norm clipping and GradScaler if asked),
            applying each bucket's update once its all-reduce is done and letting the next
            forward start before the last buckets are reduced
            (``overlapkit.optim.per_bucket``). Defaults to None (``wait()`` as usual).
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
        params = trainable_parameters(model, caller="ok.GradBucketer")
        validate_finite_options(check_finite, on_nonfinite, caller="ok.GradBucketer")
        auto = wants_auto_bucket_mb(bucket_mb, caller="ok.GradBucketer")
        tail = resolve_overlap_options(optimizer, forward_order_tail, auto_bucket_mb=auto)
        resolved_mb = resolve_bucket_mb(
            None if auto else bucket_mb, params, caller="ok.GradBucketer"
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
                "forward_order_tail": tail,
            },
        )
        ids = {id(p) for p in params}
        names = [n for n, p in model.named_parameters() if id(p) in ids]
        if optimizer is not None:
            validate_optimizer(optimizer, params, names)
        recorder = CommRecorder(device=params[0].device)
        self._reducer = BucketReducer(
            params,
            names,
            self.process_group,
            bucket_mb=resolved_mb,
            tail=tail,
            recorder=recorder,
            failures=FailureScope("ok.GradBucketer", lambda: recorder.step),
            finite=(
                FiniteCheck(
                    "ok.GradBucketer", on_nonfinite, recorder, zip(names, params, strict=True)
                )
                if check_finite
                else None
            ),
        )
        register_recorder(self, recorder)
        if auto:
            attach_bucketer_tuner(self, self._reducer)
        self._overlap = (
            None if optimizer is None else PerBucketStep(self._reducer, model, optimizer)
        )

    @property
    def bucket_mb(self) -> float:
        """The bucket size in MiB now (with ``"auto"``: the size being tried, then the chosen)."""
        return self._reducer.bucket_mb

    @property
    def num_buckets(self) -> int:
        return self._reducer.num_buckets

    def bucket_parameter_names(self) -> list[list[str]]:
        """The parameter names in each bucket, in launch order."""
        return self._reducer.bucket_parameter_names()

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
        reducer = self._reducer
        return {
            "parameters": [name for bucket in reducer.bucket_parameter_names() for name in bucket],
            "bucket_mb": reducer.bucket_mb,
            "ready_order_adopted": not reducer.rebuild_pending,
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
        reducer = self._reducer
        if reducer.in_step:
            raise RuntimeError(
                "ok.GradBucketer.load_state_dict() was called between a backward and wait(); "
                "load the layout before training, or after wait()"
            )
        names = list(state["parameters"])
        ours = reducer.names
        if sorted(names) != sorted(ours):
            extra = sorted(set(names) - set(ours))
            absent = sorted(set(ours) - set(names))
            raise ValueError(
                "ok.GradBucketer.load_state_dict: the saved layout is of another model: it names "
                f"{extra} that this bucketer does not reduce and lacks {absent} "
                f"({len(names)} saved names, {len(ours)} here)"
            )
        bucket_mb = validate_bucket_mb(state["bucket_mb"], caller="ok.GradBucketer.load_state_dict")
        # Pending per-bucket updates still read the old buffers (on CUDA from the side stream).
        self.synchronize()
        index = {name: i for i, name in enumerate(ours)}
        reducer.load_layout(
            [index[name] for name in names],
            bucket_mb=bucket_mb,
            order_adopted=bool(state["ready_order_adopted"]),
        )

    def wait(self) -> None:
        """Finish this step's reduction; afterwards every ``.grad`` holds the group average.

        Raises:
            RuntimeError: no backward has produced gradients since the last ``wait()``.
            NonFiniteGradients: ``check_finite=True, on_nonfinite="raise"`` and a bucket held
                NaN/Inf after the all-reduce (on every rank alike).
            CollectiveFailure: an all-reduce failed: a rank died or is stuck (named). Every
                ``.grad`` of the step is then None, so an ``optimizer.step()`` after catching it
                changes nothing (the ranks cannot drift apart), as with ``ok.ddp``.
        """
        if self._overlap is not None:
            raise RuntimeError(
                "ok.GradBucketer.wait() is the synchronous form; this bucketer was given "
                "optimizer=, so call bucketer.step() (it replaces wait(), optimizer.step() and "
                "optimizer.zero_grad())"
            )
        reducer = self._reducer
        if not reducer.in_step:
            raise RuntimeError(
                "ok.GradBucketer.wait() was called but no backward has produced gradients since "
                "the last wait() (or all ran inside no_sync()); call loss.backward() first"
            )
        missing, step = reducer.end_backward()
        order = reducer.launch_order
        for position, b in enumerate(order):
            try:
                reducer.finish_bucket(b, missing)
            except CollectiveFailure:
                # The buckets not finished hold un-averaged local gradients: a caller who
                # catches this and steps must apply nothing, so the step's gradients go.
                for rest in order[position:]:
                    reducer.reset_bucket(rest)
                for param in reducer.params:
                    param.grad = None
                raise
        reducer.end_step(step)

    def step(
        self,
        *,
        clip_grad_norm: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        """With ``optimizer=``: start this step's per-bucket updates and return at once.

        Replaces ``wait(); optimizer.step(); optimizer.zero_grad()``, and with the arguments
        ``wait(); scaler.unscale_(optimizer); torch.nn.utils.clip_grad_norm_(
        model.parameters(), clip_grad_norm, norm_type, error_if_nonfinite);
        scaler.step(optimizer); optimizer.zero_grad()``, bitwise; call ``scaler.update()``
        afterwards as usual. Parameters are final when a module's forward reaches them, or
        after ``synchronize()`` (see ``overlapkit.optim.per_bucket``).

        Args:
            clip_grad_norm (float | None): clip the global gradient norm to this (``0.0``
                zeroes the gradients, as in torch); None (the default) does not clip.
            norm_type (float): p of the p-norm, ``"inf"`` or ``math.inf`` for the max norm.
            error_if_nonfinite (bool): raise if the total norm is NaN/Inf (a host sync in
                ``step()``, as in torch). Defaults to False.
            scaler (torch.amp.GradScaler | None): fp16 loss scaling: gradients are unscaled
                and checked per bucket; a step with inf/NaN is skipped on every rank
                (``step_skipped()`` says so).

        A clip asked for by ``clip_grad_norm_()`` since the last step is applied here.

        Raises:
            RuntimeError: no ``optimizer=`` was given, or no backward since the last step.
            OverlapConflict: gradients were edited after backward.
            ValueError: a bad clipping option, ``clip_grad_norm`` after ``clip_grad_norm_()``,
                or ``scaler`` with ``check_finite=True``.
        """
        if self._overlap is None:
            raise RuntimeError(
                "ok.GradBucketer.step() needs the optimizer: ok.GradBucketer(model, "
                "optimizer=opt); without it call bucketer.wait() and then optimizer.step()"
            )
        self._overlap.step(
            clip_grad_norm=clip_grad_norm,
            norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite,
            scaler=scaler,
        )

    def clip_grad_norm_(
        self,
        parameters: Iterable[torch.Tensor] | torch.Tensor,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """With ``optimizer=``: ``torch.nn.utils.clip_grad_norm_`` for frameworks that clip
        between backward and the step, folded into the coming ``step()``.

        ``clip_grad_norm_(params, max_norm); step()`` is bitwise ``wait();
        torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite);
        optimizer.step(); optimizer.zero_grad()``: the norm over exactly ``params``' reduced
        gradients, in their order (Lightning clips the optimizer's param groups, in their
        order), and only their gradients clipped (``overlapkit.optim.clip_request``). Pass no
        ``clip_grad_norm=`` to that ``step()``.

        Args:
            parameters (Tensor | Iterable[Tensor]): parameters this bucketer reduces.
            max_norm, norm_type, error_if_nonfinite: as in ``torch.nn.utils.clip_grad_norm_``.

        Returns:
            Tensor: a 0-dim tensor (NaN until then) that holds the total norm once the step has
            decided it: after ``total_norm()``, ``step_skipped()`` or ``synchronize()``, and at
            the latest when the next forward applies its first update.

        Raises:
            RuntimeError: no ``optimizer=``; no backward since the last step; a second call in
                the same step.
            ValueError, TypeError: bad options, or a parameter this bucketer does not reduce.
        """
        return self._overlapped("clip_grad_norm_").clip_grad_norm_(
            parameters, max_norm, norm_type, error_if_nonfinite
        )

    def step_skipped(self) -> bool:
        """With ``optimizer=``: whether the last ``step()`` applied no update (its GradScaler
        found inf/NaN, or ``check_finite`` dropped it), as ``scaler.step`` skips.

        Reading it lands every bucket of that step; the scaler's flag is one host read (on
        CUDA a device sync, which waits for the last bucket's all-reduce).
        """
        return self._overlapped("step_skipped").step_skipped()

    def before_forward(self, module: torch.nn.Module) -> None:
        """With ``optimizer=``: apply the pending updates of the parameters ``module`` reads, as
        its forward pre-hook does, for code that computes with ``module``'s own parameters
        without calling it (a LightningModule's ``training_step``). No-op otherwise."""
        if self._overlap is not None:
            self._overlap.pre_forward(module)

    def total_norm(self) -> torch.Tensor:
        """The total gradient norm of the last ``step(clip_grad_norm=...)``, as a 0-dim tensor.

        Equal to what ``clip_grad_norm_`` returns, bitwise. Reading it right after ``step()``
        waits for every bucket's all-reduce (on CPU it lands them; on CUDA the current stream
        waits for the norm), which gives up the overlap of that wait with user code.

        Raises:
            RuntimeError: no ``optimizer=``, or no step has clipped yet.
        """
        if self._overlap is None:
            raise RuntimeError(
                "ok.GradBucketer.total_norm() belongs to per-bucket updates (optimizer=); in the "
                "synchronous form clip_grad_norm_ returns the norm itself"
            )
        return self._overlap.total_norm()

    def _overlapped(self, method: str) -> PerBucketStep:
        if self._overlap is None:
            raise RuntimeError(
                f"ok.GradBucketer.{method}() belongs to per-bucket updates: build the bucketer "
                "with ok.GradBucketer(model, optimizer=opt)"
            )
        return self._overlap

    def synchronize(self) -> None:
        """With ``optimizer=``: apply every pending update now (no-op otherwise)."""
        if self._overlap is not None:
            self._overlap.synchronize()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backwards inside the block issue no communication.

        The first backward after the block reduces everything accumulated.
        """
        reducer = self._reducer
        previous, reducer.sync = reducer.sync, False
        try:
            yield
        finally:
            reducer.sync = previous

    def remove(self) -> None:
        """Detach the gradient hooks (with ``optimizer=``: after applying what is pending)."""
        if self._overlap is not None:
            self._overlap.remove()
        self._reducer.remove()
