"""Scaling efficiency at 1..N local ranks, with and without overlapkit's overlap paths.

For every rank count ``n`` in 1, 2, 4, ... N (N included) the cases of ``bench.ddp_overlap`` run on
``n`` gloo ranks (``bench.harness.ddp_cases.rank_main``: interleaved rounds, a barrier before each
step, a step's time is the slowest rank's), each rank with the same per-rank batch (weak scaling).
Throughput is the job's: ``n x items per rank / median step``; items are tokens for gpt_tiny and
samples for the MLP. Scaling efficiency is ``T(n) / (n x T(1))`` of each case against its own 1-rank
throughput (``overlapkit.doctor.scaling.scaling_efficiency``, also doctor check 8); the JSON adds
``efficiency_vs_compute_only``, against the 1-rank ``compute_only`` throughput, one yardstick for
all cases (the 1-rank runs of the cases differ only by noise and hook overhead).

Cases shown: ``compute_only`` (no communication: what the cores give), ``no_overlap``
(backward, then one flat all-reduce), ``ddp_default`` (torch DDP, the baseline), ``ok_ddp`` and
``bucketer`` (overlapkit's default buckets), ``ok_ddp_bf16``.

The ranks share the machine's cores, so on a 2-core box even ``compute_only`` cannot scale past
the cores; the efficiency of the communicating cases is read against it.

Example::

    python -m bench.scaling --model gpt_tiny --json bench/results/scaling.json
    python -m bench.scaling --max-ranks 4 --rate none --png bench/results/scaling.png
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench.harness.cpu_priority import prioritize
from bench.harness.ddp_cases import BASELINE, rank_main, summarize, workload_config
from bench.harness.emulated_link import current_link, enter_emulated_link
from bench.harness.json_report import write_json_report
from bench.harness.workloads import workload_of
from overlapkit.doctor.scaling import rank_counts, scaling_efficiency
from overlapkit.train.models.workload import DEFAULT_SIZES
from overlapkit.workers.local_ranks import run_on_ranks

SHOWN = ("compute_only", "no_overlap", BASELINE, "ok_ddp", "bucketer", "ok_ddp_bf16")
RESULTS = Path(__file__).resolve().parent / "results"


def build_report(medians: dict[int, dict[str, float]], cfg: dict) -> dict:
    """The benchmark JSON from per rank count, per case median step times (ms).

    ``cases`` follows the benchmark keys of docs/json-contracts.md with one entry per (case, rank
    count), named ``case@n``; ``scaling`` holds per case and rank count the throughput and
    efficiency.
    """
    if 1 not in medians:
        raise ValueError(f"scaling needs the 1-rank run; got rank counts {sorted(medians)}")
    items = workload_of(cfg, 0).items  # tokens (gpt_tiny) or samples (mlp) per rank
    unit = "tokens" if cfg["model"] == "gpt_tiny" else "samples"
    scaling: dict[str, dict[str, dict[str, float]]] = {}
    ideal_one = items / (medians[1]["compute_only"] / 1e3)
    cases = []
    for name in SHOWN:
        one = items / (medians[1][name] / 1e3)
        scaling[name] = {}
        for n, wall in sorted(medians.items()):
            throughput = n * items / (wall[name] / 1e3)
            efficiency = scaling_efficiency(one, throughput, n)
            scaling[name][str(n)] = {
                "median_ms": round(wall[name], 3),
                "throughput": round(throughput, 2),
                "efficiency": round(efficiency, 4),
                # Against one rank without communication: the same yardstick for every case.
                "efficiency_vs_compute_only": round(
                    scaling_efficiency(ideal_one, throughput, n), 4
                ),
            }
            cases.append(
                {
                    "name": f"{name}@{n}",
                    "median_ms": round(wall[name], 2),
                    "overlap_efficiency": None,
                    "speedup_vs_baseline": round(wall[BASELINE] / wall[name], 3),
                    "ranks": n,
                    "throughput": round(throughput, 2),
                    "scaling_efficiency": round(efficiency, 4),
                }
            )
    return {
        "cases": cases,
        "baseline": BASELINE,
        "link": current_link() or {"rate": "none (loopback)", "delay": "0ms"},
        "unit": f"{unit}/s",
        "scaling": scaling,
        "cores": len(os.sched_getaffinity(0)),
        "load_average": os.getloadavg(),
        "config": cfg,
    }


def print_table(report: dict) -> None:
    counts = sorted(int(n) for n in report["scaling"][BASELINE])
    cfg, link = report["config"], report["link"]
    print(
        f"\nscaling: model {cfg['model']} {cfg['layers']} layers x {cfg['width']}, batch "
        f"{cfg['batch']} per rank; link {link['rate']}; {report['cores']} cores; load "
        f"{', '.join(f'{x:.2f}' for x in report['load_average'])}"
    )
    head = "".join(f"{f'{n} rank(s)':>22}" for n in counts)
    print(f"{'case':<14}{head}")
    for name, per_n in report["scaling"].items():
        cells = "".join(
            f"{per_n[str(n)]['throughput']:>13,.0f} ({per_n[str(n)]['efficiency']:>5.0%})"
            for n in counts
        )
        print(f"{name:<14}{cells}")
    print(f"throughput in {report['unit']} (scaling efficiency T(n) / (n x T(1)))")


def plot(report: dict, path: Path) -> Path:
    """Throughput and efficiency against rank count, one line per case, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, per_n in report["scaling"].items():
        counts = sorted(int(n) for n in per_n)
        left.plot(counts, [per_n[str(n)]["throughput"] for n in counts], marker="o", label=name)
        right.plot(counts, [per_n[str(n)]["efficiency"] for n in counts], marker="o", label=name)
    counts = sorted(int(n) for n in report["scaling"][BASELINE])
    one = report["scaling"]["compute_only"]["1"]["throughput"]
    left.plot(counts, [n * one for n in counts], "k:", label="ideal (n x compute_only)")
    left.set(xlabel="ranks", ylabel=report["unit"], title="throughput", xticks=counts)
    right.axhline(1.0, color="k", linestyle=":")
    right.set(
        xlabel="ranks",
        ylabel="T(n) / (n x T(1))",
        title="scaling efficiency",
        xticks=counts,
        ylim=(0, 1.1),
    )
    left.legend(fontsize=8)
    link = report["link"]["rate"]
    fig.suptitle(f"{report['config']['model']}, gloo, link {link}, {report['cores']} cores")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-ranks", type=int, default=2, help="largest rank count (2)")
    parser.add_argument("--rate", default="8gbit", help="tc rate of the emulated link, or 'none'")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (needs netem)")
    parser.add_argument("--model", choices=sorted(DEFAULT_SIZES), default="gpt_tiny")
    parser.add_argument("--layers", type=int, help="blocks (default per model)")
    parser.add_argument("--width", type=int, help="block width (default per model)")
    parser.add_argument("--batch", type=int, help="rows or sequences per rank (default per model)")
    parser.add_argument("--seq-len", type=int, default=64, help="gpt_tiny tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="steps per case per round")
    parser.add_argument("--rounds", type=int, default=3, help="round-robin passes over the cases")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps in the first round")
    parser.add_argument("--json", type=Path, help="write the report here as JSON")
    parser.add_argument(
        "--png", type=Path, default=RESULTS / "scaling.png", help="plot (bench/results/)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.max_ranks < 1:
        raise SystemExit(f"--max-ranks must be >= 1, got {args.max_ranks}")
    if current_link() is None:
        print(f"[cpu priority] {prioritize()}", flush=True)
    enter_emulated_link(args.rate, args.delay_ms)
    cfg = workload_config(args, sweep=[])
    print(f"scaling: ranks {rank_counts(args.max_ranks)}, {cfg}", flush=True)
    medians = {}
    for n in rank_counts(args.max_ranks):
        results = run_on_ranks(rank_main, n, cfg, collective_timeout_s=120, total_timeout_s=3600)
        medians[n] = summarize([r["wall"] for r in results], max)
        print(f"  {n} rank(s) done", flush=True)
    report = build_report(medians, cfg)
    print_table(report)
    write_json_report(args.json, report)
    print(f"plot: {plot(report, args.png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
