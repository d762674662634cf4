"""The live monitor on real runs: who holds the job back, named live, against a known slow rank.

For each layout (``ddp``, ``fsdp``, ``pp_dp``) on 4 gloo ranks of ``overlapkit-train``:

1. a clean run, profiled on a few steps (``profiler.wait``): false positives (stragglers named
   when none is slowed; target 0), the live monitor's own noise estimate, and the live exposed
   communication against the profiler's (``overlapkit report``'s ``exposed_comm_ms``) on the
   steps both measure, per rank (target: within 15 %);
2. one run per way of slowing rank ``--rank`` from step ``--onset`` on (``bench.harness.slow_rank``,
   from outside the loop): ``sleep`` (a host gap), ``compute``, ``data`` (slow data loading), by
   ``--delay-ms`` (default: ``--multiple`` x the clean run's noise, at least 30 ms): the rank
   named, the cause, the first step of its onset and the step it was named at, its cost per step
   against the delay, and anything else named (false positives).

Then the overhead, side by side: ``--rounds`` rounds of the clean ddp run with the monitor on and
off (``~live``), interleaved, the median step time of each (the summary's ``median_step_ms``),
and the monitor's per-step bookkeeping timed in-process (phases, waits, the ring), in us.

Example::

    python -m bench.live_monitor --json bench/results/live_monitor.json
    python -m bench.live_monitor --steps 80 --onset 40 --layouts ddp --rounds 1   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness.json_report import write_json_report
from bench.harness.slow_rank import SLOW_ENV, WORKER_INIT

RUN = [
    "launcher.nproc_per_node=4",
    "model.config.n_layer=2",
    "model.config.n_embd=32",
    "model.config.n_head=2",
    "model.config.block_size=32",
    "train.batch_size=4",
    "train.grad_accum=2",  # pp_dp's 1F1B keeps two micro-batches in flight
    "train.progress=false",
    "train.resume=false",
    "train.checkpoint_every=0",
    "launcher.threads_per_rank=1",
    "train.device=cpu",
    f"launcher.worker_init=[{WORKER_INIT}]",
]
MODES = {"sleep": "host_gap", "compute": "compute", "data": "data_loading"}
PROFILE = {"wait": 20, "warmup": 1, "active": 5}
"""The clean run's profiled steps: 22-26 (after ``wait`` + ``warmup``)."""


