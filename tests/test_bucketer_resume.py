"""A resumed GradBucketer reduces with the saved bucket layout, whatever the model's ready order.

The bucketer rebuilds its buckets after the first step in the order gradients became ready; a
new one starts from reverse registration order. The layout sets the summation order of the ring
all-reduce, so a checkpoint carries it (``bucketers.<i>``) and loading restores it.
"""

import functools

import pytest
import torch
from torch import nn

import overlapkit as ok
from overlapkit.train.parallel.wrappers import apply_parallel
from overlapkit.train.run.checkpoint import TrainingState
from overlapkit.train.run.data import BatchStream, SyntheticRegression
from overlapkit.train.run.lr_schedule import warmup_cosine
from tests.multiproc import run_on_ranks

BUCKET_MB = 0.0005  # about one layer per bucket


class LateFirst(nn.Module):
    """``late`` is registered last but runs first.

    Gradients become ready as ``second``, ``first``, ``late``; reverse registration order is
    ``late``, ``second``, ``first``.
    """

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 32)
        self.second = nn.Linear(32, 8)
        self.late = nn.Linear(8, 8)

    def forward(self, x):
        return self.second(torch.relu(self.first(self.late(x))))


def _setup(rank):
    # As the training loop builds it: the bucketer reaches the checkpoint through apply_parallel.
    par = apply_parallel(LateFirst(), functools.partial(ok.GradBucketer, bucket_mb=BUCKET_MB))
    (bucketer,) = par.bucketers
    model = par.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = warmup_cosine(optimizer, total_steps=10, warmup_steps=2)
    stream = BatchStream(SyntheticRegression(width=8, seed=1), rank=rank, batch_size=4)
    state = TrainingState(model, optimizer, scheduler, stream, rank, par.bucketers)
    return bucketer, state


def _steps(bucketer, state, n):
    for _ in range(n):
        x, y = state.stream.next()
        state.optimizer.zero_grad()
        SyntheticRegression.loss(state.model(x), y).backward()
        bucketer.wait()
        state.optimizer.step()
        state.scheduler.step()


def _resume(rank, world_size, root):
    bucketer, state = _setup(rank)
    initial = bucketer.bucket_parameter_names()
    _steps(bucketer, state, 2)
    path = state.save(root, 2, keep=1)
    saved = bucketer.bucket_parameter_names()
    _steps(bucketer, state, 2)

    fresh_bucketer, fresh = _setup(rank)
    fresh.load(path)
    loaded = fresh_bucketer.bucket_parameter_names()
    _steps(fresh_bucketer, fresh, 2)

    other = fresh_bucketer.state_dict()
    other["parameters"] = [n.replace("late", "early") for n in other["parameters"]]
    with pytest.raises(ValueError) as refused:
        fresh_bucketer.load_state_dict(other)
    return {
        "initial": initial,
        "saved": saved,
        "loaded": loaded,
        "after": fresh_bucketer.bucket_parameter_names(),
        "equal": [
            torch.equal(a, b)
            for a, b in zip(state.model.parameters(), fresh.model.parameters(), strict=True)
        ],
        "refused": str(refused.value),
    }


@pytest.mark.slow
def test_resumed_bucketer_reduces_with_the_saved_layout_not_registration_order(tmp_path):
    for result in run_on_ranks(_resume, 2, str(tmp_path)):
        # The premise: the ready-order layout is not the one a new bucketer starts with.
        assert result["saved"] != result["initial"]
        assert result["loaded"] == result["saved"]
        assert result["after"] == result["saved"]  # and it is not rebuilt again
        assert all(result["equal"])
        assert "the saved layout is of another model: it names ['early.bias'" in result["refused"]
        assert "lacks ['late.bias', 'late.weight']" in result["refused"]
