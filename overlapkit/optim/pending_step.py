"""One ``GradBucketer.step()``'s pending bucket updates, as ``PerBucketStep`` keeps them.

A bucket moves through ``to_land`` (its all-reduce not finished yet), then ``to_update`` (its
parameters not updated yet, or on CUDA their update not issued yet); it leaves ``to_land`` no
later than ``to_update``, so every bucket of ``to_land`` is in ``to_update`` too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from overlapkit.optim.clip_request import ClipRequest
from overlapkit.optim.gate import UpdateGate
from overlapkit.optim.protocols import MissingGradients


@dataclass
class PendingStep:
    """One ``step()``'s pending bucket updates."""

    step: int
    hyper: list[dict]
    """Per user param group, its hyper-parameters at ``step()`` (without ``params``)."""
    group_of: dict[int, int]
    """``id(param)`` -> index of the user's param group holding it."""
    missing: MissingGradients
    """The reduction's parameters without a gradient this step (``end_backward()``)."""
    to_land: list[int]
    """Buckets whose reduction is not finished yet, in launch order."""
    to_update: list[int]
    """Buckets not updated yet (on CUDA: whose update is not issued yet)."""
    gate: UpdateGate | None
    """Clipping / GradScaler / NaN-Inf state: every update waits for every bucket."""
    post_hooks: list[Callable]
    """The optimizer's and the global step post-hooks, run once every update is applied."""
    clip: ClipRequest | None = None
    """The step's global-norm clip (its parameters, order and norm tensor); None: no clip."""
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    """Landed gradients by parameter index. Those of the optimizer's parameters are taken off
    ``param.grad`` when their bucket lands (``step()`` includes ``zero_grad()``), so that a
    user's ``optimizer.zero_grad()`` right after ``step()`` (nanoGPT's loop) finds nothing to
    clear, and put back only for the update."""
    events: dict[int, torch.Event] = field(default_factory=dict)
    """On CUDA: per bucket, the side-stream event after its update."""
