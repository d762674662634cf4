"""A clip asked for between backward and the step: ``GradBucketer.clip_grad_norm_``, deferred.

Frameworks clip right after backward, before they call the optimizer, over a parameter list of
their own choosing and order: Lightning over its optimizer's param groups
(``Precision.main_params``), Accelerate and the HF Trainer over ``model.parameters()``. With
per-bucket updates the gradients are not reduced yet at that point, so the clip is recorded as a
``ClipRequest`` and the next ``step()`` folds it into its gate: the total norm over exactly these
parameters' gradients, stacked in this order (the order decides the last bits of the total,
``overlapkit.optim.clip``), and only these gradients multiplied by the coefficient, as
``torch.nn.utils.clip_grad_norm_(parameters, ...)`` called at that point would, after the
all-reduce. The total norm is written into ``ClipRequest.out``, the tensor handed to the caller
at request time, once the step has decided it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from overlapkit.optim.clip import validate_clip_options


@dataclass
class ClipRequest:
    """One step's global-norm clip: its options, its parameters and where its norm goes."""

    max_norm: float
    norm_type: float
    error_if_nonfinite: bool
    order: list[int] | None = None
    """Indices (into the reducer's parameters) of the clip's parameters, in the norm's order;
    None: every reduced gradient, in parameter order (``model.parameters()``)."""
    out: torch.Tensor | None = None
    """0-dim tensor that receives the total norm when the step decides it; None: none asked."""
    _members: frozenset[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.order is not None:
            self._members = frozenset(self.order)

    def covers(self, index: int) -> bool:
        """Whether parameter ``index``'s gradient enters the norm and is clipped."""
        return self._members is None or index in self._members

    def norm_keys(self, landed: Iterable[int]) -> list[int]:
        """The landed gradients of the clip, in the norm's order."""
        if self.order is None:
            return sorted(landed)
        present = set(landed)
        return [i for i in self.order if i in present]


def whole_model_clip(
    max_norm: object, norm_type: object, error_if_nonfinite: object, *, caller: str
) -> ClipRequest:
    """``step(clip_grad_norm=...)``'s clip: every reduced gradient, in parameter order.

    Raises:
        TypeError, ValueError: bad options (``overlapkit.optim.clip.validate_clip_options``).
    """
    max_norm, norm_type = validate_clip_options(
        max_norm, norm_type, error_if_nonfinite, caller=caller
    )
    return ClipRequest(max_norm, norm_type, bool(error_if_nonfinite))


def request_clip(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: object,
    norm_type: object,
    error_if_nonfinite: object,
    *,
    params: Sequence[torch.Tensor],
    caller: str,
) -> ClipRequest:
    """A clip over ``parameters`` (``clip_grad_norm_``'s first argument), in their order.

    Args:
        parameters: a tensor or an iterable of tensors, as ``torch.nn.utils.clip_grad_norm_``
            takes them; each must be one of ``params``.
        max_norm, norm_type, error_if_nonfinite: as in ``clip_grad_norm_``.
        params (Sequence[Tensor]): the reducer's parameters (indices refer to them).
        caller (str): the API named in errors.

    Returns:
        ClipRequest: with ``out`` a 0-dim tensor holding NaN until the step writes the norm,
        in the dtype ``clip_grad_norm_`` returns (the promotion of the parameters' dtypes),
        on the first parameter's device.

    Raises:
        TypeError, ValueError: bad options; a parameter the bucketer does not reduce, or one
            given twice.
    """
    max_norm, norm_type = validate_clip_options(
        max_norm, norm_type, error_if_nonfinite, caller=caller
    )
    given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    index_of = {id(p): i for i, p in enumerate(params)}
    order: list[int] = []
    for k, p in enumerate(given):
        i = index_of.get(id(p))
        if i is None:
            raise ValueError(
                f"{caller}: parameters[{k}] (shape {tuple(p.shape)}) is not a parameter this "
                "bucketer reduces, so its gradient is not known before the step; clip only the "
                "model's trainable parameters"
            )
        if i in order:
            raise ValueError(f"{caller}: parameters[{k}] (shape {tuple(p.shape)}) is given twice")
        order.append(i)
    if given:
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in given))
        out = torch.full((), math.nan, dtype=dtype, device=given[0].device)
    else:
        out = torch.full((), math.nan)  # torch returns tensor(0.0) for no gradients
    return ClipRequest(max_norm, norm_type, bool(error_if_nonfinite), order, out)
