"""The default gradient bucket size: small enough that communication starts early in backward.

A bucket's all-reduce can only start once every gradient in it is ready, so the first bucket
decides how much of backward passes before the network is used at all, and the last one how much
communication is left after backward ends. DDP's fixed 25 MiB gives a 32 MiB model two buckets:
the first is ready only after 7/8 of backward, and overlap is poor. Aiming for about
``TARGET_BUCKETS`` buckets bounds both ends to about 1/8 of the work, while the 25 MiB cap keeps
large models at DDP's size (where the per-collective latency would otherwise add up) and the
1 MiB floor keeps tiny models from paying that latency for nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from overlapkit.ddp.options import validate_bucket_mb

MiB = 1024 * 1024
TARGET_BUCKETS = 8
MIN_BUCKET_MB = 1.0
MAX_BUCKET_MB = 25.0


def default_bucket_mb(params: Sequence[torch.Tensor]) -> float:
    """About 1/``TARGET_BUCKETS`` of the gradient bytes, clamped to [1, 25] MiB."""
    grad_mib = sum(p.numel() * p.element_size() for p in params) / MiB
    return min(MAX_BUCKET_MB, max(MIN_BUCKET_MB, grad_mib / TARGET_BUCKETS))


def resolve_bucket_mb(
    bucket_mb: float | None, params: Sequence[torch.Tensor], *, caller: str
) -> float:
    """``bucket_mb`` checked (a positive number of MiB), or the default for ``params`` if None."""
    if bucket_mb is None:
        return default_bucket_mb(params)
    return validate_bucket_mb(bucket_mb, caller=caller)
