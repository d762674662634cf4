"""Resolve and validate the process group an overlapkit wrapper communicates over."""

from __future__ import annotations

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
