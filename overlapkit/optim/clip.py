"""Exact global-norm gradient clipping computed part by part, with ``clip_grad_norm_``'s bits.

``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)`` (``torch/nn/utils/clip_grad.py``,
the same code in torch 2.9 and 2.13) does, over the gradients that are not None, in
parameter order:

1. split them into (device, dtype) groups with ``_group_tensors_by_device_and_dtype`` and take
   each tensor's norm: ``torch._foreach_norm`` over a group of plain tensors (CPU, CUDA),
   ``torch.linalg.vector_norm`` per tensor otherwise (DTensors: a per-shard norm, reduced later);
2. stack the norms *in the order the groups come out* (a hash map's order, not first appearance),
   each moved to the first gradient's device, with ``torch.stack``'s dtype promotion (fp32 norms
   next to bf16 ones stack as fp32), and take the norm of that vector;
3. multiply every gradient by ``clamp(max_norm / (total + 1e-6), max=1.0)``, per group with
   ``torch._foreach_mul_`` (or ``mul_`` per tensor where foreach does not apply).

A per-tensor norm depends only on its tensor (``_foreach_norm`` reduces each tensor on its own,
whichever list it comes in), and the multiply is element-wise, so steps 1 and 3 can run on any
partition of the gradients, as each part becomes ready (a DDP bucket after its all-reduce, an
FSDP block after its reduce-scatter); only step 2 needs every part. ``NormPartials`` keeps the
norms of one step by key and assembles the total in torch's order; ``clip_coefficient`` and
``scale_grads_`` are step 3. ``max_norm=0.0`` zeroes the gradients, as in torch.

The one condition for the bits to match: each part hands its gradients as torch would see them,
so that the kernel choice of step 1 is the same (plain tensors stay plain, DTensors stay
DTensors). For sharded gradients the total of the local norms is then a partial value that the
caller all-reduces (``DTensor.full_tensor()``) before ``clip_coefficient``, as
``clip_grad_norm_`` on DTensor parameters does.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

EPS = 1e-6
"""Added to the total norm before dividing, as torch does: ``max_norm / (total + 1e-6)``."""


def validate_clip_options(
    max_norm: object, norm_type: object, error_if_nonfinite: object, *, caller: str
) -> tuple[float, float]:
    """Check clipping arguments as the user passed them; returns ``(max_norm, norm_type)``.

    Args:
        max_norm: a number >= 0 (``0.0`` zeroes the gradients, ``inf`` only measures).
        norm_type: the p of the p-norm, a number or ``"inf"`` (torch converts with ``float``).
        error_if_nonfinite: a bool.
        caller (str): the API to name in errors.

    Raises:
        TypeError: a value of the wrong type.
        ValueError: ``max_norm`` negative or NaN, ``norm_type`` NaN.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(
            f"{caller}: clip_grad_norm must be a number (the max norm) or None, got {max_norm!r}"
        )
    if math.isnan(max_norm) or max_norm < 0:
        raise ValueError(
            f"{caller}: clip_grad_norm must be >= 0 (0.0 zeroes the gradients, as in "
            f"torch.nn.utils.clip_grad_norm_), got {max_norm!r}; pass None not to clip"
        )
    try:
        norm = float(norm_type)  # what torch does: 2, 2.0 and "inf" are all accepted
    except (TypeError, ValueError):
        raise TypeError(
            f"{caller}: norm_type must be a number or 'inf', got {norm_type!r}"
        ) from None
    if isinstance(norm_type, bool) or math.isnan(norm):
        raise ValueError(f"{caller}: norm_type must be a number or 'inf', got {norm_type!r}")
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(f"{caller}: error_if_nonfinite must be a bool, got {error_if_nonfinite!r}")
    return float(max_norm), norm


