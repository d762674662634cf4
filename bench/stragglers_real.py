"""A real slow rank: ``overlapkit report --stragglers`` and HTA on the same 4-rank gloo traces.

1. ``overlapkit-train recipe=demo`` (with the small model of ``tests/test_train_e2e.py``) on 4
   gloo ranks, profiled, nothing slowed: the step jitter, measured as the median over the
   profiled steps of the spread (max - min) of the ranks' step times.
2. The same run with ``OVERLAPKIT_TEST_SLOW=RANK:MS`` (``bench.harness.slow_rank``: the rank
   sleeps MS in the forward of every step), MS = ``--multiple`` x the jitter (at least 50 ms).
3. ``overlapkit report --stragglers`` on its traces (the text, as a user sees it), and HTA's
   ``TraceAnalysis(...).get_potential_stragglers()`` on the same directory: its answer or its
   failure.

Example::

    python -m bench.stragglers_real --json bench/results/stragglers_real.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness.json_report import write_json_report
from bench.harness.slow_rank import SLOW_ENV, WORKER_INIT
from bench.trace_scale import run_hta

RUN = [
    "recipe=demo",
    "launcher.nproc_per_node=4",
    "model.config.n_layer=2",
    "model.config.n_embd=32",
    "model.config.n_head=2",
    "model.config.block_size=32",
    "train.batch_size=4",
    "train.progress=false",
    "train.resume=false",
    f"launcher.worker_init=[{WORKER_INIT}]",
]


def train(directory: Path, steps: int, env: dict[str, str]) -> Path:
    """One ``overlapkit-train`` run; its profile directory."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "overlapkit.train.launch.entry",
            *RUN,
            f"train.steps={steps}",
            f"hydra.run.dir={directory}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **env},
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"overlapkit-train failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    [profile] = (directory / "tb").glob("*/profile")
    return profile


def step_jitter_ms(profile: Path) -> float:
    """Median over the profiled steps of the spread (max - min) of the ranks' step times, ms."""
    from overlapkit.profiling.analysis import analyze_run

    table = analyze_run(profile, jobs=1).table
    return float(
        np.median([np.ptp(table["step_ms"][table["step"] == s]) for s in set(table["step"])])
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--multiple", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hta-timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results: dict = {"load_before": [round(x, 2) for x in os.getloadavg()]}
    with tempfile.TemporaryDirectory(prefix="ovk_slow_") as tmp:
        clean = train(Path(tmp) / "clean", args.steps, {})
        jitter = step_jitter_ms(clean)
        slow_ms = max(50.0, round(args.multiple * jitter / 10) * 10)
        print(
            f"clean run: step jitter {jitter:.1f} ms (median over steps of the spread of the 4 "
            f"ranks' step times); slowing rank {args.rank} by {slow_ms:.0f} ms = "
            f"{slow_ms / jitter:.1f} x the jitter",
            flush=True,
        )
        spec = f"{args.rank}:{slow_ms:g}"
        slowed = train(Path(tmp) / "slowed", args.steps, {SLOW_ENV: spec})
        start = time.perf_counter()
        report = subprocess.run(
            [
                sys.executable,
                "-m",
                "overlapkit.cli",
                "report",
                str(slowed),
                "--stragglers",
                "--step-rows",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        took = time.perf_counter() - start
        print(
            f"\n$ {SLOW_ENV}={spec} overlapkit-train {' '.join(RUN)} "
            f"train.steps={args.steps}\n$ overlapkit report <profile> --stragglers --step-rows 0 "
            f"({took:.1f} s)\n{report.stdout}{report.stderr[-1000:]}",
            flush=True,
        )
        hta = run_hta(slowed, args.hta_timeout)
        print(
            f"HTA get_potential_stragglers on the same traces: {hta['status']} in "
            f"{hta['wall_s']} s, {hta['peak_rss_mb']} MB; {hta['result']}",
            flush=True,
        )
        results |= {
            "jitter_ms": jitter,
            "slow_ms": slow_ms,
            "slow_rank": args.rank,
            "report": report.stdout,
            "hta": hta,
        }
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    write_json_report(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
