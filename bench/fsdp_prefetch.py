"""FSDP all-gather prefetch on gloo: FSDP2's default vs ok.fsdp(prefetch=1|2), side by side.

Two gloo ranks run every case interleaved in one process group (round-robin, so machine noise hits
all cases alike), behind an emulated scale-out link by default (``--rate 8gbit``; ``--rate none``
for plain loopback). Each timed step (forward, backward, SGD step) starts after a barrier; a
step's time is the slower rank's; the table shows medians.

Cases:
    compute_only          the unsharded model, no communication
    fsdp2_default         fully_shard on each block, then the root; nothing else (the baseline)
    fsdp2_prefetch1       the same plus FSDP2's explicit prefetch (set_modules_to_forward_prefetch
                          and its backward twin, depth 1): what the issue measured
    ok_prefetch1_ag_only  ok.fsdp(prefetch=1, overlap_reduce_scatter=False): asynchronous
                          all-gathers, FSDP2's own (blocking) reduce-scatter
    ok_prefetch1          ok.fsdp(prefetch=1): also overlapkit's reduce-scatter (all-to-all based,
                          running during the previous block's backward)
    ok_prefetch2          ok.fsdp(prefetch=2)

With an AdamW step instead of SGD, timed as ``--steps`` back-to-back steps per round (no barrier
between them: the next step's all-gathers start inside the optimizer step):
    adamw                 ok.fsdp(prefetch=1), optimizer.step()
    adamw_overlap_step    the same plus overlap_optimizer_step (gathers issued after the step)
    adamw_by_block        step_by_block(model, optimizer): the root's and block 0's gathers
                          issued right after their own update, while the other blocks update

and with global-norm clipping (max norm 1.0; the ``speedup_vs_adamw_clip`` column compares them):
    adamw_clip            clip_grad_norm_(model.parameters(), 1.0), then optimizer.step()
    adamw_clip_by_block   clip_grad_norm_, then step_by_block (parallel=fsdp_overlap before the
                          clip was folded in)
    adamw_by_block_clip   step_by_block(model, optimizer, clip_grad_norm=1.0): the norm first,
                          then each block clipped right before its update

The two ``fsdp2_*`` cases are built with ``ok.fsdp(prefetch=0)`` (which is exactly ``fully_shard``
per block, then the root) so that ``ok.fsdp_stats`` can count their unsharded blocks; its
all-gather comm passes FSDP2's ``async_op`` through unchanged.

Overlap efficiency is ``(T_default - T) / (T_default - T_bound)`` with
``T_bound = max(T_compute, T_comm)`` and ``T_comm = T_default - T_compute``: FSDP's all-gathers
can overlap forward too, so no forward term is added as in ``ddp_overlap.py``.

The report also times, for one block's gradient (``width * (width + 1)`` floats), gloo's
``reduce_scatter_single`` (which gloo runs as an all-reduce), the ``all_to_all_single`` that
overlapkit's reduce-scatter uses instead, and ``all_gather_single``.

``--profile`` also runs one profiled step per FSDP case and prints, per step, the milliseconds
spent inside FSDP2's ``FSDP::forward_prefetch`` / ``FSDP::backward_prefetch`` (issuing
prefetches) and ``FSDP::all_gather_copy_out`` (waiting for a gather, then copying it out): with
FSDP2 on gloo the prefetch call itself lasts as long as the collective.

Example::

    python -m bench.fsdp_prefetch --json bench/results/fsdp_prefetch.json           # 8 Gbit/s
    python -m bench.fsdp_prefetch --rate none --json bench/results/fsdp_prefetch_loopback.json
    python -m bench.fsdp_prefetch --device cuda --rate none   # 2 NCCL ranks on GPU 0 (under MPS)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import overlapkit as ok
from bench.harness.cpu_priority import prioritize
from bench.harness.device import backend_for, enter_device, settle
from bench.harness.emulated_link import current_link, enter_emulated_link
from bench.harness.json_report import write_json_report
from bench.harness.workloads import make_mlp
from overlapkit.fsdp.prefetch import overlap_optimizer_step, set_explicit_prefetch, step_by_block
from overlapkit.group.process_group import all_gather_single, reduce_scatter_single
from overlapkit.workers.local_ranks import run_on_ranks

BASELINE = "fsdp2_default"
CASES = (
    "compute_only",
    "fsdp2_default",
    "fsdp2_prefetch1",
    "ok_prefetch1_ag_only",
    "ok_prefetch1",
    "ok_prefetch2",
    "adamw",
    "adamw_overlap_step",
    "adamw_by_block",
    "adamw_clip",
    "adamw_clip_by_block",
    "adamw_by_block_clip",
)
CLIP_CASES = ("adamw_clip", "adamw_clip_by_block", "adamw_by_block_clip")
OPTIMIZER_CASES = ("adamw", "adamw_overlap_step", "adamw_by_block", *CLIP_CASES)
MAX_NORM = 1.0
PROFILED_RANGES = ("FSDP::forward_prefetch", "FSDP::backward_prefetch", "FSDP::all_gather_copy_out")
TARGET_RATIO = 0.8


def _build_model(name: str, cfg: dict) -> nn.Module:
    model = make_mlp(cfg["blocks"], cfg["width"]).to(cfg.get("device", "cpu"))
    match name:
        case "compute_only":
            return model
        case "fsdp2_default":
            return ok.fsdp(model, prefetch=0)
        case "fsdp2_prefetch1":
            model = ok.fsdp(model, prefetch=0)
            set_explicit_prefetch(model, list(model), 1)
            return model
        case "ok_prefetch1_ag_only":
            return ok.fsdp(model, prefetch=1, overlap_reduce_scatter=False)
        case name if name in OPTIMIZER_CASES:
            return ok.fsdp(model, prefetch=1)
        case _:
            return ok.fsdp(model, prefetch=int(name.removeprefix("ok_prefetch")))


def _stepper(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    if name not in OPTIMIZER_CASES:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name == "adamw_overlap_step":
        overlap_optimizer_step(model, optimizer)

    def step() -> None:
        (model(x) - y).pow(2).mean().backward()
        if name in ("adamw_clip", "adamw_clip_by_block"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if name in ("adamw_by_block", "adamw_clip_by_block"):
            step_by_block(model, optimizer)
        elif name == "adamw_by_block_clip":
            step_by_block(model, optimizer, clip_grad_norm=MAX_NORM)
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _profile_ranges(step: Callable[[], None]) -> dict[str, float]:
    """Milliseconds inside each of ``PROFILED_RANGES`` during one step (CPU time ranges)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    totals = dict.fromkeys(PROFILED_RANGES, 0.0)
    for event in prof.events():
        for prefix in PROFILED_RANGES:
            if event.name.startswith(prefix):
                totals[prefix] += event.cpu_time_total / 1e3
    return {name: round(ms, 2) for name, ms in totals.items()}


