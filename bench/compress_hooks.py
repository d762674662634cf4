"""ok.ddp's bf16 compression against PyTorch's ``bf16_compress_hook``, side by side (issue 18).

Two ranks run every case interleaved in one run (round-robin, so machine noise hits all cases
alike); each timed step starts after a barrier and is the slower rank's time.

Cases:
    ddp            torch DistributedDataParallel, fp32 all-reduce (the baseline)
    ok_ddp_bf16    ok.ddp(model, compress="bf16")
    torch_bf16     DistributedDataParallel + PyTorch's bf16_compress_hook (on gloo called
                   through a function of another name: DDP registers a hook *named*
                   ``bf16_compress_hook`` only on NCCL; the work done is the same)

``--device cpu`` (default): gloo ranks behind an emulated scale-out link (``--rate``, as
``ddp_overlap.py``). ``--device cuda``: two NCCL ranks on GPU 0, made two "hosts" by their own
``NCCL_HOSTID`` (NCCL's socket transport over loopback, real NCCL kernels); start CUDA MPS first
so that both ranks' kernels run concurrently (docs/emulation.md). Its defaults are the
issue's case: MLP 6 x 4096, batch 4096 per rank, fp32.

Example::

    python -m bench.compress_hooks --json bench/results/compress_hooks.json
    python -m bench.compress_hooks --device cuda --json runs/gpu_check/compress_hooks.json
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at registration
# and needs ``dist.GradBucket`` itself, not its string.

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import overlapkit as ok
from bench.harness.cpu_priority import prioritize
from bench.harness.device import enter_device
from bench.harness.emulated_link import current_link, enter_emulated_link
from bench.harness.json_report import write_json_report
from overlapkit.train.models import MLP, MLPConfig
from overlapkit.workers.local_ranks import run_on_ranks

BASELINE = "ddp"
DEFAULTS = {
    "cpu": {"layers": 4, "width": 1024, "batch": 64},
    "cuda": {"layers": 6, "width": 4096, "batch": 4096},
}


def torch_bf16_compress(process_group: dist.ProcessGroup, bucket: dist.GradBucket):
    """PyTorch's ``bf16_compress_hook`` under a name DDP also registers on gloo."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def _cases(cfg: dict, rank: int) -> dict[str, Callable[[], None]]:
    device = torch.device(cfg["device"], 0)
    enter_device(cfg, rank)
    group = dist.new_group(backend="nccl") if device.type == "cuda" else dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g).to(device)
    y = torch.randn(cfg["batch"], cfg["width"], generator=g).to(device)

    def new_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return MLP(MLPConfig(width=cfg["width"], n_layer=cfg["layers"])).to(device)

    def step_of(model: torch.nn.Module) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            (model(x) - y).pow(2).mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()

        return step

    theirs = DistributedDataParallel(new_model(), process_group=group)
    theirs.register_comm_hook(group, torch_bf16_compress)
    return {
        BASELINE: step_of(DistributedDataParallel(new_model(), process_group=group)),
        "ok_ddp_bf16": step_of(ok.ddp(new_model(), compress="bf16", process_group=group)),
        "torch_bf16": step_of(theirs),
    }


def rank_main(rank: int, world_size: int, cfg: dict) -> dict[str, list[float]]:
    """Per case, this rank's wall ms per timed step."""
    cases = _cases(cfg, rank)
    wall: dict[str, list[float]] = {name: [] for name in cases}
    for round_index in range(cfg["rounds"]):
        for name, step in cases.items():
            for i in range(cfg["steps"]):
                dist.barrier()
                start = time.perf_counter()
                step()
                if round_index > 0 or i >= cfg["warmup"]:
                    wall[name].append((time.perf_counter() - start) * 1e3)
    return wall


def build_report(per_rank: list[dict[str, list[float]]], cfg: dict) -> dict:
    """Benchmark JSON (docs/json-contracts.md keys): median of the slower rank per step, ratios."""
    median = {
        name: statistics.median(map(max, zip(*(r[name] for r in per_rank), strict=True)))
        for name in per_rank[0]
    }
    return {
        "cases": [
            {
                "name": name,
                "median_ms": round(t, 2),
                "overlap_efficiency": None,  # no compute-only / comm-only cases here
                "speedup_vs_baseline": round(median[BASELINE] / t, 3),
                "vs_torch_bf16": round(t / median["torch_bf16"], 3),
            }
            for name, t in median.items()
        ],
        "baseline": BASELINE,
        "link": current_link() or {"rate": "none (loopback)", "delay": "0ms"},
        "config": cfg,
    }


def print_table(report: dict) -> None:
    cfg = report["config"]
    print(
        f"\n{cfg['device']}: 2 ranks, MLP {cfg['layers']} x {cfg['width']}, batch {cfg['batch']} "
        f"per rank; link {report['link']['rate']}"
    )
    print(f"{'case':<14} {'median ms':>10} {'vs ' + BASELINE:>9} {'time / torch_bf16':>18}")
    for case in report["cases"]:
        print(
            f"{case['name']:<14} {case['median_ms']:>10.1f} "
            f"{case['speedup_vs_baseline']:>8.2f}x {case['vs_torch_bf16']:>18.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=sorted(DEFAULTS), default="cpu")
    parser.add_argument("--rate", default="8gbit", help="cpu: tc rate of the link, or 'none'")
    parser.add_argument("--layers", type=int, help="MLP blocks (default per device)")
    parser.add_argument("--width", type=int, help="MLP width (default per device)")
    parser.add_argument("--batch", type=int, help="rows per rank (default per device)")
    parser.add_argument("--steps", type=int, default=5, help="steps per case per round")
    parser.add_argument("--rounds", type=int, default=5, help="round-robin passes over the cases")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps in the first round")
    parser.add_argument("--json", type=Path, help="write the report here as JSON")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    if args.device == "cpu":
        if current_link() is None:
            print(f"[cpu priority] {prioritize()}", flush=True)
        enter_emulated_link(args.rate)
    defaults = DEFAULTS[args.device]
    cfg = {
        "device": args.device,
        "layers": args.layers or defaults["layers"],
        "width": args.width or defaults["width"],
        "batch": args.batch or defaults["batch"],
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup": args.warmup,
    }
    print(f"compress_hooks: {cfg}", flush=True)
    per_rank = run_on_ranks(rank_main, 2, cfg, collective_timeout_s=300, total_timeout_s=3600)
    report = build_report(per_rank, cfg)
    print_table(report)
    write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
