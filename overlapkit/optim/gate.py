"""What makes every update of a step wait for every part: clipping, GradScaler, NaN/Inf checks.

Global-norm clipping needs the norm over every reduced gradient, ``GradScaler`` a skip decision
over every gradient, ``check_finite`` a verdict over every bucket. With any of them, a step's
per-part updates go through an ``UpdateGate``:

1. ``landed(part)`` as each part's gradients are final (a DDP bucket after its all-reduce):
   unscale them and check for inf/NaN (``ScaledStep``), take their per-tensor norms
   (``NormPartials``); this overlaps the parts still in flight;
2. ``decide()`` once every part has landed: the total norm in ``clip_grad_norm_``'s order, its
   clip coefficient, and whether the step is skipped;
3. ``prepare(part)`` before each part's update: multiply its gradients by the coefficient.

The order is the synchronous loop's (``unscale_``, ``clip_grad_norm_`` over the model's
parameters, ``scaler.step``), so the bits are the same (``overlapkit.optim.clip``,
``overlapkit.optim.grad_scaling``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from overlapkit.optim.clip import NormPartials, clip_coefficient, raise_if_nonfinite, scale_grads_
from overlapkit.optim.grad_scaling import ScaledStep


class UpdateGate:
    """One step's clip and scale state; gradients are handed in by key (a parameter's index).

    Args:
        max_norm (float | None): clip to this total norm; None: no clipping.
        norm_type (float): p of the p-norm.
        error_if_nonfinite (bool): raise at ``decide()`` on a NaN/Inf total (a host sync).
        scaled (ScaledStep | None): the step's GradScaler state; None: no scaler.
        caller (str): the API named in errors.
    """

    def __init__(
        self,
        *,
        max_norm: float | None,
        norm_type: float,
        error_if_nonfinite: bool,
        scaled: ScaledStep | None,
        caller: str,
    ):
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.error_if_nonfinite = error_if_nonfinite
        self.scaled = scaled
        self.caller = caller
        self.partials = NormPartials(norm_type) if max_norm is not None else None
        self.total: torch.Tensor | None = None
        """The step's total norm, after ``decide()`` (with clipping)."""
        self.coefficient: torch.Tensor | None = None
        self.skip = False
        """After ``decide()``: whether no update is applied (GradScaler found inf/NaN)."""
        self.decided = False

    @property
    def clips(self) -> bool:
        return self.partials is not None

    def landed(
        self,
        keys: Sequence[Hashable],
        grads: Sequence[torch.Tensor],
        unscaled: Sequence[bool],
        measured: Sequence[bool],
    ) -> None:
        """A part's gradients are final: unscale those of the optimizer (``unscaled[k]``, as
        ``GradScaler.unscale_`` does), then take the norm of those of the clip (``measured``)."""
        if self.scaled is not None:
            self.scaled.unscale_([g for g, mine in zip(grads, unscaled, strict=True) if mine])
        if self.partials is not None:
            pairs = [(k, g) for k, g, m in zip(keys, grads, measured, strict=True) if m]
            self.partials.add([k for k, _ in pairs], [g for _, g in pairs])

    def decide(
        self, keys: Sequence[Hashable], grads: Sequence[torch.Tensor], *, host_skip: bool
    ) -> None:
        """Every part has landed: total norm, coefficient, skip.

        Args:
            keys, grads: every gradient of the clip, in the clip's order
                (``model.parameters()`` unless it was given its own).
            host_skip (bool): read the scaler's inf flag on the host to decide the skip (an
                optimizer that cannot take ``found_inf`` itself); False leaves it to the kernel.

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the total norm is NaN/Inf.
        """
        if self.partials is not None:
            self.total = self.partials.total(keys, grads)
            self.partials.clear()
            if self.error_if_nonfinite:
                raise_if_nonfinite(self.total, self.norm_type, caller=self.caller)
            self.coefficient = clip_coefficient(self.max_norm, self.total)
        self.skip = self.scaled is not None and host_skip and self.scaled.skips()
        self.decided = True

    def prepare(self, grads: Sequence[torch.Tensor]) -> None:
        """Before a part's update: clip its gradients (those of the clip only)."""
        if self.coefficient is not None:
            scale_grads_(grads, self.coefficient)
