"""``torch.amp.GradScaler`` folded into updates applied part by part, with the scaler's own bits.

The synchronous loop ``scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt);
scaler.update()`` (``torch/amp/grad_scaler.py``, the same in torch 2.9 and 2.13) does:

- ``unscale_``: ``inv_scale = scale.double().reciprocal().float()``, a zero ``found_inf`` per
  device, and ``torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``
  over the optimizer's gradients, per (device, dtype); the scaler's per-optimizer state becomes
  ``UNSCALED`` with ``found_inf_per_device``;
- ``step``: an optimizer that takes the flags itself (``_step_supports_amp_scaling``: the
  ``fused=True`` Adam, AdamW, SGD, ...) is stepped with ``optimizer.found_inf`` (and
  ``grad_scale``, which is None once unscaled; with no ``unscale_`` before, the scale itself and
  no unscaling: the kernel divides, ``found_inf`` comes from a check with ``inv_scale`` 1.0);
  any other optimizer is stepped only if ``found_inf`` sums to zero, one host read;
- ``update``: reads ``found_inf_per_device`` of every optimizer and adjusts the scale.

Unscaling and the check are element-wise and ``found_inf`` only ever goes from 0 to 1, so both
can run part by part as the gradients arrive. ``ScaledStep`` does that with the same kernel, and
writes the scaler's per-optimizer state as ``scaler.step`` leaves it (``STEPPED``, with this
step's ``found_inf``), so the user's ``scaler.update()`` works unchanged. Reading that state
means reading the scaler's private ``_per_optimizer_states``, ``_scale`` and ``OptState``: the
only way to hand ``update()`` the flags it reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.amp.grad_scaler import GradScaler, OptState
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype


def scaler_in_use(scaler: object, *, caller: str) -> GradScaler | None:
    """``scaler`` if it scales (None and a disabled scaler: nothing to do).

    Raises:
        TypeError: not a ``torch.amp.GradScaler`` (the CUDA and CPU ones both are).
    """
    if scaler is None:
        return None
    if not isinstance(scaler, GradScaler):
        raise TypeError(f"{caller}: scaler must be a torch.amp.GradScaler, got {scaler!r}")
    return scaler if scaler.is_enabled() else None


class ScaledStep:
    """One step's unscale and inf check for ``scaler`` and ``optimizer``, part by part.

    Args:
        scaler (GradScaler): enabled, with ``scaler.scale(loss)`` called this step.
        optimizer (Optimizer): the optimizer ``scaler.step`` would be given.
        device (torch.device): the gradients' device.
        unscale (bool): True: unscale as ``scaler.unscale_`` does (needed before clipping).
            False: check only, and let an optimizer that takes the flags divide by the scale
            in its kernel, as ``scaler.step`` does without ``unscale_``; only allowed for such
            optimizers (``takes_flags``).
        caller (str): the API named in errors.

    Raises:
        RuntimeError: ``unscale_`` or ``step`` was already called on ``optimizer`` since the
            last ``update()``, or ``scaler.scale()`` was never called.
    """

    __slots__ = ("found_inf", "grad_scale", "inv_scale", "optimizer", "scaler", "takes_flags")

    def __init__(
        self,
        scaler: GradScaler,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        unscale: bool,
        caller: str,
    ):
        state = scaler._per_optimizer_states[id(optimizer)]
        if state["stage"] is not OptState.READY:
            done = "unscale_()" if state["stage"] is OptState.UNSCALED else "scaler.step()"
            raise RuntimeError(
                f"{caller}: {done} was already called on this optimizer since the last "
                "scaler.update(); with scaler= the bucketer unscales and steps itself, so call "
                "only scaler.scale(loss).backward(), bucketer.step(..., scaler=scaler) and "
                "scaler.update()"
            )
        if scaler._scale is None:
            raise RuntimeError(
                f"{caller}: scaler.scale(loss) was never called, so there is nothing to unscale"
            )
        self.scaler = scaler
        self.optimizer = optimizer
        self.takes_flags = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        assert unscale or self.takes_flags, "only an optimizer taking found_inf can skip unscale"
        scale = scaler._scale
        if unscale:
            # FP32 division can be imprecise, so torch takes the reciprocal in FP64 (not on MPS).
            inv = scale.reciprocal() if scale.device.type == "mps" else scale.double().reciprocal()
            self.inv_scale = inv.float().to(device)
            self.grad_scale = None
        else:
            self.inv_scale = torch.full((), 1.0, dtype=torch.float32, device=device)
            # A copy, as scaler.step's ``scale * 1``: scaler.update() changes the scale in
            # place, possibly before the last bucket's update has run.
            self.grad_scale = scale.clone()
        self.found_inf = torch.full((), 0.0, dtype=torch.float32, device=device)

    @property
    def unscales(self) -> bool:
        """Whether ``unscale_`` divides the gradients (False: the optimizer's kernel does)."""
        return self.grad_scale is None

    def check_gradients(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> None:
        """Refuse fp16 gradients, as ``scaler.unscale_`` does ("Attempting to unscale FP16").

        Raises:
            ValueError: naming the first fp16 gradient's parameter.
        """
        if not self.unscales:
            return
        for name, grad in zip(names, grads, strict=True):
            if grad.dtype == torch.float16:
                raise ValueError(
                    f"Attempting to unscale FP16 gradients ({name!r}): GradScaler needs fp32 "
                    "parameters (run the forward under torch.autocast for fp16 compute)"
                )

    def unscale_(self, grads: Sequence[torch.Tensor]) -> None:
        """Unscale (or, for ``unscale=False``, only check) a part of the optimizer's gradients."""
        if not grads:
            return
        for _, ([group], _) in _group_tensors_by_device_and_dtype([list(grads)]).items():
            torch._amp_foreach_non_finite_check_and_unscale_(group, self.found_inf, self.inv_scale)

    def hand_to_scaler(self) -> None:
        """Leave the scaler's state as ``scaler.step(optimizer)`` does, for ``scaler.update()``.

        ``update()`` reads ``found_inf`` when it runs; the caller makes sure it is final by then.
        """
        state = self.scaler._per_optimizer_states[id(self.optimizer)]
        state["found_inf_per_device"] = {self.found_inf.device: self.found_inf}
        state["stage"] = OptState.STEPPED

    def optimizer_flags(self) -> dict[str, torch.Tensor | None]:
        """The attributes ``scaler.step`` sets on an optimizer that takes the flags."""
        return {"grad_scale": self.grad_scale, "found_inf": self.found_inf}

    def skips(self) -> bool:
        """Whether the step is skipped (an inf/NaN was found): one host read of ``found_inf``."""
        return bool(self.found_inf.item())
