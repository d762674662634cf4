"""What ``GradBucketer(optimizer=)`` refuses, and why; every error names the value and the fix.

Checked when the bucketer is built (``validate_optimizer``, ``resolve_overlap_options``) and at
each ``step()`` (``refuse_compiled_step``, ``refuse_host_synced_lr``), since an optimizer can be
changed in between.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

CALLER = "ok.GradBucketer(optimizer=...)"
DEFAULT_TAIL = 2
"""Buckets at the end of backward launched first-layer first (``forward_order_tail=None``)."""
SYNCHRONOUS_FORM = (
    "use the synchronous form instead: ok.GradBucketer(model) (no optimizer=), then "
    "loss.backward(); bucketer.wait(); <clip/unscale>; optimizer.step()"
)


class OverlapConflict(RuntimeError):
    """Something needs every reduced gradient before any update, which per-bucket updates lack."""


def stale_read_conflict(name: str) -> OverlapConflict:
    """The error for parameter ``name`` read by a forward before its pending update."""
    return OverlapConflict(
        f"{CALLER}: the gradient of {name!r} arrived while its update of the last step was "
        "still pending: the forward read the parameter without calling the module that holds "
        "it (a parent computing with child.weight, a LightningModule's training_step with "
        "self.weight), so it read the old value. Call bucketer.before_forward(module) (or "
        "bucketer.synchronize()) before such code"
    )


def validate_optimizer(
    optimizer: object, params: list[torch.nn.Parameter], names: list[str]
) -> torch.optim.Optimizer:
    """Check that ``optimizer`` can be applied per bucket to the bucketer's parameters.

    Raises:
        TypeError: not a ``torch.optim.Optimizer``.
        ValueError: LBFGS, a parameter the bucketer does not reduce, DTensor parameters,
            parameters on more than one device, or a compiled ``optimizer.step``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{CALLER}: optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            f"{CALLER}: LBFGS's step(closure) re-evaluates the loss over every parameter, so it "
            f"cannot run per bucket; {SYNCHRONOUS_FORM}"
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
            f"updates (found {tensor_parallel[:3]}...); {SYNCHRONOUS_FORM}"
        )
    devices = {}
    for name, p in zip(names, params, strict=True):
        devices.setdefault(p.device, name)
    if len(devices) > 1:
        found = ", ".join(f"{name!r} on {device}" for device, name in devices.items())
        raise ValueError(
            f"{CALLER}: the parameters are on {len(devices)} devices ({found}); per-bucket "
            "updates run on one device's streams, so put the model on one device (one "
            f"process per GPU) or {SYNCHRONOUS_FORM}"
        )
    refuse_compiled_step(optimizer)
    return optimizer


def _compiled(fn: object) -> bool:
    """Whether ``fn`` (or a function it wraps, as an LR scheduler's wrapper does) is compiled."""
    seen = 0
    while fn is not None and seen < 8:
        if hasattr(fn, "_torchdynamo_orig_callable"):  # what torch.compile returns
            return True
        fn = getattr(fn, "__wrapped__", getattr(fn, "__func__", None))
        seen += 1
    return False


def refuse_compiled_step(optimizer: torch.optim.Optimizer) -> None:
    """Refuse ``optimizer.step = torch.compile(optimizer.step)`` (or a compiled class ``step``).

    Per-bucket updates call the optimizer class's own ``step`` on a view of each bucket, so a
    compiled ``step`` would silently run uncompiled, bucket after bucket.

    Raises:
        ValueError: the instance's or the class's ``step`` is a ``torch.compile`` result.
    """
    if _compiled(vars(optimizer).get("step")) or _compiled(type(optimizer).step):
        raise ValueError(
            f"{CALLER}: optimizer.step is compiled (torch.compile); per-bucket updates run the "
            "optimizer's eager step on one bucket at a time, so the compiled step would never "
            "run. Drop the torch.compile of the step (the model may stay compiled), or "
            f"{SYNCHRONOUS_FORM}"
        )


def refuse_host_synced_lr(hyper: list[dict]) -> None:
    """On CUDA: refuse a tensor ``lr`` that torch's optimizers would read on the host.

    Without ``capturable=True`` or ``fused=True``, torch's Adam/AdamW/SGD turn a tensor ``lr``
    into a Python number per parameter (``.item()``, a device sync), which would make every
    bucket's update wait for the GPU inside ``step()``.

    Raises:
        ValueError: naming the param group.
    """
    for g, group in enumerate(hyper):
        lr = group.get("lr")
        if (
            isinstance(lr, torch.Tensor)
            and lr.is_cuda
            and not (group.get("capturable") or group.get("fused"))
        ):
            raise ValueError(
                f"{CALLER}: param_groups[{g}]['lr'] is a CUDA tensor but the group has neither "
                "capturable=True nor fused=True, so torch reads it on the host once per "
                "parameter (a device sync per bucket); make lr a float, or build the optimizer "
                "with fused=True or capturable=True"
            )


def resolve_overlap_options(
    optimizer: object, forward_order_tail: int | None, *, auto_bucket_mb: bool
) -> int:
    """Check the bucketer options that interact with ``optimizer=``; returns the tail length.

    Raises:
        ValueError: ``forward_order_tail`` without ``optimizer``, or not an int >= 0;
            ``bucket_mb="auto"`` with ``optimizer``.
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
