"""How much sooner ``overlapkit-train`` runs when its fork server starts first.

The same small 2-rank run (gpt_tiny, ``ok.ddp``, two steps) is launched, rounds interleaved,
through ``python -m overlapkit.train.launch.cli`` (the server starts with the first worker, after
the launcher's own imports) and ``python -m overlapkit.train.launch.entry`` (what the console
script runs: the server starts first and imports beside the launcher). Each time is the whole
process, start to exit.

Example::

    python -m bench.launch_start --rounds 5 --json bench/results/launch_start.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.json_report import write_json_report

ENTRIES = {
    "server_at_first_worker": "overlapkit.train.launch.cli",
    "server_first": "overlapkit.train.launch.entry",
}
RUN = [
    "model.config.n_layer=2",
    "model.config.n_embd=32",
    "model.config.n_head=2",
    "model.config.block_size=32",
    "train.batch_size=4",
    "train.steps=2",
    "train.checkpoint_every=0",
    "train.progress=false",
    "train.device=cpu",
    "launcher.threads_per_rank=1",
]


def _launch_s(module: str, run_dir: Path) -> float:
    """Seconds from starting ``python -m module`` on ``RUN`` to its exit (which must be 0)."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", module, *RUN, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{module} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return elapsed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {name: [] for name in ENTRIES}
    with tempfile.TemporaryDirectory(prefix="ovk-launch-start-") as scratch:
        for round_ in range(args.rounds):
            for name, module in ENTRIES.items():
                seconds = _launch_s(module, Path(scratch) / f"{name}-{round_}")
                times[name].append(seconds)
                print(f"round {round_} {name:<22} {seconds:.2f} s", flush=True)
    late, first = (statistics.median(times[name]) for name in ENTRIES)
    report = {
        "rounds": args.rounds,
        "median_s": {"server_at_first_worker": late, "server_first": first},
        "ratio_first_to_late": first / late,
        "saved_s": late - first,
        "times_s": times,
    }
    print(
        f"a 2-rank run, start to exit: {late:.2f} s with the server started at the first worker, "
        f"{first:.2f} s with it started first (x{first / late:.2f}, {late - first:.2f} s sooner)"
    )
    write_json_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
