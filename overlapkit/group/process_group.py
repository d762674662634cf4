"""Resolve and validate the process group an overlapkit wrapper communicates over."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def resolve_process_group(
    process_group: dist.ProcessGroup | None, *, caller: str
) -> dist.ProcessGroup:
    """Return ``process_group``, or the default group when it is None.

    Raises:
        RuntimeError: torch.distributed is unavailable or not initialised; the message says
            how to initialise it and names ``caller`` (the overlapkit API being set up).
        TypeError: ``process_group`` is not a ``ProcessGroup``.
    """
    if not dist.is_available():
        raise RuntimeError(f"{caller} needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{caller} needs an initialised process group: call "
            "torch.distributed.init_process_group(backend) first (torchrun sets the "
            "environment it reads), or pass process_group=..."
        )
    if process_group is None:
        return dist.group.WORLD
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"{caller}: process_group must be a torch.distributed.ProcessGroup or None, "
            f"got {type(process_group).__name__}"
        )
    return process_group


def backend_of(process_group: dist.ProcessGroup) -> str:
    """The backend name of ``process_group`` in lower case (``"gloo"``, ``"nccl"``, ...)."""
    return str(dist.get_backend(process_group)).lower()


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup, async_op: bool = False
) -> dist.Work | None:
    """Gather every rank's ``input`` into ``output`` (``group.size()`` times as many elements).

    ``dist.all_gather_single`` where torch has it (torch 2.13 deprecates the older name with a
    warning on every call), ``dist.all_gather_into_tensor`` before that; looked up per call.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce ``input`` over ``group`` and keep this rank's slice of the result in ``output``.

    ``dist.reduce_scatter_single`` where torch has it (2.13 does, 2.11 does not),
    ``dist.reduce_scatter_tensor`` before that (same arguments); looked up per call.
    """
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, group=group, op=op, async_op=async_op)


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The collective timeout of ``group`` (the default group when None).

    None for a backend that keeps none (torch's ``fake`` test backend).
    """
    group = group if group is not None else dist.group.WORLD
    options = getattr(group._get_backend(group._device_types[0]), "options", None)
    return None if options is None else options._timeout


def inherit_timeout(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """Give ``group`` the default group's collective timeout, and return it.

    ``DeviceMesh`` and ``new_group`` create groups with torch's default timeout (30 min for
    gloo), not the default group's, so a collective that hangs on one of them would wait that
    long whatever ``init_process_group(timeout=...)`` (or torchrun) set. torchtitan resets mesh
    timeouts the same way (``_set_pg_timeout``, private in torch 2.13).
    """
    timeout = group_timeout()
    if timeout is not None:
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    return group


def backend_device_type(requested: str | None = None) -> str:
    """The device type the default process group communicates on: the device of its meshes.

    gloo registers for CUDA tensors as well (``cpu:gloo,cuda:gloo``), but it is torch's CPU
    backend: a gloo group's mesh is a CPU mesh. Other backends are for every device they
    register (``cuda:nccl``; ``cpu:gloo,cuda:nccl`` is for both, CUDA first where available).

    Args:
        requested (str | None): a device type the caller was given; None asks for the default.

    Returns:
        str: ``requested`` when the backend serves it, else the default (``"cuda"`` or
        ``"cpu"``).

    Raises:
        ValueError: ``requested`` is a device type the backend does not serve (``"cuda"`` on
            gloo), named with the backend and the device type to pass instead.
    """
    config = dist.get_backend_config()
    served = [
        device
        for device, backend in (entry.split(":") for entry in config.split(","))
        if backend != "gloo" or device == "cpu"
    ]
    if "cuda" in served and torch.cuda.is_available():
        default = "cuda"
    else:
        default = "cpu" if "cpu" in served else served[0]
    if requested is None:
        return default
    if requested not in served:
        raise ValueError(
            f"device_type={requested!r} does not match the process group's backend ({config}), "
            f"which is for {', '.join(served)} tensors: pass device_type={default!r} (or none), "
            f"or initialise the group with a backend for {requested} (torch's default: "
            f"{dist.Backend.default_device_backend_map.get(requested)!r})"
        )
    return requested