def train(directory: Path, args: list[str], env: dict[str, str] | None = None) -> dict:
    """One ``overlapkit-train`` run; its ``summary.json``."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "overlapkit.train.launch.entry",
            *RUN,
            *args,
            f"hydra.run.dir={directory}",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, **(env or {})},
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"overlapkit-train failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    return json.loads((directory / "summary.json").read_text())


def live_waits(run_dir: Path) -> dict[tuple[int, int], float]:
    """``(rank, step) -> ms`` the rank waited on collectives in the step (``live/wait_ms``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [events] = (run_dir / "tb").iterdir()
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        if tag.startswith("live/wait_ms/rank"):
            rank = int(tag.removeprefix("live/wait_ms/rank"))
            out |= {(rank, e.step): e.value for e in acc.Scalars(tag)}
    return out


def live_vs_profiler(run_dir: Path, profile_dir: Path) -> dict:
    """Per rank, the mean over the profiled steps of the live exposed comm and the profiler's."""
    from overlapkit.profiling.analysis import analyze_run

    steps = analyze_run(profile_dir, jobs=1).steps
    first = PROFILE["wait"] + PROFILE["warmup"] + 1
    order = {s: first + k for k, s in enumerate(sorted({m.step for m in steps}))}
    live = live_waits(run_dir)
    rows = []
    for rank in sorted({m.rank for m in steps}):
        mine = [m for m in steps if m.rank == rank]
        profiled = statistics.mean(m.exposed_comm_ms for m in mine)
        measured = statistics.mean(live[(rank, order[m.step])] for m in mine)
        rows.append(
            {
                "rank": rank,
                "live_ms": measured,
                "profiler_ms": profiled,
                "ratio": measured / profiled,
            }
        )
    total_live = sum(r["live_ms"] for r in rows)
    total_profiler = sum(r["profiler_ms"] for r in rows)
    return {"per_rank": rows, "ratio": total_live / total_profiler, "steps": sorted(order.values())}


def judge(summary: dict, rank: int, onset: int, cause: str, delay_ms: float) -> dict:
    """What the slowed run's live monitor named, against what was injected."""
    named = summary["stragglers"] or []
    # Named because of the delay: the slowed rank, in a window after the delay began (its onset
    # estimate may be a step or two off); anything else named is a false positive.
    hits = [s for s in named if s["rank"] == rank and s["named_at"] >= onset]
    false = [s for s in named if s not in hits]
    first = min(hits, key=lambda s: s["step"]) if hits else None
    return {
        "named_rank": None if first is None else first["rank"],
        "cause": None if first is None else first["cause"],
        "cause_right": first is not None and first["cause"] == cause,
        "collective": None if first is None else first["collective"],
        "onset_step": None if first is None else first["step"],
        "onset_error": None if first is None else first["step"] - onset,
        "named_at": None if first is None else first["named_at"],
        "cost_ms": None if first is None else first["cost_ms"],
        "cost_over_delay": None if first is None else first["cost_ms"] / delay_ms,
        "false_positives": len(false),
        "false": [{k: s[k] for k in ("rank", "step", "cause", "cost_ms")} for s in false],
        "threshold_ms": summary["live"]["threshold_ms"],
    }


def bookkeeping_us(steps: int = 2000) -> float:
    """The monitor's per-step cost in-process: 5 phases, 3 timed waits, the step closed, us."""
    import torch
    import torch.distributed as dist

    from overlapkit.live.steps import PHASES, StepClock
    from overlapkit.live.waits import WaitTimer

    timer = WaitTimer()
    timer.install()
    clock = StepClock(timer, 1024)
    done = torch.futures.Future()
    done.set_result(None)
    try:
        start = time.perf_counter()
        for step in range(steps):
            for name in PHASES:
                with clock.phase(name):
                    if name in ("forward", "backward", "sync"):
                        done.wait()
            clock.close_step(step)
        with_monitor = time.perf_counter() - start
    finally:
        timer.uninstall()
    start = time.perf_counter()
    for _ in range(steps):
        for name in PHASES:
            if name in ("forward", "backward", "sync"):
                done.wait()
    without = time.perf_counter() - start
    del dist
    return (with_monitor - without) / steps * 1e6


def _gathers(rank: int, world_size: int, every: int, repeats: int) -> float:
    import torch
    import torch.distributed as dist

    from overlapkit.live.steps import FIELDS

    mine = torch.zeros((every, len(FIELDS)), dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(world_size)] if rank == 0 else None
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):  # back to back: after the first, the ranks arrive together
        dist.gather(mine, out, dst=0)
    return (time.perf_counter() - start) / repeats * 1e3


def gather_ms(every: int = 10, repeats: int = 200) -> float:
    """One window's gather on 4 gloo ranks arriving together (the monitor's own cost; in a run
    the gather also absorbs the ranks' skew, which they would wait out at the next collective
    anyway), rank 0's ms."""
    from overlapkit.workers.local_ranks import run_on_ranks

    return run_on_ranks(_gathers, 4, every, repeats)[0]