def grad_norms(grads: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each gradient's ``norm_type``-norm, with the kernel ``clip_grad_norm_`` uses for it.

    Args:
        grads (Sequence[Tensor]): gradients (no None).
        norm_type (float): p of the p-norm (``inf`` for the max norm).

    Returns:
        list[Tensor]: 0-dim norms, ``grads[i]``'s at ``i`` (in the gradients' dtype).
    """
    if not grads:  # a part with no gradient (its parameters unused on every rank)
        return []
    out: list[torch.Tensor | None] = [None] * len(grads)
    grouped = _group_tensors_by_device_and_dtype([list(grads)], with_indices=True)
    for (device, _), ([tensors], indices) in grouped.items():
        if _has_foreach_support(tensors, device):
            norms = torch._foreach_norm(tensors, norm_type)
        else:
            norms = [torch.linalg.vector_norm(t, norm_type) for t in tensors]
        for i, norm in zip(indices, norms, strict=True):
            out[i] = norm
    return out


def total_norm(
    grads: Sequence[torch.Tensor], norms: Sequence[torch.Tensor], norm_type: float
) -> torch.Tensor:
    """The norm of the per-tensor norms, stacked in ``clip_grad_norm_``'s order.

    Args:
        grads (Sequence[Tensor]): every gradient of the clip, in parameter order (no None);
            only their devices and dtypes are read (they decide the order).
        norms (Sequence[Tensor]): ``norms[i]`` is the norm of ``grads[i]`` (``grad_norms``).
        norm_type (float): p of the p-norm.

    Returns:
        Tensor: the 0-dim total norm, on the first gradient's device (``tensor(0.0)`` on the
        CPU when there are no gradients, as in torch).
    """
    if not grads:
        return torch.tensor(0.0)
    first_device = grads[0].device
    grouped = _group_tensors_by_device_and_dtype([list(grads)], with_indices=True)
    ordered = [norms[i] for _, (_, indices) in grouped.items() for i in indices]
    return torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in ordered]), norm_type)


def raise_if_nonfinite(total: torch.Tensor, norm_type: float, *, caller: str) -> None:
    """``error_if_nonfinite=True``: raise if ``total`` is NaN or +-Inf (a host sync, as in torch).

    Raises:
        RuntimeError: torch's message, prefixed with ``caller``.
    """
    if torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"{caller}: the total norm of order {norm_type} for gradients from `parameters` "
            "is non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )


def clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """``clamp(max_norm / (total + 1e-6), max=1.0)``: what every gradient is multiplied by.

    Multiplying by 1.0 when nothing is clipped avoids the host sync a branch would need.
    """
    return torch.clamp(float(max_norm) / (total + EPS), max=1.0)


def scale_grads_(grads: Sequence[torch.Tensor], coefficient: torch.Tensor) -> None:
    """Multiply ``grads`` in place by ``coefficient``, with ``clip_grad_norm_``'s kernels."""
    if not grads:
        return
    for (device, _), ([tensors], _) in _group_tensors_by_device_and_dtype([list(grads)]).items():
        on_device = coefficient.to(device)
        if _has_foreach_support(tensors, device):
            torch._foreach_mul_(tensors, on_device)
        else:
            for t in tensors:
                t.mul_(on_device)


class NormPartials:
    """One step's per-tensor gradient norms, gathered part by part, then the total.

    Args:
        norm_type (float): p of the p-norm (``validate_clip_options``).

    Example::
        >>> partials = NormPartials(2.0)
        >>> for part in parts_as_they_become_ready:          # e.g. DDP buckets
        ...     partials.add(part.keys, [p.grad for p in part.params])
        >>> total = partials.total(keys_in_param_order, grads_in_param_order)
        >>> coef = clip_coefficient(max_norm, total)
        >>> for part in parts:
        ...     scale_grads_([p.grad for p in part.params], coef)
    """

    __slots__ = ("_norms", "norm_type")

    def __init__(self, norm_type: float):
        self.norm_type = float(norm_type)
        self._norms: dict[Hashable, torch.Tensor] = {}

    def add(self, keys: Sequence[Hashable], grads: Sequence[torch.Tensor]) -> None:
        """Compute and keep the norms of ``grads`` (``keys[i]`` names ``grads[i]``)."""
        if len(keys) != len(grads):
            raise ValueError(f"NormPartials.add: {len(keys)} keys for {len(grads)} gradients")
        for key, norm in zip(keys, grad_norms(grads, self.norm_type), strict=True):
            self._norms[key] = norm

    def __contains__(self, key: Hashable) -> bool:
        return key in self._norms

    def total(self, keys: Sequence[Hashable], grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """The total norm over ``grads`` (every gradient of the clip, in parameter order).

        Raises:
            KeyError: a key whose norm was never added.
        """
        missing = [k for k in keys if k not in self._norms]
        if missing:
            raise KeyError(f"NormPartials.total: no norm was added for {missing[:5]}")
        return total_norm(grads, [self._norms[k] for k in keys], self.norm_type)

    def clear(self) -> None:
        """Forget every norm (the next step starts over)."""
        self._norms.clear()
