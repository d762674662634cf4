"""The GPU check's torchrun ranks (``python -m bench.gpu.check --worker | --shared-gpu-worker``).

``worker`` runs at world size 1: the DDP hooks and the bucketer against a plain backward.
``shared_gpu_worker`` is one of two ranks sharing GPU 0 (on CPU, two gloo ranks): a profiled
``ok.ddp`` run, then ``ok.fsdp`` against an unsharded reference. Each writes its results as JSON
into the output folder, where ``bench.gpu.check`` judges them.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.harness.device import share_gpu_zero


def worker(out: Path) -> None:
    """The torchrun rank at world size 1: the DDP hooks and the bucketer; writes a JSON."""
    import overlapkit as ok
    from overlapkit.train.models import MLP, MLPConfig

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = MLP(MLPConfig(width=512, n_layer=4)).to(device)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 512, generator=g).to(device)
    y = torch.randn(64, 512, generator=g).to(device)

    def loss(model: torch.nn.Module) -> torch.Tensor:
        return (model(x) - y).pow(2).mean()

    reference = copy.deepcopy(base)
    loss(reference).backward()
    ref = [p.grad for p in reference.parameters()]
    scale = max(r.abs().max().item() for r in ref)
    device_ids = [local] if cuda else None

    def record(model: torch.nn.Module, owner: Any, step: Callable[[], None]) -> dict:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            step()
        if cuda:
            torch.cuda.synchronize()
        err = max(
            (p.grad - r).abs().max().item() for p, r in zip(model.parameters(), ref, strict=True)
        )
        records = ok.comm_stats(owner).records
        durations = [r.comm_ms for r in records]
        return {
            "max_rel_err": err / scale,
            "records": len(records),
            "complete": sum(d is not None for d in durations),
            "min_comm_ms": min((d for d in durations if d is not None), default=None),
        }

    results: dict[str, Any] = {
        "backend": dist.get_backend(),
        "device": device.type,
        "world_size": dist.get_world_size(),
        "paths": {},
    }
    for name, compress in (("fp32", None), ("bf16", "bf16"), ("fp16", "fp16")):
        model = ok.ddp(copy.deepcopy(base), compress=compress, bucket_mb=1, device_ids=device_ids)
        results["paths"][name] = record(model, model, lambda m=model: loss(m).backward())
    plain = copy.deepcopy(base)
    bucketer = ok.GradBucketer(plain, bucket_mb=1)

    def bucketer_step() -> None:
        loss(plain).backward()
        bucketer.wait()

    results["paths"]["bucketer"] = record(plain, bucketer, bucketer_step)
    (out / f"worker_rank{rank}.json").write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


def _init_shared_gpu() -> torch.device:
    """Join a two-rank group; on CUDA both ranks share GPU 0 as two NCCL "hosts".

    ``NCCL_HOSTID`` differs per rank (``share_gpu_zero``), so NCCL connects the ranks through its
    socket transport over loopback: real NCCL kernels on one GPU.
    """
    cuda = torch.cuda.is_available()
    if cuda:
        share_gpu_zero(int(os.environ["RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    return torch.device("cuda", 0) if cuda else torch.device("cpu")


def shared_gpu_worker(out: Path) -> None:
    """One of two torchrun ranks on one GPU: a profiled ``ok.ddp`` run, then ``ok.fsdp``."""
    import overlapkit as ok
    from overlapkit.train.models import MLP, MLPConfig

    device = _init_shared_gpu()
    rank = dist.get_rank()
    # On the GPU, enough compute per step to hide part of the all-reduce; small for a CPU dry run.
    width, batch = (1024, 512) if device.type == "cuda" else (128, 32)
    torch.manual_seed(0)
    base = MLP(MLPConfig(width=width, n_layer=8)).to(device)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g).to(device)
    y = torch.randn(batch, width, generator=g).to(device)

    profiled = ok.ddp(copy.deepcopy(base), bucket_mb=4)
    with ok.profile(out / "profile_2ranks", wait=1, warmup=1, active=3) as prof:
        for _ in range(5):
            profiled.zero_grad(set_to_none=True)
            (profiled(x) - y).pow(2).mean().backward()
            prof.step()
    results: dict[str, Any] = {
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "profile_files": [str(f) for f in prof.files],
    }

    # ok.fsdp against an unsharded reference fed the concatenation of both ranks' batches.
    xs, ys = [torch.empty_like(x) for _ in range(2)], [torch.empty_like(y) for _ in range(2)]
    dist.all_gather(xs, x)
    dist.all_gather(ys, y)
    reference = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    sharded = ok.fsdp(copy.deepcopy(base), prefetch=1)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.01)
    for _ in range(3):
        (reference(torch.cat(xs)) - torch.cat(ys)).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        (sharded(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    full = {n: p.full_tensor() for n, p in sharded.named_parameters()}
    results["fsdp"] = {
        "max_param_diff": max(
            (full[n] - p).abs().max().item() for n, p in reference.named_parameters()
        ),
        "peak_forward_blocks": max(s.forward_peak_blocks for s in ok.fsdp_stats(sharded).steps),
    }
    (out / f"shared_gpu_rank{rank}.json").write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()
