"""ZeRO-1 and ZeRO-2 on FSDP2 (``ok.fsdp(model, zero=1|2)``), and gradient accumulation.

FSDP2 is ZeRO-3: each block's parameters are all-gathered before its forward, freed after it,
gathered again for its backward and its gradients reduce-scattered. The two lower stages keep
the optimizer state (and, for ZeRO-2, the gradients) sharded but the parameters gathered for the
whole step, with FSDP2's own switches:

==========  =====================================================  ==========================
``zero``    FSDP2 settings                                          per step, per block
==========  =====================================================  ==========================
None (3)    ``reshard_after_forward=True``                          ``2m`` all-gathers (the
                                                                    root ``m``), 1 or ``m``
                                                                    reduce-scatters
1           ``reshard_after_forward=False``; in ``no_sync``:         1 all-gather,
            ``set_reshard_after_backward(False)`` and               1 reduce-scatter
            ``set_requires_gradient_sync(False)``
2           ``reshard_after_forward=False``; in ``no_sync``:         1 all-gather,
            ``set_reshard_after_backward(False)``                   ``m`` reduce-scatters
==========  =====================================================  ==========================

(``m`` micro-batches per step; ZeRO-3 reduce-scatters once with ``no_sync``, as ZeRO-1 does.)
After the last micro-batch's backward every stage reshards, the optimizer updates the shards,
and the next step's first forward all-gathers them. ZeRO-1 accumulates whole (unsharded)
gradients locally until the last micro-batch; ZeRO-2 reduce-scatters every micro-batch and keeps
only the sharded sum. ``no_sync(model)`` is the switch the micro-batches before the last run
under, as ``DistributedDataParallel.no_sync`` is for DDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.distributed.fsdp import FSDPModule

from overlapkit.fsdp.state import is_registered, state_of

ZERO_STAGES = (1, 2)


def resolve_reshard_after_forward(zero: object, reshard_after_forward: object) -> object:
    """``reshard_after_forward`` as ``zero`` needs it: None means True (ZeRO-3) or, under
    ``zero``, False; any other value is returned as given (checked by
    ``keywords.check_reshard_after_forward``).

    Raises:
        TypeError: ``zero`` not an int or None.
        ValueError: ``zero`` not in ``ZERO_STAGES``, or with a ``reshard_after_forward`` other
            than None or False (True and ints reshard after forward).
    """
    if zero is None:
        return True if reshard_after_forward is None else reshard_after_forward
    if isinstance(zero, bool) or not isinstance(zero, int):
        raise TypeError(f"ok.fsdp: zero must be 1, 2 or None (ZeRO-3), got {zero!r}")
    if zero not in ZERO_STAGES:
        raise ValueError(
            f"ok.fsdp: zero={zero} is not supported; choose 1 (sharded optimizer state), 2 (and "
            "sharded gradients) or None (ZeRO-3: parameters sharded too, the default)"
        )
    if reshard_after_forward is not None and reshard_after_forward is not False:
        raise ValueError(
            f"ok.fsdp: zero={zero} keeps the parameters gathered from a step's first forward to "
            f"its last backward, but reshard_after_forward={reshard_after_forward!r} reshards "
            "them after each forward; leave reshard_after_forward unset (None) with zero"
        )
    return False


def zero_stage(model: FSDPModule) -> int | None:
    """The ``zero`` that ``ok.fsdp`` was given for ``model`` (None: ZeRO-3, or not ok.fsdp's)."""
    return state_of(model, caller="zero_stage").zero if is_registered(model) else None


@contextlib.contextmanager
def no_sync(model: FSDPModule) -> Iterator[None]:
    """Run the backwards of a step's micro-batches but the last inside: no gradient reduction
    (ZeRO-3, ZeRO-1) or no resharding (ZeRO-1, ZeRO-2), as ``model``'s ``zero`` says.

    Args:
        model (FSDPModule): the model returned by ``ok.fsdp`` (or any ``fully_shard`` root,
            treated as ZeRO-3).

    Example:
        >>> for i, (x, y) in enumerate(micro_batches):
        ...     with no_sync(model) if i < len(micro_batches) - 1 else contextlib.nullcontext():
        ...         loss_fn(model(x), y).backward()
        >>> optimizer.step()
    """
    zero = zero_stage(model)
    keep_gathered = zero is not None
    defer_reduction = zero != 2
    if keep_gathered:
        model.set_reshard_after_backward(False)
    if defer_reduction:
        model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        if defer_reduction:
            model.set_requires_gradient_sync(True)
        if keep_gathered:
            model.set_reshard_after_backward(True)