def overhead(tmp: Path, steps: int, rounds: int) -> dict:
    """Median step time of the clean ddp run with the monitor on and off, rounds interleaved."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    for k in range(rounds):
        for label, extra in (("on", []), ("off", ["~live"])):
            summary = train(
                tmp / f"overhead_{label}{k}", ["parallel=ddp", f"train.steps={steps}", *extra]
            )
            times[label].append(summary["median_step_ms"])
            print(
                f"  overhead round {k + 1} live {label}: median step {times[label][-1]:.2f} ms",
                flush=True,
            )
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {"on_ms": times["on"], "off_ms": times["off"], "ratio": on / off}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--onset", type=int, default=40)
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=None)
    parser.add_argument("--multiple", type=float, default=4.0)
    parser.add_argument("--layouts", nargs="+", default=["ddp", "fsdp", "pp_dp"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results: dict = {"load_before": [round(x, 2) for x in os.getloadavg()], "layouts": {}}
    profiled = [f"profiler.{k}={v}" for k, v in PROFILE.items()]
    with tempfile.TemporaryDirectory(prefix="ovk_live_") as tmp_name:
        tmp = Path(tmp_name)
        for layout in args.layouts:
            clean_dir = tmp / f"{layout}_clean"
            clean = train(
                clean_dir,
                [f"parallel={layout}", f"train.steps={args.steps}", "profiler=on", *profiled],
            )
            noise = clean["live"]["noise_ms"]
            delay = args.delay_ms or max(30.0, round(args.multiple * noise / 5) * 5)
            row = {
                "clean": {
                    "false_positives": len(clean["stragglers"] or []),
                    "noise_ms": noise,
                    "median_step_ms": clean["median_step_ms"],
                    "gather_ms_per_step": clean["live"]["gather_ms_per_step"],
                    "exposed": live_vs_profiler(clean_dir, Path(clean["profile_dir"])),
                },
                "delay_ms": delay,
                "slowed": {},
            }
            print(
                f"{layout} clean: {row['clean']['false_positives']} named; noise {noise:.2f} "
                f"ms/step; live/profiler exposed {row['clean']['exposed']['ratio']:.3f}; "
                f"delay {delay:g} ms",
                flush=True,
            )
            for mode in args.modes:
                spec = f"{args.rank}:{delay:g}:{mode}:{args.onset}"
                summary = train(
                    tmp / f"{layout}_{mode}",
                    [f"parallel={layout}", f"train.steps={args.steps}"],
                    {SLOW_ENV: spec},
                )
                verdict = judge(summary, args.rank, args.onset, MODES[mode], delay)
                row["slowed"][mode] = verdict
                print(f"  {layout} {mode}: {verdict}", flush=True)
            results["layouts"][layout] = row
        results["bookkeeping_us_per_step"] = bookkeeping_us()
        results["gather_ms_per_window"] = gather_ms()
        results["overhead"] = overhead(tmp, args.steps, args.rounds)
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(table(results, args))
    write_json_report(args.json, results)
    return 0


def table(results: dict, args: argparse.Namespace) -> str:
    """The results as the docs show them."""
    lines = [
        f"4 gloo ranks, {args.steps} steps, rank {args.rank} slowed from step {args.onset}",
        "| layout | way | named | cause | onset / named at | cost / delay (ms) | false pos. |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout, row in results["layouts"].items():
        lines.append(f"| {layout} | clean | - | - | - | - | {row['clean']['false_positives']} |")
        for mode, v in row["slowed"].items():
            cost = "-" if v["cost_ms"] is None else f"{v['cost_ms']:.1f} / {row['delay_ms']:g}"
            lines.append(
                f"| {layout} | {mode} | {v['named_rank']} | {v['cause']} | {v['onset_step']} / "
                f"{v['named_at']} | {cost} | {v['false_positives']} |"
            )
    lines.append("")
    lines.append(
        "| layout | live exposed / profiler's (profiled steps, all ranks) | noise ms/step "
        "| median step ms | gather ms/step in the run | bookkeeping + own gather / step |"
    )
    lines.append("|---|---|---|---|---|---|")
    book_ms = results["bookkeeping_us_per_step"] / 1e3
    own = results["gather_ms_per_window"] / 10  # the default window
    for layout, row in results["layouts"].items():
        clean = row["clean"]
        cost = (book_ms + own) / clean["median_step_ms"]
        lines.append(
            f"| {layout} | {clean['exposed']['ratio']:.3f} | {clean['noise_ms']:.2f} "
            f"| {clean['median_step_ms']:.1f} | {clean['gather_ms_per_step']:.3f} "
            f"| {100 * cost:.2f} % |"
        )
    over = results["overhead"]
    lines.append(
        f"\noverhead: median step {np.median(over['on_ms']):.2f} ms with the monitor, "
        f"{np.median(over['off_ms']):.2f} ms without (ratio {over['ratio']:.3f}); bookkeeping "
        f"{results['bookkeeping_us_per_step']:.1f} us per step in-process; one window's gather "
        f"{results['gather_ms_per_window']:.3f} ms on 4 ranks arriving together"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
