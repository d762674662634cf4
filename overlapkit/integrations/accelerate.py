"""Accelerate: the DDP model ``Accelerator.prepare`` builds gets ``ok.ddp``'s hook.

Accelerate wraps the model in ``DistributedDataParallel`` inside ``prepare`` and then calls
``accelerator.ddp_handler.register_comm_hook(model)``, which knows only its own enum of hooks
(``DistributedDataParallelKwargs(comm_hook=...)``; a callable is ignored). ``use_ok_ddp`` swaps
that handler for an ``OverlapDDPKwargs`` that keeps every DDP option of the old one and, in
``register_comm_hook``, calls ``ok.ddp(model, ...)`` on the freshly built DDP model (adding the
hook only; see ``ok.ddp``). It works on every backend, including bf16 compression on gloo, and
does nothing where Accelerate builds no DDP (one process, FSDP, DeepSpeed).

``use_ok_ddp(accelerator, optimizer_overlap=True)`` builds no DDP at all: ``ok.GradBucketer(model,
optimizer=opt)`` applies each bucket's update once its all-reduce is done, with
``accelerator.clip_grad_norm_``, ``accumulate()`` / ``no_sync`` and the fp16 GradScaler folded in
(``overlapkit.integrations.accelerate_per_bucket``).

``ok.fsdp`` needs no adapter: shard before ``prepare``, with Accelerate's FSDP2 plugin
(``FullyShardedDataParallelPlugin(fsdp_version=2)``, CUDA only), whose ``fsdp2_prepare_model``
returns a model that already is an ``FSDPModule`` as it is, keeping ``ok.fsdp``'s prefetch
(Accelerate's own FSDP2 set-up forbids forward prefetch). Without the plugin (CPU), Accelerate
would wrap the sharded model in DDP and refuses: "Your model contains DTensor parameters".

Example:
    >>> accelerator = Accelerator(cpu=True)
    >>> use_ok_ddp(accelerator, compress="bf16")        # before prepare
    >>> model, optimizer = accelerator.prepare(model, optimizer)
    >>> ok.comm_stats(model)                            # per-bucket timings
    >>> overlap = use_ok_ddp(accelerator, optimizer_overlap=True)   # or: no DDP, per-bucket steps
    >>> model, optimizer = accelerator.prepare(model, optimizer)
    >>> overlap.bucketer.synchronize()                  # before reading parameters directly
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

from overlapkit.ddp.wrap import ddp
from overlapkit.integrations.accelerate_per_bucket import PerBucketPreparation

__all__ = ["OverlapDDPKwargs", "PerBucketPreparation", "use_ok_ddp"]

_OVERLAP_FIELDS = ("compress", "powersgd_options", "check_finite", "on_nonfinite")
# Accelerate's own hook fields are not DDP arguments either.
_NOT_DDP_ARGUMENTS = ("comm_hook", "comm_wrapper", "comm_state_option", *_OVERLAP_FIELDS)


@dataclass
class OverlapDDPKwargs(DistributedDataParallelKwargs):
    """Accelerate's DDP options plus ``ok.ddp``'s hook options (see ``ok.ddp``).

    DDP options (``bucket_cap_mb``, ``find_unused_parameters``...) go to the DDP that Accelerate
    builds; ``compress``, ``powersgd_options``, ``check_finite`` and ``on_nonfinite`` go to
    ``ok.ddp``, which registers its hook on that model.
    """

    compress: str | None = None
    powersgd_options: dict[str, Any] | None = None
    check_finite: bool = False
    on_nonfinite: str = "raise"

    def __post_init__(self) -> None:
        if self.comm_hook != DDPCommunicationHookType.NO:
            raise ValueError(
                f"OverlapDDPKwargs: comm_hook={self.comm_hook!r} cannot be combined with "
                "overlapkit's hook; choose compress=None|'bf16'|'fp16'|'powersgd' instead"
            )

    def to_dict(self, ignore_keys: tuple[str, ...] = _NOT_DDP_ARGUMENTS) -> dict[str, Any]:
        """The DDP constructor's keyword arguments only (``to_kwargs`` passes them to DDP)."""
        return super().to_dict(ignore_keys=ignore_keys)

    def register_comm_hook(self, model: torch.nn.Module) -> None:
        """Called by ``Accelerator.prepare`` right after it built the DDP model."""
        ddp(model, **{name: getattr(self, name) for name in _OVERLAP_FIELDS})


