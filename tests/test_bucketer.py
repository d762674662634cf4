"""ok.GradBucketer: averaged gradients equal a single-process reference in every bucket layout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import overlapkit as ok
from tests.multiproc import run_on_ranks
from tests.reference import (
    IN_FEATURES,
    OUT_FEATURES,
    grads_of,
    make_batches,
    make_mlp,
    reference_grads,
    shard,
)

STEPS = 3
LR = 0.1
N_PARAMS = len(list(make_mlp().parameters()))


def _train_bucketer(rank, world_size, bucket_mb, set_to_none):
    model = make_mlp()
    bucketer = ok.GradBucketer(model, bucket_mb=bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for batch in make_batches(STEPS, world_size):
        x, y = shard(batch, rank, world_size)
        opt.zero_grad(set_to_none=set_to_none)
        nn.functional.mse_loss(model(x), y).backward()
        bucketer.wait()
        grads.append(grads_of(model))
        opt.step()
    return grads, bucketer.num_buckets, ok.comm_stats(bucketer)


@pytest.mark.slow
@pytest.mark.parametrize(
    "bucket_mb, expected_buckets",
    [(25, 1), (0.004, "several"), (1e-6, N_PARAMS)],
    ids=["one-bucket", "several-buckets", "bucket-per-parameter"],
)
@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads-to-none", "grads-zeroed"])
def test_gradients_equal_single_process_reference(bucket_mb, expected_buckets, set_to_none):
    per_rank = run_on_ranks(_train_bucketer, 2, bucket_mb, set_to_none)
    reference = reference_grads(make_mlp(), make_batches(STEPS, 2), lr=LR)
    for rank, (grads, num_buckets, _) in enumerate(per_rank):
        if expected_buckets == "several":
            assert 1 < num_buckets < N_PARAMS
        else:
            assert num_buckets == expected_buckets
        for step, expected in enumerate(reference):
            for name, ref in expected.items():
                torch.testing.assert_close(
                    grads[step][name],
                    ref,
                    rtol=1e-6,
                    atol=1e-6 * ref.abs().max(),
                    msg=lambda m, r=rank, s=step, n=name: f"rank {r} step {s} {n}: {m}",
                )


@pytest.mark.slow
def test_comm_stats_bucket_bytes_sum_to_gradient_bytes():
    per_rank = run_on_ranks(_train_bucketer, 2, 0.004, True)
    grad_bytes = sum(p.numel() * p.element_size() for p in make_mlp().parameters())
    for _, num_buckets, stats in per_rank:
        for step in range(STEPS):
            rows = [r for r in stats.records if r.step == step]
            assert sum(r.nbytes for r in rows) == grad_bytes
            assert all(r.comm_ms is not None for r in rows)
        assert len(stats.by_bucket()) == num_buckets


class TwoHeads(nn.Module):
    """A trunk and three heads: ``a`` always used, ``b`` only where asked, ``never`` never."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(IN_FEATURES, 8)
        self.a = nn.Linear(8, OUT_FEATURES)
        self.b = nn.Linear(8, OUT_FEATURES)
        self.never = nn.Linear(8, OUT_FEATURES)

    def forward(self, x, use_b):
        h = torch.relu(self.trunk(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


def _unused_loss(model, x, y, rank):
    # Head ``b`` is used on rank 1 only: its average is half of rank 1's gradient.
    return nn.functional.mse_loss(model(x, use_b=rank == 1), y)


def _train_with_unused(rank, world_size, bucket_mb):
    model = TwoHeads()
    bucketer = ok.GradBucketer(model, bucket_mb=bucket_mb)
    grads = []
    for batch in make_batches(2, world_size):
        model.zero_grad(set_to_none=True)
        _unused_loss(model, *shard(batch, rank, world_size), rank).backward()
        bucketer.wait()
        grads.append(grads_of(model))
    return grads


def _reference_with_unused(world_size):
    model = TwoHeads()
    out = []
    for batch in make_batches(2, world_size):
        model.zero_grad(set_to_none=True)
        losses = [_unused_loss(model, *shard(batch, r, world_size), r) for r in range(world_size)]
        (sum(losses) / world_size).backward()
        out.append(grads_of(model))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("bucket_mb", [25, 1e-6], ids=["one-bucket", "bucket-per-parameter"])
def test_parameters_unused_on_some_ranks_get_the_average_and_unused_everywhere_stay_none(bucket_mb):
    reference = _reference_with_unused(2)
    for grads in run_on_ranks(_train_with_unused, 2, bucket_mb):
        for step, expected in enumerate(reference):
            assert grads[step]["never.weight"] is None and expected["never.weight"] is None
            for name, ref in expected.items():
                if ref is not None:
                    torch.testing.assert_close(grads[step][name], ref, rtol=1e-6, atol=1e-7)


def _accumulate_two_microbatches(rank, world_size):
    model = make_mlp()
    bucketer = ok.GradBucketer(model, bucket_mb=0.004)
    x, y = shard(make_batches(1, world_size)[0], rank, world_size)
    half = x.shape[0] // 2
    with bucketer.no_sync():
        (nn.functional.mse_loss(model(x[:half]), y[:half]) / 2).backward()
    (nn.functional.mse_loss(model(x[half:]), y[half:]) / 2).backward()
    bucketer.wait()
    return grads_of(model), [r.step for r in ok.comm_stats(bucketer).records]


@pytest.mark.slow
def test_accumulation_over_two_microbatches_reduces_once_and_matches_reference():
    (reference,) = reference_grads(make_mlp(), make_batches(1, 2))
    for grads, steps in run_on_ranks(_accumulate_two_microbatches, 2):
        assert set(steps) == {0}
        for name, ref in reference.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-6, atol=1e-7)


def _misuse(rank, world_size):
    model = make_mlp()
    bucketer = ok.GradBucketer(model, bucket_mb=0.004)
    x, y = shard(make_batches(1, world_size)[0], rank, world_size)
    with pytest.raises(RuntimeError, match=r"wait\(\) was called but no backward"):
        bucketer.wait()
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"parameter '\d\.(weight|bias)' got a second gradient"):
        nn.functional.mse_loss(model(x), y).backward()


