"""GradBucketer(optimizer=) on CUDA: two NCCL ranks on one GPU, against the synchronous path.

Run on a GPU host (offline; no hydra needed), about 5 minutes, as one 2-rank launch:

    python -m pytest -q -m cuda tests/test_per_bucket_cuda.py

The two ranks share GPU 0; each gets its own ``NCCL_HOSTID`` before its first collective, so
NCCL joins them through its socket transport over loopback (docs/emulation.md). Every update of
the side stream is preceded by ``torch.cuda._sleep``, so a missing wait of the compute stream
reads old parameters deterministically instead of by chance.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import pytest
import torch
from torch import nn

import overlapkit as ok
from overlapkit.optim import per_bucket
from tests.cuda import requires_cuda
from tests.multiproc import run_on_ranks

STEPS = 6
SLEEP_CYCLES = 2_000_000  # ~1 ms on an H200: longer than a small update
NCCL_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}
OPTIMIZERS = {
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _Unused(nn.Module):
    """An MLP with a head that only rank 1 uses (its gradient is missing on rank 0)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        self.head = nn.Linear(64, 64)
        self.use_head = False

    def forward(self, x):
        x = self.body(x)
        return self.head(x) if self.use_head else x


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(
            *(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True) for _ in "ab")
        )

    def forward(self, x):
        return self.blocks(x.view(x.shape[0], 4, 16).repeat(1, 1, 4)).mean(dim=1)


MODELS = {
    "mlp": lambda: nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(64, 64), nn.ReLU()))),
    "encoder": _Encoder,
    "unused": _Unused,
}


def _enter_gpu(rank: int) -> torch.device:
    os.environ["NCCL_HOSTID"] = f"host{rank}"  # before the first collective: NCCL's "hosts"
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


@contextlib.contextmanager
def _sleep_before_each_update():
    """Delay every per-bucket update on the stream it runs on (the side stream)."""
    real = per_bucket.step_subset

    def slow(*args, **kwargs):
        torch.cuda._sleep(SLEEP_CYCLES)
        real(*args, **kwargs)

    per_bucket.step_subset = slow
    try:
        yield
    finally:
        per_bucket.step_subset = real


def _run(rank, device, model_name, opt_name, dtype, clip, mode):
    torch.manual_seed(0)
    model = MODELS[model_name]().to(device=device, dtype=DTYPES[dtype])
    opt = OPTIMIZERS[opt_name](model.parameters())
    extra = {"optimizer": opt} if mode == "overlap" else {}
    bucketer = ok.GradBucketer(model, bucket_mb=0.01, **extra)
    g = torch.Generator(device=device).manual_seed(rank)
    evals = []
    for _ in range(STEPS):
        x = torch.randn(16, 64, device=device, generator=g, dtype=DTYPES[dtype])
        if model_name == "unused":
            model.use_head = rank == 1
        model(x).float().square().mean().backward()
        if mode == "overlap":
            bucketer.step(clip_grad_norm=clip)
        else:
            bucketer.wait()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            evals.append(model(x).clone())  # right after step(): reads the updated parameters
        model.train()
    bucketer.synchronize()
    torch.cuda.synchronize()
    state = {
        str(k): {f: v.cpu() for f, v in s.items() if isinstance(v, torch.Tensor)}
        for k, s in opt.state_dict()["state"].items()
    }
    return {
        "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
        "optim": state,
        "evals": [e.cpu() for e in evals],
    }


def _no_sync_and_overlap(rank, device):
    """step() under sync-debug "error", and the last update still pending when it returns."""
    torch.manual_seed(0)
    model = MODELS["mlp"]().to(device)
    out = {}
    for opt_name in ("adamw_foreach", "adamw_fused"):
        opt = OPTIMIZERS[opt_name](model.parameters())
        bucketer = ok.GradBucketer(model, bucket_mb=0.01, optimizer=opt)
        x = torch.randn(16, 64, device=device)
        for step in range(3):
            model(x).square().mean().backward()
            if step == 0:  # the first step adopts rank 0's bucket order (a broadcast)
                bucketer.step(clip_grad_norm=1.0)
                continue
            torch.cuda.set_sync_debug_mode("error")
            try:
                bucketer.step(clip_grad_norm=1.0)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            events = bucketer._overlap.job.events
            out[opt_name, step] = not all(e.query() for e in events.values())
        bucketer.remove()
    return out


