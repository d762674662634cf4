"""What ``ok.profile`` costs a training loop, and how fast its traces are analysed.

1. Step time, one process (1 thread), an MLP training step: plain loop ("off") interleaved with
   rounds under ``ok.profile``; each step is classified by schedule phase (see
   ``measure_step_overhead`` for the ratios). Targets: recorded steps <= 1.05 of unprofiled
   ones; 1.00 once the cycle is saved (the profiler is stopped then, ``prof.step()`` only
   counts). Also the one-off cost of saving a cycle (export in the last active ``prof.step()``)
   and of the analysis on exit, in ms.

2. Analysis speed: a generated GPU-format trace of ``--trace-mb`` MB (kernels on two compute
   streams and a comm stream, launches, flows, NCCL metadata and mirrors) analysed by
   ``overlapkit report --json`` in a fresh process (wall and CPU time, peak memory) and by
   ``analyze_run`` in this one (target < 10 s for 100 MB).

Example::

    python -m bench.profile_overhead --json bench/results/profile_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import overlapkit as ok
from bench.harness.cpu_priority import prioritize
from bench.harness.json_report import write_json_report
from bench.harness.synthetic_traces import TraceBuilder
from overlapkit.profiling.analysis import analyze_run

PHASES = ("off", "wait", "warmup", "active", "done", "plain")


def _train_step(model, x, optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    optimizer.step()


def _timed_rounds(cfg: dict, logdir: Path, clock) -> dict:
    """Step times in ms on ``clock`` by phase: training alone and training + ``prof.step()``.

    After the cycle is saved, pairs of steps alternate between calling ``prof.step()`` ("done")
    and not calling it ("plain"), so the two are measured under the same conditions.
    """
    torch.manual_seed(0)
    layers = []
    for _ in range(cfg["layers"]):
        layers += [torch.nn.Linear(cfg["width"], cfg["width"]), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(cfg["batch"], cfg["width"])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    train_ms: dict[str, list[float]] = {p: [] for p in PHASES}
    total_ms: dict[str, list[float]] = {p: [] for p in PHASES}
    save_ms, exit_ms = [], []
    for _ in range(3):  # warm up allocator and caches outside any measurement
        _train_step(model, x, optimizer)
    phases = ["wait"] * cfg["wait"] + ["warmup"] + ["active"] * cfg["active"]
    # Consecutive steps alternate in cost (allocation patterns repeat every other step), so
    # each kind takes both parities: done, done, plain, plain, ...
    phases += ["done", "done", "plain", "plain"] * cfg["after"]
    for round_index in range(cfg["rounds"]):
        for _ in range(2):  # untimed: let the previous round's trace export and analysis settle
            _train_step(model, x, optimizer)
        for _ in range(cfg["off"]):
            t0 = clock()
            _train_step(model, x, optimizer)
            elapsed = (clock() - t0) * 1e3
            train_ms["off"].append(elapsed)
            total_ms["off"].append(elapsed)
        profiler = ok.profile(
            logdir / f"{clock.__name__}{round_index}",
            wait=cfg["wait"],
            warmup=1,
            active=cfg["active"],
            rank=0,
        )
        with profiler as prof:
            for i, phase in enumerate(phases):
                t0 = clock()
                _train_step(model, x, optimizer)
                t1 = clock()
                if phase != "plain":
                    prof.step()
                t2 = clock()
                train_ms[phase].append((t1 - t0) * 1e3)
                total_ms[phase].append((t2 - t0) * 1e3)
                if phase == "active" and phases[i + 1] != "active":
                    save_ms.append((t2 - t1) * 1e3)
            t_exit = clock()
        exit_ms.append((clock() - t_exit) * 1e3)
    return {"train": train_ms, "total": total_ms, "save": save_ms, "exit": exit_ms}


def measure_step_overhead(cfg: dict, logdir: Path) -> dict:
    """Median step-time ratios, on the wall clock and on this process's CPU time.

    - ``active_vs_wait``: recorded steps against the steps just before the cycle (same round,
      profiler not yet running); ``active_vs_off`` against the plain loop outside the context.
    - ``done_vs_plain``: after the cycle, steps with ``prof.step()`` against interleaved steps
      without it.
    - ``wait_vs_off``: steps before the cycle (torch's schedule bookkeeping) against the plain loop.

    CPU time is what the profiler adds to the process itself; it is far less disturbed than
    wall time when other work shares the cores.
    """
    torch.set_num_threads(1)

    def med(times: dict[str, list[float]], phase: str) -> float:
        return statistics.median(times[phase])

    out: dict = {}
    for label, clock in (("wall", time.perf_counter), ("cpu", time.process_time)):
        t = _timed_rounds(cfg, logdir, clock)
        train, total = t["train"], t["total"]

        out[label] = {
            "median_ms": {p: round(med(total, p), 3) for p in PHASES},
            "active_vs_wait": round(med(train, "active") / med(train, "wait"), 3),
            "active_vs_off": round(med(train, "active") / med(train, "off"), 3),
            "done_vs_plain": round(med(total, "done") / med(total, "plain"), 3),
            "wait_vs_off": round(med(total, "wait") / med(total, "off"), 3),
            "save_cycle_ms": round(statistics.median(t["save"]), 1),
            "exit_analysis_ms": round(statistics.median(t["exit"]), 1),
        }
        if label == "wall":
            step_call = [a - b for a, b in zip(total["done"], train["done"], strict=True)]
            out["prof_step_call_us_done"] = round(statistics.median(step_call) * 1e3, 2)
    return out


def write_large_trace(path: Path, target_mb: float, seed: int = 0) -> dict:
    """Write a GPU-format trace of about ``target_mb`` MB, one step at a time (low memory)."""
    rng = random.Random(seed)
    builder = TraceBuilder(rank=0, world_size=8)
    target = target_mb * 1e6
    steps = kernels = 0
    with path.open("w", encoding="utf-8") as f:
        f.write(json.dumps(builder.header())[:-1] + ', "traceEvents": [')
        written, first = 0, True
        while written < target:
            start = 1e6 + steps * 20_000.0
            builder.step(steps, start, start + 20_000.0)
            for stream in (7, 8):
                cursor = start + rng.uniform(0, 50)
                for k in range(120):
                    dur = rng.uniform(5, 120)
                    launch = max(start + 1, cursor - 10)
                    builder.cpu_op(f"aten::op_{k % 17}", launch - 2, launch + 3)
                    builder.kernel(
                        f"void kernel_{k % 23}<float>(float*)",
                        cursor,
                        cursor + dur,
                        launch_at=launch,
                        stream=stream,
                    )
                    cursor += dur + rng.uniform(0, 30)
                    kernels += 1
            cursor = start + rng.uniform(0, 500)
            for _ in range(16):
                dur = rng.uniform(50, 800)
                builder.kernel(
                    "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                    cursor,
                    cursor + dur,
                    launch_at=max(start + 1, cursor - 20),
                    stream=20,
                    collective="allreduce",
                    nelems=rng.randrange(1, 1 << 20),
                )
                cursor += dur + rng.uniform(0, 400)
                kernels += 1
            for event in builder.events:
                text = json.dumps(event)
                f.write(text if first else "," + text)
                written += len(text) + 1
                first = False
            builder.events.clear()
            steps += 1
        for event in builder.metadata():
            f.write("," + json.dumps(event))
        f.write('], "traceName": "synthetic"}')
    return {"steps": steps, "kernels": kernels, "mb": round(path.stat().st_size / 1e6, 1)}


def measure_analysis_speed(target_mb: float) -> dict:
    """Generate the trace, then time ``overlapkit report --json`` on it in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="ovk_trace_") as tmp:
        trace = Path(tmp) / "rank0.1.pt.trace.json"
        t0 = time.perf_counter()
        info = write_large_trace(trace, target_mb)
        info["generate_s"] = round(time.perf_counter() - t0, 1)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "overlapkit.cli", "report", tmp, "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
        info["analyse_s"] = round(time.perf_counter() - t0, 2)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        info["analyse_cpu_s"] = round(cpu, 2)
        info["peak_rss_mb"] = round(after.ru_maxrss / 1024, 1)
        info["steps_reported"] = len(json.loads(done.stdout)["steps"])
        t0, c0 = time.perf_counter(), time.process_time()
        analyze_run(tmp)
        info["analyse_in_process_s"] = round(time.perf_counter() - t0, 2)
        info["analyse_in_process_cpu_s"] = round(time.process_time() - c0, 2)
        info["mb_per_s"] = round(info["mb"] / info["analyse_in_process_s"], 1)
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="off/profiled round pairs")
    parser.add_argument("--off", type=int, default=6, help="plain steps per round")
    parser.add_argument("--wait", type=int, default=3, help="wait steps per round")
    parser.add_argument("--active", type=int, default=5, help="active steps per round")
    parser.add_argument(
        "--after", type=int, default=3, help="done,done,plain,plain groups after each cycle"
    )
    parser.add_argument("--trace-mb", type=float, default=100.0, help="0 skips the speed test")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = {
        k: getattr(args, k)
        for k in ("layers", "width", "batch", "rounds", "off", "wait", "active", "after")
    }
    print(f"[cpu priority] {prioritize()}", flush=True)
    load = os.getloadavg()[0]
    print(f"profile_overhead: {cfg}; load average {load:.2f} on {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory(prefix="ovk_overhead_") as tmp:
        overhead = measure_step_overhead(cfg, Path(tmp))
    print(f"\n{'median step-time ratio':<34} {'wall':>7} {'cpu':>7} {'target':>8}")
    rows = (
        ("active_vs_wait", "<= 1.05"),
        ("active_vs_off", "<= 1.05"),
        ("done_vs_plain", "1.00"),
        ("wait_vs_off", "1.00"),
    )
    for key, target in rows:
        print(f"{key:<34} {overhead['wall'][key]:>7.3f} {overhead['cpu'][key]:>7.3f} {target:>8}")
    wall = overhead["wall"]
    print(f"median step ms (wall) by phase: {wall['median_ms']}")
    print(
        f"prof.step() once done: {overhead['prof_step_call_us_done']} us; saving a cycle: "
        f"{wall['save_cycle_ms']} ms; analysis on exit: {wall['exit_analysis_ms']} ms"
    )
    results = {"config": cfg, "load_average": load, "overhead": overhead}
    if args.trace_mb > 0:
        speed = measure_analysis_speed(args.trace_mb)
        print(
            f"\nanalysis of a {speed['mb']} MB trace ({speed['kernels']} kernels, "
            f"{speed['steps']} steps), target < 10 s:\n"
            f"  overlapkit report --json: {speed['analyse_s']} s wall, {speed['analyse_cpu_s']} "
            f"s CPU (process start and imports included), peak memory "
            f"{speed['peak_rss_mb']} MB\n"
            f"  analyze_run in process:   {speed['analyse_in_process_s']} s wall, "
            f"{speed['analyse_in_process_cpu_s']} s CPU ({speed['mb_per_s']} MB/s)"
        )
        results["analysis"] = speed
    write_json_report(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