def use_ok_ddp(
    accelerator: Accelerator,
    *,
    bucket_mb: float | None = None,
    compress: str | None = None,
    powersgd_options: dict[str, Any] | None = None,
    check_finite: bool = False,
    on_nonfinite: str = "raise",
    optimizer_overlap: bool = False,
    forward_order_tail: int | None = None,
    norm_ready_at_step: bool = True,
) -> OverlapDDPKwargs | PerBucketPreparation | None:
    """Make ``accelerator.prepare`` register ``ok.ddp``'s hook on the DDP model it builds, or,
    with ``optimizer_overlap``, build no DDP and step per bucket.

    Call it after creating the ``Accelerator`` and before ``prepare``. DDP options already
    given through ``DistributedDataParallelKwargs`` are kept.

    Args:
        accelerator (Accelerator): the accelerator whose ``prepare`` builds the DDP model.
        bucket_mb (float | None): DDP bucket size in MiB; None keeps the handler's
            ``bucket_cap_mb`` (Accelerate's default 25). With ``optimizer_overlap``: the
            bucketer's (None: ``ok.GradBucketer``'s default).
        compress, powersgd_options: as in ``ok.ddp``; not with ``optimizer_overlap``.
        check_finite, on_nonfinite: as in ``ok.ddp`` (and ``ok.GradBucketer``).
        optimizer_overlap (bool): no DDP: ``ok.GradBucketer(model, optimizer=opt)`` once
            ``prepare`` has both (``overlapkit.integrations.accelerate_per_bucket``). Defaults
            to False.
        forward_order_tail (int | None): with ``optimizer_overlap``, as in ``ok.GradBucketer``.
        norm_ready_at_step (bool): with ``optimizer_overlap``: whether the norm
            ``accelerator.clip_grad_norm_`` returns is final when ``optimizer.step()`` returns
            (True, the default) or only after ``make_norm_final()`` (False: the all-reduce
            tail stays overlapped on steps that do not read it).

    Returns:
        OverlapDDPKwargs: the handler now in ``accelerator.ddp_handler``; with
        ``optimizer_overlap``, the ``PerBucketPreparation`` (its ``bucketer`` once prepared),
        or None where Accelerate runs one process (nothing to reduce; nothing is changed).

    Raises:
        ValueError: ``bucket_mb="auto"`` (the tuner needs ``ok.ddp`` to build the model; pass a
            number), the accelerator's handler already chose an Accelerate ``comm_hook``, or
            with ``optimizer_overlap``: compression, or a setup it cannot run (named).
    """
    if optimizer_overlap:
        if compress is not None or powersgd_options is not None:
            raise ValueError(
                f"use_ok_ddp: compress={compress!r} / powersgd_options apply to ok.ddp's hook; "
                "optimizer_overlap=True builds no DDP (the bucketer reduces in full precision)"
            )
        if not accelerator.use_distributed:
            return None
        return PerBucketPreparation(
            accelerator,
            norm_ready_at_step=norm_ready_at_step,
            bucket_mb=bucket_mb,
            check_finite=check_finite,
            on_nonfinite=on_nonfinite,
            forward_order_tail=forward_order_tail,
        )
    if forward_order_tail is not None:
        raise ValueError(
            f"use_ok_ddp: forward_order_tail={forward_order_tail!r} orders the launches for "
            "per-bucket updates; it needs optimizer_overlap=True"
        )
    if bucket_mb == "auto":
        raise ValueError(
            "use_ok_ddp: bucket_mb='auto' is not available when Accelerate builds the DDP "
            "model; pass a size in MiB or None"
        )
    old = accelerator.ddp_handler or DistributedDataParallelKwargs()
    ddp_options = {f.name: getattr(old, f.name) for f in dataclasses.fields(old)}
    if bucket_mb is not None:
        ddp_options["bucket_cap_mb"] = bucket_mb
    handler = OverlapDDPKwargs(
        **ddp_options,
        compress=compress,
        powersgd_options=powersgd_options,
        check_finite=check_finite,
        on_nonfinite=on_nonfinite,
    )
    accelerator.ddp_handler = handler
    return handler