def _lazy_state_is_recorded_on_the_compute_stream(rank, device):
    """Optimizer state created on the side stream, read on the compute stream, then freed:
    its block must not be handed out again before the compute stream has read it."""
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    bucketer = ok.GradBucketer(model, bucket_mb=1.0, optimizer=opt)
    x = torch.randn(64, 1024, device=device)
    for _ in range(2):  # the second step's state is created on the side stream (first: rebuild)
        opt.state.clear()
        model(x).square().mean().backward()
        bucketer.step()
    bucketer.synchronize()
    torch.cuda.synchronize()
    exp_avg = opt.state[model.weight]["exp_avg"]
    expected = exp_avg.cpu()
    torch.cuda._sleep(50 * SLEEP_CYCLES)  # the compute stream is busy...
    read = exp_avg.clone()  # ...then reads the state
    del exp_avg
    opt.state.clear()  # freed while the read is pending
    with torch.cuda.stream(bucketer._overlap._path.stream):
        torch.full((1024, 1024), 7.0, device=device)  # would reuse the block at once
    torch.cuda.synchronize()
    return torch.equal(read.cpu(), expected)


def _tensor_lr(rank, device):
    model = nn.Linear(8, 8).to(device)
    lr = torch.tensor(1e-2, device=device)
    found = {}
    for name, make in {
        "plain": lambda: torch.optim.Adam(model.parameters(), lr=lr, foreach=False),
        "fused": lambda: torch.optim.Adam(model.parameters(), lr=lr, fused=True),
    }.items():
        bucketer = ok.GradBucketer(model, optimizer=make())
        model(torch.randn(4, 8, device=device)).sum().backward()
        try:
            bucketer.step()
            found[name] = None
        except ValueError as error:
            found[name] = str(error)
            bucketer._reducer.end_backward()
        bucketer.remove()
    return found


def _all_cuda(rank, world_size):
    device = _enter_gpu(rank)
    out = {"bitwise": {}}
    with _sleep_before_each_update():
        for model_name, opt_name, dtype, clip in itertools.product(
            MODELS, OPTIMIZERS, DTYPES, (None, 0.5)
        ):
            for mode in ("sync", "overlap"):
                key = (model_name, opt_name, dtype, clip, mode)
                out["bitwise"][key] = _run(rank, device, model_name, opt_name, dtype, clip, mode)
        out["pending"] = _no_sync_and_overlap(rank, device)
    out["allocator"] = _lazy_state_is_recorded_on_the_compute_stream(rank, device)
    out["tensor_lr"] = _tensor_lr(rank, device)
    return out


@pytest.fixture(scope="module")
def cuda_results():
    return run_on_ranks(
        _all_cuda, 2, backend="nccl", env=NCCL_ENV, collective_timeout_s=60, total_timeout_s=600
    )


CASES = list(itertools.product(MODELS, OPTIMIZERS, DTYPES, (None, 0.5)))


@requires_cuda
@pytest.mark.parametrize("model_name, opt_name, dtype, clip", CASES)
def test_cuda_params_state_and_evals_equal_synchronous_path(
    cuda_results, model_name, opt_name, dtype, clip
):
    for rank, result in enumerate(cuda_results):
        sync = result["bitwise"][model_name, opt_name, dtype, clip, "sync"]
        overlap = result["bitwise"][model_name, opt_name, dtype, clip, "overlap"]
        for name, value in sync["params"].items():
            assert torch.equal(overlap["params"][name], value), (rank, name)
        for key, state in sync["optim"].items():
            for field, value in state.items():
                assert torch.equal(overlap["optim"][key][field], value), (rank, key, field)
        for step, (a, b) in enumerate(zip(overlap["evals"], sync["evals"], strict=True)):
            assert torch.equal(a, b), (rank, "eval after step", step)


@requires_cuda
def test_cuda_step_makes_no_host_sync_and_returns_with_updates_pending(cuda_results):
    for result in cuda_results:
        assert all(result["pending"].values()), result["pending"]


@requires_cuda
def test_cuda_lazily_created_optimizer_state_is_safe_to_free_after_a_compute_stream_read(
    cuda_results,
):
    assert all(result["allocator"] for result in cuda_results)


@requires_cuda
def test_cuda_tensor_lr_that_torch_reads_on_the_host_is_refused(cuda_results):
    for result in cuda_results:
        assert result["tensor_lr"]["fused"] is None
        assert "neither capturable=True nor fused=True" in result["tensor_lr"]["plain"]
