"""Apply the ``parallel`` config group: call its factory on the model, adapt what comes back.

The group's ``_target_`` is the public API itself (``overlapkit.ddp``, ``overlapkit.GradBucketer``,
``overlapkit.fsdp``) with ``_partial_: true``, so the YAML says exactly which call is made.
What the call returns differs (a DDP module, a bucketer beside the model, an FSDP2 module); the
loop needs the same three things from each: the module to run, how to skip gradient reduction
on the micro-batches before the last one, and what to do after the last backward.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from overlapkit.ddp import GradBucketer

logger = logging.getLogger(__name__)


def _nothing() -> None:
    return None


@dataclass(frozen=True, slots=True)
class Parallelized:
    """The model as the loop drives it."""

    model: nn.Module
    """Run forward on this; its ``parameters()`` go to the optimizer."""
    no_sync: Callable[[], AbstractContextManager]
    """Backwards inside accumulate locally (every micro-batch of a step but the last)."""
    finish_backward: Callable[[], None]
    """Called after the last backward of a step, before clipping and the optimizer."""
    zero_grad_to_none: bool
    """Whether ``optimizer.zero_grad`` may free gradients (the bucketer keeps them as views)."""
    description: str


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def apply_parallel(model: nn.Module, factory: Callable[[nn.Module], object]) -> Parallelized:
    """Call ``factory(model)`` and adapt its result for the loop.

    Args:
        model (nn.Module): the local model, on its device.
        factory (Callable): the instantiated ``parallel`` group (a partial of ``ok.ddp``,
            ``ok.GradBucketer``, ``ok.fsdp`` or any function returning one of those or a module).

    Returns:
        Parallelized: the module to run and its synchronisation controls.

    Raises:
        TypeError: the factory returned something that is neither a module nor a bucketer.
    """
    result = factory(model)
    match result:
        case DistributedDataParallel():
            return Parallelized(result, result.no_sync, _nothing, True, "ok.ddp")
        case GradBucketer():
            return Parallelized(
                model,
                result.no_sync,
                result.wait,
                False,
                f"ok.GradBucketer ({result.num_buckets} buckets)",
            )
        case FSDPModule():
            return Parallelized(result, lambda: _fsdp_no_sync(result), _nothing, True, "ok.fsdp")
        case nn.Module():
            # An unknown wrapper: it reduces gradients as it sees fit, on every backward.
            logger.warning(
                "parallel: %s is not ok.ddp, ok.GradBucketer or ok.fsdp; gradient accumulation "
                "will reduce on every micro-batch",
                type(result).__name__,
            )
            return Parallelized(
                result, contextlib.nullcontext, _nothing, True, type(result).__name__
            )
        case _:
            raise TypeError(
                f"parallel: the factory {factory!r} returned {type(result).__name__}; expected an "
                "nn.Module (ok.ddp, ok.fsdp) or an ok.GradBucketer"
            )
