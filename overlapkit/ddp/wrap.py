"""``ok.ddp``: DistributedDataParallel with an instrumented comm hook."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from overlapkit.ddp import hooks
from overlapkit.ddp.bucket_size import resolve_bucket_mb
from overlapkit.ddp.comm_stats import CommRecorder, register_recorder
from overlapkit.ddp.compile_guard import refuse_small_first_bucket_under_compile
from overlapkit.ddp.finite import (
    FiniteCheck,
    Hook,
    check_finite_wrapper,
    validate_finite_options,
)
from overlapkit.ddp.options import trainable_parameters
from overlapkit.ddp.tuning import attach_ddp_tuner, wants_auto_bucket_mb
from overlapkit.group.consistency import check_consistent
from overlapkit.group.process_group import backend_of, resolve_process_group

logger = logging.getLogger(__name__)

COMPRESSIONS = (None, "bf16", "fp16", "powersgd")
MiB = 1024 * 1024


def _check_powersgd_fits(params: list[torch.nn.Parameter], bucket_mb: float, backend: str) -> None:
    """On backends other than NCCL, PowerSGD only works with a single bucket.

    PyTorch's ``powerSGD_hook`` issues its second all-reduce from a future callback. With gloo,
    the callbacks of different buckets interleave with the next bucket's launch in a different
    order on each rank, so the collectives mismatch and the job hangs until the timeout.
    """
    if backend == "nccl":
        return
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    one_dtype = len({p.dtype for p in params}) == 1
    if one_dtype and grad_bytes <= bucket_mb * MiB:
        return
    # Rounded up, so the suggested value really holds every gradient.
    needed_mb = math.ceil(grad_bytes / MiB * 1e4) / 1e4
    raise ValueError(
        f"ok.ddp: compress='powersgd' on the {backend!r} backend needs every gradient in one "
        f"bucket, but bucket_mb={bucket_mb:g} splits this model's "
        f"{grad_bytes / MiB:.4g} MiB of gradients"
        + ("" if one_dtype else " (and its parameters have several dtypes)")
        + f". Use bucket_mb >= {needed_mb:g}, compress='bf16', or the NCCL backend "
        "(PyTorch's powerSGD_hook deadlocks gloo once buckets overlap)."
    )


def _check_adoptable(
    model: DistributedDataParallel,
    bucket_mb: float | str | None,
    process_group: torch.distributed.ProcessGroup | None,
    ddp_kwargs: Mapping[str, Any],
) -> None:
    """``ok.ddp`` on a model that already is a DistributedDataParallel only adds the hook."""
    if bucket_mb is not None:
        raise ValueError(
            f"ok.ddp: the model already is a DistributedDataParallel, whose buckets were fixed "
            f"when it was built ({model.bucket_bytes_cap / MiB:g} MiB); got bucket_mb="
            f"{bucket_mb!r}. Pass bucket_mb=None, or set the size where the DDP is built "
            "(Accelerate: DistributedDataParallelKwargs(bucket_cap_mb=...); HF Trainer: "
            "TrainingArguments(ddp_bucket_cap_mb=...))"
        )
    if ddp_kwargs:
        raise TypeError(
            f"ok.ddp: the model already is a DistributedDataParallel; DDP options "
            f"{sorted(ddp_kwargs)} only apply when ok.ddp builds it (pass the plain module)"
        )
    if process_group is not None and process_group is not model.process_group:
        raise ValueError(
            "ok.ddp: process_group differs from the group the DistributedDataParallel model "
            "was built with; pass process_group=None to keep the model's group"
        )


def ddp(
    model: torch.nn.Module,
    *,
    bucket_mb: float | str | None = None,
    compress: str | None = None,
    process_group: torch.distributed.ProcessGroup | None = None,
    powersgd_options: Mapping[str, Any] | None = None,
    check_finite: bool = False,
    on_nonfinite: str = "raise",
    gradient_as_bucket_view: bool | None = None,
    **ddp_kwargs: Any,
) -> DistributedDataParallel:
    """Wrap ``model`` in DistributedDataParallel with an overlapkit comm hook.

    Args:
        model (nn.Module): the local replica (already on its device), or a
            DistributedDataParallel that a framework built (Accelerate's ``prepare``, HF
            ``Trainer``) and that has no comm hook yet: then only the hook is added, its buckets
            and group stay as they are, and ``bucket_mb``, ``process_group`` and DDP options
            must be left out. Call it before the first backward.
        bucket_mb (float | None): DDP bucket size in MiB (``bucket_cap_mb``); it also sets the
            first bucket, because DDP's 1 MiB first bucket applies only when ``bucket_cap_mb`` is
            None. None (the default) means about 1/8 of the model's gradient, between 1 and
            25 MiB (see ``overlapkit.ddp.bucket_size``). ``"auto"`` tries a few sizes during the
            first steps and keeps the fastest (``overlapkit.tuning``, ``ok.tuning_report``).
        compress (str | None): None (fp32 all-reduce, instrumented), ``"bf16"``, ``"fp16"``
            (cast, all-reduce, cast back; gloo and NCCL) or ``"powersgd"`` (PyTorch's hook).
        process_group (ProcessGroup | None): group to average over; None means the world.
        powersgd_options (Mapping | None): keyword arguments of ``PowerSGDState`` (for example
            ``matrix_approximation_rank``, ``start_powerSGD_iter``); only with ``"powersgd"``.
        check_finite (bool): after each bucket's all-reduce, look for NaN/Inf (one
            sum per bucket); every rank sees the same result (``overlapkit.ddp.finite``).
            Not with ``"powersgd"``. Defaults to False: the hook is the same as without it.
        on_nonfinite (str): with ``check_finite``: ``"raise"`` (``loss.backward()`` raises on
            every rank, naming the parameters) or ``"skip"`` (every ``.grad`` set to None at
            the end of backward, so ``optimizer.step()`` changes nothing; the step is listed
            in ``ok.comm_stats(model).skipped_steps``). Defaults to ``"raise"``.
        gradient_as_bucket_view (bool | None): DDP's option of that name: each ``.grad`` is a
            view into its bucket after the first step, so no gradient is copied into a bucket
            and back and the gradients' second copy (their bytes) is never allocated. None (the
            default) means True when ``ok.ddp`` builds the DDP (docs/ddp.md: measured, and what
            changes for ``.grad``: it aliases the bucket, ``p.grad.detach_()`` raises, a
            reference kept across steps sees the next step's values); an adopted
            DistributedDataParallel keeps its own setting, so pass None there.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``device_ids``,
            ``find_unused_parameters``, ``static_graph``...).

    Returns:
        DistributedDataParallel: the wrapped model; ``ok.comm_stats(model)`` reads its timings.

    Raises:
        ValueError: ``bucket_mb <= 0``, unknown ``compress``, no trainable parameters,
            PowerSGD on gloo with more than one bucket, or ``bucket_mb`` given with a model
            that already is a DistributedDataParallel. Under ``torch.compile`` (DDPOptimizer),
            the first forward raises ValueError when ``bucket_mb`` < 1 MiB
            (``overlapkit.ddp.compile_guard``).
        RuntimeError: torch.distributed is not initialised.
        ConfigMismatch: the ranks of the group passed different options or models
            (``overlapkit.group.consistency``; one 32-byte all-gather when they agree).
    """
    # As given (before "auto" or None is resolved), for the cross-rank consistency check.
    options = dict(
        ddp_kwargs,
        bucket_mb=bucket_mb,
        compress=compress,
        powersgd=powersgd_options,
        check_finite=check_finite,
        on_nonfinite=on_nonfinite,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )
    _validate_options(
        compress, powersgd_options, check_finite, on_nonfinite, gradient_as_bucket_view, ddp_kwargs
    )
    if isinstance(model, DistributedDataParallel):
        target = _adopt(model, bucket_mb, process_group, gradient_as_bucket_view, ddp_kwargs)
    else:
        target = _resolve_new(model, bucket_mb, process_group, compress)
    backend = backend_of(target.group)
    if compress == "powersgd":
        _check_powersgd_fits(target.params, target.bucket_mb, backend)
    check_consistent(target.module, target.group, caller="ok.ddp", options=options)

    wrapped = (
        model
        if target.adopted
        else DistributedDataParallel(
            model,
            bucket_cap_mb=target.bucket_mb,
            process_group=target.group,
            gradient_as_bucket_view=gradient_as_bucket_view is not False,
            **ddp_kwargs,
        )
    )
    refuse_small_first_bucket_under_compile(wrapped, caller="ok.ddp")
    recorder = CommRecorder(device=target.params[0].device)
    state = _register_comm_hook(
        wrapped,
        target,
        recorder,
        compress=compress,
        powersgd_options=powersgd_options,
        check_finite=check_finite,
        on_nonfinite=on_nonfinite,
    )
    state.relay.attach(wrapped)
    register_recorder(wrapped, recorder)
    register_recorder(target.module, recorder)
    if target.auto:
        attach_ddp_tuner(wrapped, target.params, target.group, recorder)
    logger.info(
        "ok.ddp: %d parameters, bucket_mb=%g, compress=%s, gradient_as_bucket_view=%s, "
        "backend=%s, group size %d",
        len(target.params),
        target.bucket_mb,
        compress,
        wrapped.gradient_as_bucket_view,
        backend,
        target.group.size(),
    )
    return wrapped


def _validate_options(
    compress: str | None,
    powersgd_options: Mapping[str, Any] | None,
    check_finite: bool,
    on_nonfinite: str,
    gradient_as_bucket_view: bool | None,
    ddp_kwargs: Mapping[str, Any],
) -> None:
    """Raise the TypeError or ValueError ``ok.ddp`` documents for an option out of range."""
    if gradient_as_bucket_view not in (None, True, False):
        raise TypeError(
            f"ok.ddp: gradient_as_bucket_view must be True, False or None (True unless the "
            f"model already is a DistributedDataParallel), got {gradient_as_bucket_view!r}"
        )
    if compress not in COMPRESSIONS:
        raise ValueError(
            f"ok.ddp: unknown compress={compress!r}; choose one of {list(COMPRESSIONS)}"
        )
    if powersgd_options is not None and compress != "powersgd":
        raise ValueError(
            f"ok.ddp: powersgd_options is only used with compress='powersgd', got "
            f"compress={compress!r}"
        )
    if "bucket_cap_mb" in ddp_kwargs:
        raise TypeError("ok.ddp: pass the bucket size as bucket_mb=..., not bucket_cap_mb")
    validate_finite_options(check_finite, on_nonfinite, caller="ok.ddp")
    if check_finite and compress == "powersgd":
        raise ValueError(
            "ok.ddp: check_finite=True is not supported with compress='powersgd' (each rank "
            "rebuilds the bucket from low-rank factors itself); use compress=None, 'bf16' or "
            "'fp16'"
        )


@dataclass(frozen=True, slots=True)
class _Target:
    """What ``ok.ddp`` wraps: the local ``module``, its trainable ``params``, the resolved
    ``bucket_mb`` (MiB) and ``group``; ``auto`` when the bucket size is tuned during the first
    steps; ``adopted`` when the model already was a DistributedDataParallel."""

    module: torch.nn.Module
    params: list[torch.nn.Parameter]
    bucket_mb: float
    group: torch.distributed.ProcessGroup
    auto: bool
    adopted: bool


def _adopt(
    model: DistributedDataParallel,
    bucket_mb: float | str | None,
    process_group: torch.distributed.ProcessGroup | None,
    gradient_as_bucket_view: bool | None,
    ddp_kwargs: Mapping[str, Any],
) -> _Target:
    """A DistributedDataParallel built by a framework (Accelerate, HF Trainer): its buckets and
    group are fixed, so only the hook is added."""
    given = {} if gradient_as_bucket_view is None else {"gradient_as_bucket_view": True}
    _check_adoptable(model, bucket_mb, process_group, ddp_kwargs | given)
    params = trainable_parameters(model.module, caller="ok.ddp")
    return _Target(
        model.module,
        params,
        model.bucket_bytes_cap / MiB,
        model.process_group,
        auto=False,
        adopted=True,
    )


def _resolve_new(
    model: torch.nn.Module,
    bucket_mb: float | str | None,
    process_group: torch.distributed.ProcessGroup | None,
    compress: str | None,
) -> _Target:
    """A plain module that ``ok.ddp`` wraps itself: its bucket size and group resolved."""
    auto = wants_auto_bucket_mb(bucket_mb, caller="ok.ddp", compress=compress)
    params = trainable_parameters(model, caller="ok.ddp")
    resolved_mb = resolve_bucket_mb(None if auto else bucket_mb, params, caller="ok.ddp")
    group = resolve_process_group(process_group, caller="ok.ddp")
    return _Target(model, params, resolved_mb, group, auto=auto, adopted=False)


def _register_comm_hook(
    wrapped: DistributedDataParallel,
    target: _Target,
    recorder: CommRecorder,
    *,
    compress: str | None,
    powersgd_options: Mapping[str, Any] | None,
    check_finite: bool,
    on_nonfinite: str,
) -> hooks.CommHookState | hooks.PowerSGDHookState:
    """Register the hook ``compress`` names on ``wrapped``; return its state."""
    if compress == "powersgd":
        powersgd_state = powersgd.PowerSGDState(
            process_group=target.group, **(powersgd_options or {})
        )
        state = hooks.PowerSGDHookState(powersgd_state, recorder, target.params)
        wrapped.register_comm_hook(state, hooks.powersgd_hook)
        return state
    comm_state = hooks.CommHookState(target.group, recorder, target.params)
    hook = _allreduce_hook(compress, check_finite, on_nonfinite, recorder, target.module)
    wrapped.register_comm_hook(comm_state, hook)
    return comm_state


def _allreduce_hook(
    compress: str | None,
    check_finite: bool,
    on_nonfinite: str,
    recorder: CommRecorder,
    module: torch.nn.Module,
) -> Hook:
    """The all-reduce hook for ``compress`` (None, bf16, fp16), wrapped by the finite check."""
    hook = {
        None: hooks.allreduce_hook,
        "bf16": hooks.bf16_allreduce_hook,
        "fp16": hooks.fp16_allreduce_hook,
    }[compress]
    if not check_finite:
        return hook
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    check = FiniteCheck("ok.ddp", on_nonfinite, recorder, named)
    return check_finite_wrapper(hook, check)
