"""The default bucket size: about 1/8 of the gradient, clamped to [1, 25] MiB."""

from __future__ import annotations

import math

import pytest
import torch

from overlapkit.ddp.bucket_size import default_bucket_mb, resolve_bucket_mb

MiB = 1024 * 1024


def _fp32_params(total_mib: float) -> list[torch.Tensor]:
    # Meta tensors: sizes without memory.
    return [torch.empty(int(total_mib * MiB / 4), device="meta")]


@pytest.mark.parametrize(
    "gradient_mib, expected_mb",
    [(32, 4.0), (12, 1.5), (2, 1.0), (0.01, 1.0), (1000, 25.0)],
)
def test_default_is_an_eighth_of_the_gradient_between_1_and_25_mib(gradient_mib, expected_mb):
    assert default_bucket_mb(_fp32_params(gradient_mib)) == pytest.approx(expected_mb)


def test_an_explicit_size_wins_and_is_validated():
    assert resolve_bucket_mb(7, _fp32_params(32), caller="x") == 7.0
    with pytest.raises(TypeError, match="x: bucket_mb must be a number of MiB, got '4'"):
        resolve_bucket_mb("4", _fp32_params(32), caller="x")
    for size in (math.inf, 10**400):
        with pytest.raises(ValueError, match="x: bucket_mb must be a finite number of MiB"):
            resolve_bucket_mb(size, _fp32_params(32), caller="x")
