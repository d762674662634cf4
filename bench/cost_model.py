"""Does the calibrated cost model predict gloo all-reduce here? Predicted vs measured, per size.

For every link (plain loopback, and loopback behind an emulated link, see docs/emulation.md) two
gloo ranks time ``all_reduce`` from --min-bytes to --max-bytes with ``overlapkit calibrate``'s
measurement code. Each size's iterations are split alternately in two halves that ran in the same
time window but share no sample: the even iterations are fitted (latency and bandwidth, written
as a topology YAML like ``overlapkit calibrate`` writes it), the odd iterations are the
measurement the prediction is compared with. Every size is then predicted with ``ok.estimate`` on
the fitted topology. The target is +-20 % for sizes >= --judge-from (1 MiB).

    python -m bench.cost_model --quantile 0.25 --json bench/results/cost_model.json

--fit-min-bytes fits only the sizes from there up, as ``overlapkit calibrate --fit-min-bytes``.
A size's time is a quantile of its iterations (--quantile, the median by default), the same one
for the fitted half and for the measured half, as ``overlapkit calibrate --quantile`` fits it.

Splitting interleaved iterations keeps slow drifts of a shared machine's load out of the
comparison; the load average is printed with the numbers all the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness.cpu_priority import prioritize
from bench.harness.emulated_link import current_link, enter_emulated_link
from overlapkit.cost.calibrate import (
    Measurement,
    TierFit,
    calibrated_yaml,
    fit_ring_all_reduce,
    measure_all_reduce,
    sample_quantile,
    sizes_between,
)
from overlapkit.planner import estimate
from overlapkit.topology import detect_topology, parse_topology_yaml
from overlapkit.topology.units import format_bytes, format_seconds, parse_size
from overlapkit.workers.local_ranks import run_on_ranks

REPO = Path(__file__).resolve().parent.parent
TARGET = 0.20


def _measure(rank: int, world_size: int, sizes: list[int], budget_s: float):
    # Quantiles are taken per half below, so what is returned here is only the raw samples.
    measured = measure_all_reduce(sizes, budget_s=budget_s, progress=rank == 0, min_iterations=10)
    topology = detect_topology()  # collective: every rank takes part
    return (topology, measured) if rank == 0 else None


def _half(measurements: list[Measurement], start: int, quantile: float) -> list[Measurement]:
    """The measurements re-summarised from every other iteration, from ``start``."""
    return [
        dataclasses.replace(
            m,
            time_s=sample_quantile(m.samples[start::2], quantile),
            iterations=len(m.samples[start::2]),
            samples=m.samples[start::2],
        )
        for m in measurements
    ]


def run_link(args: argparse.Namespace) -> dict:
    """Child: one link. Measure, fit the even iterations, predict the odd ones."""
    enter_emulated_link(args.link, args.delay_ms)  # re-executes behind the link, or returns
    sizes = sizes_between(int(parse_size(args.min_bytes)), int(parse_size(args.max_bytes)))
    load_before = os.getloadavg()[0]
    topology, measured = run_on_ranks(
        _measure, args.ranks, sizes, args.budget_s, collective_timeout_s=120, total_timeout_s=1800
    )[0]
    fitted, verify = _half(measured, 0, args.quantile), _half(measured, 1, args.quantile)
    fit_min_bytes = int(parse_size(args.fit_min_bytes))
    fit = TierFit(
        "scale_up",
        topology.nodes()[0],
        *fit_ring_all_reduce(fitted, min_bytes=fit_min_bytes),
        tuple(fitted),
    )
    yaml_text = calibrated_yaml(
        topology, [fit], backend="gloo", quantile=args.quantile, fit_min_bytes=fit_min_bytes
    )
    calibrated = parse_topology_yaml(yaml_text, source="calibrated")
    link = current_link() or {"rate": "none", "delay": "0ms"}
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"calibrated-{link['rate']}.yaml").write_text(yaml_text)
    judge_from = parse_size(args.judge_from)
    cases = []
    for m in verify:
        predicted = estimate("all_reduce", nbytes=m.nbytes, topology=calibrated).time_s
        ratio = predicted / m.time_s
        cases.append(
            {
                "name": f"all_reduce/{link['rate']}/{format_bytes(m.nbytes).replace(' ', '')}",
                "bytes": m.nbytes,
                "median_ms": m.time_s * 1e3,
                "predicted_ms": predicted * 1e3,
                "ratio": ratio,
                "iterations": m.iterations,
                "judged": m.nbytes >= judge_from,
                "within_target": abs(ratio - 1) <= TARGET,
                "overlap_efficiency": None,  # not an overlap benchmark
                "speedup_vs_baseline": None,
            }
        )
    return {
        "link": link,
        "cases": cases,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "fit": {"latency_us": fit.latency_us, "bandwidth_GBps": fit.bandwidth_GBps},
        "quantile": args.quantile,
        "fit_min_bytes": fit_min_bytes,
    }


def _side_by_side(runs: list[dict]) -> str:
    header = f"{'size':>9}"
    for run in runs:
        rate = run["link"]["rate"]
        header += f" | {rate + ' measured':>16} {'predicted':>10} {'ratio':>6}"
    lines = [header, "-" * len(header)]
    for i, case in enumerate(runs[0]["cases"]):
        line = f"{format_bytes(case['bytes']):>9}"
        for run in runs:
            c = run["cases"][i]
            flag = "" if not c["judged"] else (" " if c["within_target"] else "!")
            line += (
                f" | {format_seconds(c['median_ms'] / 1e3):>16} "
                f"{format_seconds(c['predicted_ms'] / 1e3):>10} {c['ratio']:>5.2f}{flag}"
            )
        lines.append(line)
    lines.append("")
    for run in runs:
        judged = [c for c in run["cases"] if c["judged"]]
        inside = sum(c["within_target"] for c in judged)
        worst = max((abs(c["ratio"] - 1) for c in judged), default=0.0)
        lines.append(
            f"link {run['link']['rate']}: {inside}/{len(judged)} judged sizes within "
            f"+-{TARGET:.0%} (worst {worst:.0%}); fit latency {run['fit']['latency_us']:.4g} us "
            f"per step, bandwidth {run['fit']['bandwidth_GBps']:.4g} GB/s; load average "
            f"{run['load_before']:.2f} -> {run['load_after']:.2f}; times are quantile "
            f"{run['quantile']:g} of each size's iterations; fitted sizes >= "
            f"{format_bytes(run['fit_min_bytes'])}"
        )
    lines.append("ratio = predicted / measured; '!' marks a judged size outside the target")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--links", default="none,8gbit", help="comma-separated tc rates; 'none' is plain loopback"
    )
    parser.add_argument("--link", help=argparse.SUPPRESS)  # internal: run one link
    parser.add_argument("--child-json", help=argparse.SUPPRESS)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--min-bytes", default="4KiB")
    parser.add_argument("--max-bytes", default="256MiB")
    parser.add_argument("--judge-from", default="1MiB")
    parser.add_argument("--budget-s", type=float, default=0.5)
    parser.add_argument(
        "--fit-min-bytes", default="0", help="fit only sizes >= this (as calibrate does)"
    )
    parser.add_argument(
        "--quantile", type=float, default=0.5, help="quantile of a size's iterations (0.5: median)"
    )
    parser.add_argument("--results-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument("--json", metavar="PATH", help="write the cases as JSON")
    args = parser.parse_args()
    if args.link is not None:
        Path(args.child_json).write_text(json.dumps(run_link(args)))
        return 0
    print(f"[cpu priority] {prioritize()}", flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="ovk-cost-") as scratch:
        for rate in args.links.split(","):
            out = Path(scratch) / f"{rate}.json"
            forwarded = [
                f"--{k.replace('_', '-')}={v}"
                for k, v in vars(args).items()
                if k
                in (
                    "delay_ms",
                    "ranks",
                    "min_bytes",
                    "max_bytes",
                    "judge_from",
                    "budget_s",
                    "results_dir",
                    "quantile",
                    "fit_min_bytes",
                )
            ]
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.cost_model",
                    f"--link={rate}",
                    f"--child-json={out}",
                    *forwarded,
                ],
                check=True,
                timeout=3600,
            )
            runs.append(json.loads(out.read_text()))
    print(_side_by_side(runs))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "cases": [c for run in runs for c in run["cases"]],
                    "baseline": "measured (odd iterations; even ones were fitted)",
                    "quantile": args.quantile,
                    "links": [run["link"] for run in runs],
                    "fits": {run["link"]["rate"]: run["fit"] for run in runs},
                    "load_average": [[run["load_before"], run["load_after"]] for run in runs],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
