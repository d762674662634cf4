"""Exposed communication as ``ok.profile`` measures it: the no-overlap loop vs ``ok.ddp``.

Two gloo ranks train the same MLP twice, each run under ``ok.profile`` into its own logdir:

    no_overlap   backward, then one flat all-reduce of all gradients (nothing can hide it)
    ok_ddp       ok.ddp(model): bucketed all-reduces issued during backward

Behind an emulated scale-out link (``--rate 8gbit``, the default) communication costs wire time
and the ranks' cores are free to compute meanwhile, so ``ok_ddp`` should leave a clearly smaller
share of its communication exposed. The numbers come from ``overlapkit report`` on each logdir.

Example::

    python -m bench.profile_exposed --out runs/profile_exposed
    overlapkit report runs/profile_exposed/ok_ddp --png ddp.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import overlapkit as ok
from bench.harness.cpu_priority import prioritize
from bench.harness.emulated_link import current_link, enter_emulated_link
from bench.harness.exposed_comm import exposed_share
from bench.harness.json_report import write_json_report
from bench.harness.workloads import make_mlp
from overlapkit.workers.local_ranks import run_on_ranks

CASES = ("no_overlap", "ok_ddp")


DDP_TIMES = ("backward_comm_time", "backward_compute_comm_overlap_time", "backward_compute_time")
"""DDP's own timings of one iteration (ns), as its logging data holds them for the latest one."""


def profiled_training(rank: int, world_size: int, case: str, logdir: str, cfg: dict) -> dict:
    """Run ``cfg["steps"]`` profiled steps of ``case`` on this rank; return DDP's own timings.

    DDP records an iteration's timings at the next forward, so one more step runs after the
    profiled ones (untraced: the schedule has ended) and ``per_step`` holds DDP's timings of
    every step by index, the profiled ones included; the ``avg_*`` keys are DDP's averages over
    the iterations it sampled (every one but the last, the slow first step included).
    """
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g)
    y = torch.randn(cfg["batch"], cfg["width"], generator=g)
    model = make_mlp(cfg["layers"], cfg["width"])
    if case == "ok_ddp":
        model = ok.ddp(model, bucket_mb=cfg["bucket_mb"])
    elif case != "no_overlap":
        raise ValueError(f"unknown case {case!r}; choose one of {CASES}")
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    optimizer = torch.optim.SGD(params, lr=1e-3)
    per_step: dict[int, dict[str, int]] = {}
    with ok.profile(logdir, wait=1, warmup=1, active=cfg["steps"], record_shapes=True) as prof:
        for _ in range(3 + cfg["steps"]):
            optimizer.zero_grad(set_to_none=True)
            out = model(x)
            if case == "ok_ddp":
                # DDP's private logging: its forward has just recorded the previous iteration
                # ("iteration" counts from 1).
                logged = model._get_ddp_logging_data()
                if DDP_TIMES[0] in logged:
                    per_step[logged["iteration"] - 1] = {k: logged[k] for k in DDP_TIMES}
            (out - y).pow(2).mean().backward()
            if case == "no_overlap":
                torch.cat([p.grad.view(-1) for p in params], out=flat)
                dist.all_reduce(flat)
                flat.div_(world_size)
                offset = 0
                for p in params:
                    p.grad.view(-1).copy_(flat[offset : offset + p.numel()])
                    offset += p.numel()
            optimizer.step()
            prof.step()
    if case != "ok_ddp":
        return {}
    logging_data = model._get_ddp_logging_data()
    averages = {f"avg_{k}": logging_data[f"avg_{k}"] for k in DDP_TIMES}
    return {**averages, "iteration": logging_data["iteration"], "per_step": per_step}


def _all_cases(rank: int, world_size: int, root: str, cfg: dict) -> dict[str, dict]:
    return {
        case: profiled_training(rank, world_size, case, str(Path(root) / case), cfg)
        for case in CASES
    }


def run_cases(root: Path, cfg: dict) -> dict[str, list[dict]]:
    """Profile every case on 2 gloo ranks into ``root/<case>``; DDP logging data per rank."""
    per_rank = run_on_ranks(
        _all_cases, 2, str(root), cfg, collective_timeout_s=60, total_timeout_s=600
    )
    return {case: [r[case] for r in per_rank] for case in CASES}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="8gbit", help="tc rate of the emulated link, or 'none'")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="rows per rank")
    parser.add_argument("--steps", type=int, default=4, help="profiled (active) steps")
    parser.add_argument("--bucket-mb", type=float, default=4.0, help="ok.ddp bucket size, MiB")
    parser.add_argument("--out", type=Path, default=Path("runs/profile_exposed"))
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if current_link() is None:
        print(f"[cpu priority] {prioritize()}", flush=True)
    enter_emulated_link(args.rate)
    cfg = {
        "layers": args.layers,
        "width": args.width,
        "batch": args.batch,
        "steps": args.steps,
        "bucket_mb": args.bucket_mb,
    }
    link = current_link() or {"rate": "none (loopback)", "delay": "0ms"}
    print(f"profile_exposed: 2 gloo ranks, link {link['rate']}, {cfg}", flush=True)
    for case in CASES:
        if any((args.out / case).glob("*.pt.trace.json*")):
            raise SystemExit(f"{args.out / case} already holds traces; pass a fresh --out")
    ddp_logging = run_cases(args.out, cfg)
    results = {
        case: {
            **exposed_share(args.out / case),
            "logdir": str(args.out / case),
            "ddp_logging": ddp_logging[case],
        }
        for case in CASES
    }
    print(f"\n{'case':<12} {'step ms':>8} {'comm ms':>8} {'exposed ms':>11} {'exposed share':>14}")
    for case, r in results.items():
        print(
            f"{case:<12} {r['median_ms']:>8.1f} {r['comm_ms_per_step']:>8.1f} "
            f"{r['exposed_comm_ms_per_step']:>11.1f} {r['exposed_share']:>14.0%}"
        )
    print(f"\nper step detail: overlapkit report {args.out / 'ok_ddp'}")
    write_json_report(args.json, {"link": link, "config": cfg, "cases": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
