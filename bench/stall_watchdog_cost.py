"""What the stall watchdog costs: the Flight Recorder per collective, and each of its polls.

Two gloo ranks time a loop of small all-reduces with torch's Flight Recorder off
(``TORCH_FR_BUFFER_SIZE=0``) and on (``FLIGHT_RECORDER_ENTRIES``, as ``overlapkit-train`` sets it),
rounds interleaved (off, on, off, on, ...; each setting needs fresh processes: torch reads the
variable once). With it on, rank 0 also times what the watchdog's thread does: the per-poll
counter read, and the arrival records it publishes only when a stall is suspected.

Example::

    python -m bench.stall_watchdog_cost --rounds 3 --json bench/results/stall_watchdog_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.harness.json_report import write_json_report
from overlapkit.group.stall_watchdog import (
    FLIGHT_RECORDER_ENTRIES,
    StallWatchdog,
    progress_counters,
)
from overlapkit.workers.local_ranks import run_on_ranks

REPEATS = 5


def _time_collectives(rank: int, world_size: int, cfg: dict) -> dict:
    """Best of ``REPEATS`` timed loops of ``cfg["ops"]`` all-reduces, us per all-reduce; with
    the recorder on, the watchdog's poll and record costs (us) on this rank."""
    tensor = torch.ones(cfg["numel"])
    for _ in range(cfg["ops"] // 5):  # warm-up: connections, allocator
        dist.all_reduce(tensor)
    loops = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(cfg["ops"]):
            dist.all_reduce(tensor)
        loops.append((time.perf_counter() - start) / cfg["ops"] * 1e6)
    result = {"us_per_all_reduce": min(loops)}
    if cfg["recorder"]:
        watchdog = StallWatchdog(60.0, collective_timeout_s=120.0)  # never started
        result["poll_us"] = _best_us(progress_counters, 200)
        result["records_us"] = _best_us(watchdog.state, 20)
    return result


def _best_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ops", type=int, default=1000, help="all-reduces per timed loop")
    parser.add_argument("--numel", type=int, default=256, help="floats per all-reduce")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows: dict[str, list[dict]] = {"off": [], "on": []}
    for round_ in range(args.rounds):
        for setting, size in (("off", 0), ("on", FLIGHT_RECORDER_ENTRIES)):
            cfg = {"ops": args.ops, "numel": args.numel, "recorder": size > 0}
            env = {"TORCH_FR_BUFFER_SIZE": str(size)}
            row = run_on_ranks(_time_collectives, 2, cfg, env=env)[0]
            rows[setting].append(row)
            print(f"round {round_} recorder {setting:>3}: {row['us_per_all_reduce']:.1f} us")
    off = statistics.median(r["us_per_all_reduce"] for r in rows["off"])
    on = statistics.median(r["us_per_all_reduce"] for r in rows["on"])
    report = {
        "numel": args.numel,
        "ops": args.ops,
        "rounds": args.rounds,
        "us_per_all_reduce": {"off": off, "on": on},
        "recorder_us_per_collective": on - off,
        "ratio_on_off": on / off,
        "poll_us": statistics.median(r["poll_us"] for r in rows["on"]),
        "records_us": statistics.median(r["records_us"] for r in rows["on"]),
        "rows": rows,
    }
    print(
        f"all-reduce of {args.numel} floats: {off:.1f} us without the Flight Recorder, {on:.1f} "
        f"us with it (x{on / off:.2f}, +{on - off:.1f} us per collective); the watchdog's poll "
        f"{report['poll_us']:.1f} us, its arrival records {report['records_us']:.0f} us"
    )
    write_json_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
