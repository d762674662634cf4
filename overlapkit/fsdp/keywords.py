"""``fully_shard``'s own keywords in ``ok.fsdp``: ``mp_policy``, ``offload_policy`` and an int
``reshard_after_forward``, under their names and with their meanings, so that a script's
``fully_shard(block, **fsdp_kwargs)`` calls become one ``ok.fsdp(model, **fsdp_kwargs)``.

``mixed_precision`` (overlapkit's name, which also takes ``"bf16"``: ``resolve_mixed_precision``)
keeps working; a call that gives both it and ``mp_policy`` is refused rather than one silently
winning. What cannot run is
refused here, in one line naming the value, before anything is sharded: an int
``reshard_after_forward`` that does not divide the mesh's shard axis (FSDP2 would say so from
inside ``fully_shard``), and a ``CPUOffloadPolicy`` that pins memory where no accelerator is
(FSDP2 would fail in the first forward). ``zero`` and ``reshard_after_forward`` are reconciled in
``overlapkit.fsdp.zero``.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

MIXED_PRECISIONS = (None, "bf16")
"""``mixed_precision``'s shorthands; any ``MixedPrecisionPolicy`` is taken as well."""


def resolve_mixed_precision(
    mixed_precision: str | MixedPrecisionPolicy | None,
) -> MixedPrecisionPolicy:
    """Map ``mixed_precision`` to FSDP2's ``MixedPrecisionPolicy``.

    ``"bf16"`` all-gathers and computes in bfloat16 and reduce-scatters gradients in float32
    (summing bf16 gradients across ranks loses precision); the sharded parameters and the
    optimizer stay in their own dtype. A ``MixedPrecisionPolicy`` is used as given.

    Raises:
        ValueError: anything else, named with the choices.
    """
    match mixed_precision:
        case None:
            return MixedPrecisionPolicy()
        case "bf16":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        case MixedPrecisionPolicy():
            return mixed_precision
        case _:
            raise ValueError(
                f"ok.fsdp: unknown mixed_precision={mixed_precision!r}; choose one of "
                f"{list(MIXED_PRECISIONS)} or pass a torch.distributed.fsdp.MixedPrecisionPolicy"
            )


def resolve_mp_policy(
    mixed_precision: str | MixedPrecisionPolicy | None, mp_policy: MixedPrecisionPolicy | None
) -> str | MixedPrecisionPolicy | None:
    """The mixed precision asked for, under either name.

    Args:
        mixed_precision: overlapkit's keyword: None, ``"bf16"`` or a ``MixedPrecisionPolicy``.
        mp_policy: ``fully_shard``'s keyword: a ``MixedPrecisionPolicy`` or None.

    Returns:
        the one given (``mixed_precision`` when neither is), for ``resolve_mixed_precision``.

    Raises:
        TypeError: ``mp_policy`` is not a ``MixedPrecisionPolicy``.
        ValueError: both are given.
    """
    if mp_policy is None:
        return mixed_precision
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"ok.fsdp: mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, as in "
            f"fully_shard, got {mp_policy!r}; overlapkit's shorthand is mixed_precision='bf16'"
        )
    if mixed_precision is not None:
        raise ValueError(
            f"ok.fsdp: mixed_precision={mixed_precision!r} and mp_policy={mp_policy!r} both "
            "set the mixed precision; pass one of them (mp_policy is fully_shard's name)"
        )
    return mp_policy


def resolve_offload_policy(offload_policy: OffloadPolicy | None) -> OffloadPolicy:
    """``fully_shard``'s ``offload_policy``: None means its default, ``OffloadPolicy()``.

    Raises:
        TypeError: not an ``OffloadPolicy``.
        ValueError: ``CPUOffloadPolicy(pin_memory=True)`` where no accelerator is available
            (pinned host memory is for copies to one).
    """
    if offload_policy is None:
        return OffloadPolicy()
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            "ok.fsdp: offload_policy must be a torch.distributed.fsdp.OffloadPolicy (or "
            f"CPUOffloadPolicy), as in fully_shard, or None, got {offload_policy!r}"
        )
    pins = isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory
    if pins and torch.accelerator.current_accelerator(check_available=True) is None:
        raise ValueError(
            f"ok.fsdp: offload_policy={offload_policy!r} pins host memory for copies to an "
            "accelerator, and none is available here; pass CPUOffloadPolicy(pin_memory=False)"
        )
    return offload_policy


def check_reshard_after_forward(value: object) -> bool | int:
    """``fully_shard``'s ``reshard_after_forward``: a bool or an int, before any mesh exists.

    A bool frees (True) or keeps (False) each block's unsharded parameters after its forward.
    An int ``k`` keeps a ``1/k`` shard over groups of ``k`` ranks after forward, so backward
    all-gathers over ``k`` ranks instead of the whole axis (FSDP2 reads ``k == 1`` as False and
    ``k`` equal to the axis as True); ``check_divides_shard_axis`` checks it on the mesh.

    Args:
        value: what the caller passed, None already resolved
            (``zero.resolve_reshard_after_forward``).

    Returns:
        bool | int: ``value``.

    Raises:
        TypeError: neither a bool nor an int.
    """
    if not isinstance(value, int):
        raise TypeError(
            "ok.fsdp: reshard_after_forward must be a bool, an int (the ranks to reshard to "
            f"after forward, as in fully_shard) or None, got {value!r}"
        )
    return value


def check_divides_shard_axis(reshard_after_forward: bool | int, shard_ranks: int) -> None:
    """Raise unless an int ``reshard_after_forward`` divides the mesh's shard axis.

    Args:
        reshard_after_forward (bool | int): from ``check_reshard_after_forward``.
        shard_ranks (int): ranks of the mesh's shard axis (its last).

    Raises:
        ValueError: an int below 1 or that does not divide ``shard_ranks``.
    """
    if isinstance(reshard_after_forward, bool):
        return
    if reshard_after_forward < 1 or shard_ranks % reshard_after_forward:
        k = reshard_after_forward
        raise ValueError(
            f"ok.fsdp: reshard_after_forward={k} must divide the mesh's shard axis "
            f"({shard_ranks} ranks): after forward each block keeps a 1/{k} shard over "
            f"groups of {k} ranks; choose a divisor of {shard_ranks}, True or False"
        )


def frees_after_forward(reshard_after_forward: bool | int) -> bool:
    """Whether blocks hold no unsharded parameters between forward and backward (True, or an
    int above 1: a smaller shard stays, which ``ok.fsdp_stats`` does not count as unsharded)."""
    if isinstance(reshard_after_forward, bool):
        return reshard_after_forward
    return reshard_after_forward > 1