def _collective_ms(cfg: dict, numel: int, world_size: int, repeats: int = 12) -> dict[str, float]:
    """Median ms of the collectives FSDP uses for one block, after 2 untimed calls."""
    numel -= numel % world_size
    device = cfg.get("device", "cpu")
    full, shard = torch.randn(numel, device=device), torch.empty(numel // world_size, device=device)
    received = torch.empty(numel, device=device)
    calls = {
        "reduce_scatter_single": lambda: reduce_scatter_single(shard, full, op=dist.ReduceOp.AVG),
        "all_to_all_single": lambda: dist.all_to_all_single(received, full),
        "all_gather_single": lambda: all_gather_single(full, shard, group=None),
    }
    medians = {}
    for name, call in calls.items():
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            call()
            settle(cfg)
            times.append((time.perf_counter() - start) * 1e3)
        medians[name] = round(statistics.median(times[2:]), 2)
    return medians


def _block_ms(step: Callable[[], None], cfg: dict, *, first_round: bool) -> float:
    """Mean ms of ``cfg["steps"]`` back-to-back steps (after ``warmup`` untimed ones)."""
    if first_round:
        for _ in range(cfg["warmup"]):
            step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(cfg["steps"]):
        step()
    settle(cfg)
    return (time.perf_counter() - start) * 1e3 / cfg["steps"]


def _rank_main(rank: int, world_size: int, cfg: dict) -> dict:
    enter_device(cfg, rank)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g).to(cfg.get("device", "cpu"))
    y = torch.randn(cfg["batch"], cfg["width"], generator=g).to(cfg.get("device", "cpu"))
    models = {name: _build_model(name, cfg) for name in cfg["cases"]}
    steps = {name: _stepper(name, model, x, y) for name, model in models.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_index in range(cfg["rounds"]):
        for name, step in steps.items():
            if name in OPTIMIZER_CASES:
                times[name].append(_block_ms(step, cfg, first_round=round_index == 0))
                continue
            for i in range(cfg["steps"]):
                dist.barrier()
                start = time.perf_counter()
                step()
                settle(cfg)
                elapsed_ms = (time.perf_counter() - start) * 1e3
                if round_index > 0 or i >= cfg["warmup"]:
                    times[name].append(elapsed_ms)
        if rank == 0:
            print(f"  round {round_index + 1}/{cfg['rounds']} done", flush=True)
    memory = {}
    for name, model in models.items():
        if name == "compute_only":
            continue
        stats = ok.fsdp_stats(model)
        # fsdp2_prefetch1 adds FSDP2's prefetch behind ok.fsdp(prefetch=0)'s back: no bound.
        declared = name != "fsdp2_prefetch1"
        memory[name] = {
            "peak_unsharded_blocks": stats.peak_blocks,
            "peak_unsharded_bytes": stats.peak_bytes,
            "forward_peak_unsharded_blocks": max(s.forward_peak_blocks for s in stats.steps),
            "forward_bound_blocks": stats.forward_bound_blocks if declared else None,
            "within_bound": stats.within_bound() if declared else None,
        }
    profiled = {}
    if cfg["profile"]:
        for name, step in steps.items():
            if name != "compute_only":
                dist.barrier()
                profiled[name] = _profile_ranges(step)
    collectives = _collective_ms(cfg, cfg["width"] * (cfg["width"] + 1), world_size)
    return {"times": times, "memory": memory, "profile": profiled, "collectives": collectives}


def summarize(per_rank: list[dict]) -> dict[str, float]:
    """Median over steps of the slowest rank's time, per case, in ms."""
    medians = {}
    for name in per_rank[0]["times"]:
        slowest = [max(step) for step in zip(*(r["times"][name] for r in per_rank), strict=True)]
        medians[name] = statistics.median(slowest)
    return medians


def build_report(medians: dict[str, float], per_rank: list[dict], cfg: dict) -> dict:
    t_compute, t_default = medians["compute_only"], medians[BASELINE]
    t_bound = max(t_compute, t_default - t_compute)
    cases = []
    for name, t in medians.items():
        # The AdamW cases differ from the baseline's SGD step: compare them with "adamw" only.
        overlapping = name not in ("compute_only", BASELINE, *OPTIMIZER_CASES)
        efficiency = (t_default - t) / (t_default - t_bound) if overlapping else None
        case = {
            "name": name,
            "median_ms": round(t, 2),
            "overlap_efficiency": None if efficiency is None else round(efficiency, 3),
            "speedup_vs_baseline": round(t_default / t, 3),
            "ratio_vs_baseline": round(t / t_default, 3),
            **per_rank[0]["memory"].get(name, {}),
        }
        if name in OPTIMIZER_CASES and "adamw" in medians:
            case["speedup_vs_adamw"] = round(medians["adamw"] / t, 3)
        if name in CLIP_CASES and "adamw_clip" in medians:
            case["speedup_vs_adamw_clip"] = round(medians["adamw_clip"] / t, 3)
        cases.append(case)
    ok_times = [medians[n] for n in ("ok_prefetch1", "ok_prefetch2") if n in medians]
    best = min(ok_times) / t_default if ok_times else None
    return {
        "cases": cases,
        "baseline": BASELINE,
        "link": current_link() or {"rate": "none (loopback)", "delay": "0ms"},
        "t_bound_ms": round(t_bound, 2),
        "target": {
            "max_ratio_vs_baseline": TARGET_RATIO,
            "best_ok_ratio": None if best is None else round(best, 3),
            "met": None if best is None else best <= TARGET_RATIO,
        },
        "profile_ms_per_step": {f"rank{r}": d["profile"] for r, d in enumerate(per_rank)},
        "block_collectives_ms": per_rank[0]["collectives"],
        "load_average": os.getloadavg(),
        "config": cfg,
    }


def print_table(report: dict) -> None:
    link, cfg = report["link"], report["config"]
    print(
        f"\nlink: {link['rate']} delay {link['delay']}; T_bound {report['t_bound_ms']} ms; "
        f"model MLP {cfg['blocks']}x{cfg['width']}, batch {cfg['batch']} per rank; "
        f"load average {report['load_average'][0]:.2f}"
    )
    print(
        f"{'case':<22} {'median ms':>10} {'vs ' + BASELINE:>18} {'overlap eff':>12} "
        f"{'peak blocks':>12} {'peak MiB':>9}"
    )
    for case in report["cases"]:
        eff = case["overlap_efficiency"]
        peak = case.get("peak_unsharded_blocks")
        peak_mib = case.get("peak_unsharded_bytes", 0) / 2**20
        print(
            f"{case['name']:<22} {case['median_ms']:>10.1f} {case['ratio_vs_baseline']:>17.2f}x "
            f"{'-' if eff is None else f'{eff:.2f}':>12} {'-' if peak is None else peak:>12} "
            f"{'-' if peak is None else f'{peak_mib:.1f}':>9}"
        )
    with_adamw = [c for c in report["cases"] if "speedup_vs_adamw" in c]
    for case in with_adamw:
        print(f"  {case['name']:<20} {case['speedup_vs_adamw']:.2f}x adamw (blocks of steps)")
    for case in (c for c in report["cases"] if "speedup_vs_adamw_clip" in c):
        print(f"  {case['name']:<20} {case['speedup_vs_adamw_clip']:.2f}x adamw_clip")
    target = report["target"]
    if target["met"] is not None:
        print(
            f"target ok.fsdp <= {target['max_ratio_vs_baseline']}x {BASELINE}: best "
            f"{target['best_ok_ratio']}x -> {'met' if target['met'] else 'NOT met'}"
        )
    print(f"one block's gloo collectives (rank 0, median ms): {report['block_collectives_ms']}")
    for rank, ranges in report["profile_ms_per_step"].items():
        for name, ms in ranges.items():
            print(f"  profile {rank} {name:<22} " + "  ".join(f"{k} {v} ms" for k, v in ms.items()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="8gbit", help="tc rate of the emulated link, or 'none'")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (needs netem)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="rows per rank")
    parser.add_argument("--steps", type=int, default=5, help="steps per case per round")
    parser.add_argument("--rounds", type=int, default=5, help="round-robin passes over the cases")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps in the first round")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    parser.add_argument("--profile", action="store_true", help="profile one step per case")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: two NCCL ranks on GPU 0 (start CUDA MPS first; bench/gpu/overlap.sh does)",
    )
    parser.add_argument("--json", type=Path, help="write the report here as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or not {"compute_only", BASELINE} <= set(cases):
        raise SystemExit(
            f"--cases {args.cases!r}: unknown {unknown}; must include compute_only "
            f"and {BASELINE}; valid: {list(CASES)}"
        )
    if current_link() is None:
        print(f"[cpu priority] {prioritize()}", flush=True)
    enter_emulated_link(args.rate, args.delay_ms)
    cfg = {
        "blocks": args.blocks,
        "width": args.width,
        "batch": args.batch,
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "cases": cases,
        "profile": args.profile,
        "device": args.device,
    }
    print(f"fsdp_prefetch: 2 {backend_for(cfg)} ranks, {cfg}", flush=True)
    per_rank = run_on_ranks(
        _rank_main,
        2,
        cfg,
        collective_timeout_s=120,
        total_timeout_s=3600,
        threads_per_rank=1,
        backend=backend_for(cfg),
    )
    report = build_report(summarize(per_rank), per_rank, cfg)
    print_table(report)
    write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
