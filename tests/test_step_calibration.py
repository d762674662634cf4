"""bench.harness.step_calibration: the host terms bench.planner_ranking measures, on 2 ranks.

What they measure is timing (checked side by side by the benchmark, not here); these tests
check that each runs on real process groups and returns what ``StepOptions`` takes.
"""

import pytest
import torch

from bench.harness.step_calibration import (
    compute_calibration,
    one_rank_group,
    optimizer_calibration,
    overlap_calibration,
)
from overlapkit.train.models import GPT, GPTConfig
from tests.multiproc import run_on_ranks

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _calibrate(rank: int, world_size: int) -> dict:
    alone = one_rank_group()
    idx = torch.randint(CONFIG.vocab_size, (2, CONFIG.block_size + 1))
    inputs, targets = idx[:, :-1], idx[:, 1:]
    rate, dispatch = compute_calibration(
        _model, inputs, targets, flops=1e6, layers=2, tensor_parallel=True, alone=alone, steps=3
    )
    return {
        "rate": rate,
        "dispatch": dispatch,
        **optimizer_calibration(_model(), alone=alone, steps=3),
        **overlap_calibration(_model(), inputs, targets, trials=2),
    }


@pytest.mark.slow
def test_calibrations_give_every_rank_the_slowest_ranks_figures():
    per_rank = run_on_ranks(_calibrate, 2)
    assert per_rank[0] == per_rank[1]  # the slowest rank's medians, on every rank
    terms = per_rank[0]
    assert terms["rate"] > 0 and terms["dispatch"] >= 0
    assert terms["optimizer_tensor_s"] > 0 and terms["optimizer_dtensor_s"] > 0
    assert terms["optimizer_param_s"] >= 0
    assert 0 <= terms["overlap_efficiency"] <= 1 and terms["transfers"] >= 1