@pytest.mark.slow
def test_wait_without_backward_and_double_backward_raise_clear_errors():
    run_on_ranks(_misuse, 2)


@pytest.mark.parametrize("bucket_mb", [0, -0.5])
def test_nonpositive_bucket_mb_is_rejected_with_its_value(bucket_mb):
    with pytest.raises(ValueError, match=f"bucket_mb must be > 0 MiB, got {bucket_mb}"):
        ok.GradBucketer(make_mlp(), bucket_mb=bucket_mb)


def test_model_without_trainable_parameters_is_rejected():
    with pytest.raises(ValueError, match="no trainable parameters"):
        ok.GradBucketer(make_mlp().requires_grad_(False))


def test_missing_process_group_says_how_to_initialise():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ok.GradBucketer(make_mlp())


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(IN_FEATURES, 32)
        self.fc2 = nn.Linear(32, OUT_FEATURES)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _tensor_parallel_times_data_parallel(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(
        TwoLayer(), mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    )
    bucketer = ok.GradBucketer(model, bucket_mb=1e-6, process_group=mesh["dp"].get_group())
    grads = []
    for batch in make_batches(2, 2):
        x, y = shard(batch, mesh["dp"].get_local_rank(), 2)
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        bucketer.wait()
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())
        # full_tensor() of a replicated gradient is the bucket view itself: copy it.
        grads.append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
    return grads


@pytest.mark.slow
def test_tensor_parallel_shards_are_averaged_over_the_data_parallel_group():
    reference = reference_grads(TwoLayer(), make_batches(2, 2), lr=0.0)
    for rank, grads in enumerate(run_on_ranks(_tensor_parallel_times_data_parallel, 4)):
        for step, expected in enumerate(reference):
            for name, ref in expected.items():
                torch.testing.assert_close(
                    grads[step][name],
                    ref,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, r=rank, s=step, n=name: f"rank {r} step {s} {n}: {m}",
                )
