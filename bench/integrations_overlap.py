"""Lightning, Accelerate and the HF Trainer: their own DDP beside overlapkit's per-bucket mode.

Two gloo ranks behind an emulated scale-out link (``--rate 8gbit`` by default, ``--rate none``
for plain loopback) train the benchmark MLP (8 blocks of Linear(1024) + ReLU, 64 rows per rank,
32 MiB of gradients) with AdamW and each framework's own global-norm clipping to ``--max-norm``
(1.0, the HF Trainer's default; 0: none, though the HF Trainer still measures the norm), through
the framework itself: ``Trainer.fit`` (Lightning), an ``accelerator.prepare``-d loop, and
``transformers.Trainer.train``. Cases (``bench/harness/framework_cases.py``), for each framework:
its DDP with its defaults (``<fw>_ddp``, the baseline of its rows), the same DDP with the
bucketer's bucket size (``<fw>_ddp_tuned``) and ``<fw>_per_bucket``
(``OverlapDDPStrategy(optimizer_overlap=True)``, ``use_ok_ddp(accelerator,
optimizer_overlap=True)``, ``OverlapTrainer(overlapkit_options={"optimizer_overlap": True})``).

Step time: each case runs ``--warmup + --steps + 1`` optimizer steps per round, the rounds
interleave the cases (so machine noise hits all alike), and a case's step time is the median
interval between two step ends (after warm-up), the slower rank's, median over rounds. Exposed
comm per step: after the timed rounds, one more run per case under ``ok.profile`` (its
``--steps`` steps recorded; ``overlapkit report``'s analysis of the traces).

Example::

    python -m bench.integrations_overlap --json bench/results/integrations_overlap.json
    python -m bench.integrations_overlap --rate none --rounds 1 --steps 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import overlapkit as ok
from bench.harness.cpu_priority import prioritize
from bench.harness.emulated_link import current_link, enter_emulated_link
from bench.harness.exposed_comm import exposed_share
from bench.harness.framework_cases import CASES, FRAMEWORKS, StepClock, run_case
from bench.harness.json_report import write_json_report
from bench.harness.workloads import workload_of
from overlapkit.train.models.workload import DEFAULT_SIZES
from overlapkit.workers.local_ranks import run_on_ranks

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def rank_main(rank: int, world_size: int, cfg: dict, profile_root: str) -> dict:
    """Every case, round after round, then each once under ``ok.profile``; this rank's times."""
    workload = workload_of(cfg, rank)
    total = cfg["warmup"] + cfg["steps"] + 1
    times: dict[str, list[float]] = {name: [] for name in cfg["cases"]}
    for _ in range(cfg["rounds"]):
        for name in cfg["cases"]:
            clock = StepClock()
            run_case(name, workload.new_model, cfg["batch"], total, clock, cfg["max_norm"])
            times[name].append(clock.median_ms(cfg["warmup"]))
    for name in cfg["cases"]:
        logdir = os.path.join(profile_root, name)
        with ok.profile(logdir, wait=1, warmup=1, active=cfg["steps"], rank=rank) as prof:
            clock = StepClock(prof)
            steps = cfg["steps"] + 3  # wait + warmup + the recorded steps, and one to close
            run_case(name, workload.new_model, cfg["batch"], steps, clock, cfg["max_norm"])
    return {name: statistics.median(t) for name, t in times.items()}


def build_report(per_rank: list[dict], exposed: dict[str, dict], cfg: dict) -> dict:
    """The benchmark JSON (docs/json-contracts.md): cases, baseline, link, config."""
    cases = []
    for name in cfg["cases"]:
        framework = name.split("_", 1)[0]
        median = max(r[name] for r in per_rank)
        baseline = max(r[f"{framework}_ddp"] for r in per_rank)
        cases.append(
            {
                "name": name,
                "median_ms": round(median, 2),
                "overlap_efficiency": None,
                "speedup_vs_baseline": round(baseline / median, 3),
                "exposed_comm_ms_per_step": round(exposed[name]["exposed_comm_ms_per_step"], 2),
                "comm_ms_per_step": round(exposed[name]["comm_ms_per_step"], 2),
                "profiled_step_ms": round(exposed[name]["median_ms"], 2),
            }
        )
    return {
        "cases": cases,
        "baseline": "<framework>_ddp (each framework's DDP with its defaults)",
        "link": current_link() or {"rate": "none (loopback)", "delay": "0ms"},
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "config": cfg,
    }


def print_table(report: dict) -> None:
    cfg, link = report["config"], report["link"]
    print(
        f"\nlink: {link['rate']} delay {link['delay']}; {cfg['model']} {cfg['layers']} x "
        f"{cfg['width']}, {cfg['batch']} rows per rank, AdamW, clip {cfg['max_norm']}; "
        f"{cfg['rounds']} rounds of {cfg['steps']} steps; load average {report['load_average']}"
    )
    print(
        f"{'case':<24} {'step ms':>8} {'vs <fw>_ddp':>12} {'exposed comm ms':>16} "
        f"{'comm ms':>8} {'profiled step ms':>17}"
    )
    for case in report["cases"]:
        print(
            f"{case['name']:<24} {case['median_ms']:>8.1f} {case['speedup_vs_baseline']:>11.2f}x "
            f"{case['exposed_comm_ms_per_step']:>16.1f} {case['comm_ms_per_step']:>8.1f} "
            f"{case['profiled_step_ms']:>17.1f}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="8gbit", help="tc rate of the emulated link, or 'none'")
    parser.add_argument("--model", choices=sorted(DEFAULT_SIZES), default="mlp")
    parser.add_argument("--layers", type=int, help="blocks (default per model)")
    parser.add_argument("--width", type=int, help="block width (default per model)")
    parser.add_argument("--batch", type=int, help="rows per rank (default per model)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per case per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="round-robin passes over the cases")
    parser.add_argument(
        "--max-norm", type=float, default=1.0, help="the frameworks' clipping; 0 turns it off"
    )
    parser.add_argument(
        "--frameworks",
        default=",".join(FRAMEWORKS),
        help=f"comma-separated subset of {','.join(FRAMEWORKS)}",
    )
    parser.add_argument("--profile-dir", type=Path, help="keep the ok.profile traces here")
    parser.add_argument("--json", type=Path, help="write the report here as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model != "mlp":
        raise SystemExit(f"--model {args.model}: the framework cases train the MLP only")
    frameworks = [f for f in args.frameworks.split(",") if f]
    unknown = sorted(set(frameworks) - set(FRAMEWORKS))
    if unknown or args.steps < 2 or args.rounds < 1 or args.warmup < 0 or args.max_norm < 0:
        raise SystemExit(
            f"--frameworks {unknown or frameworks} (known: {list(FRAMEWORKS)}), --steps "
            f"{args.steps} (>= 2), --rounds {args.rounds} (>= 1), --warmup {args.warmup} "
            f"(>= 0), --max-norm {args.max_norm} (>= 0)"
        )
    if current_link() is None:
        print(f"[cpu priority] {prioritize()}", flush=True)
    enter_emulated_link(args.rate)
    defaults = DEFAULT_SIZES[args.model]
    cfg = {
        "model": args.model,
        "layers": args.layers or defaults["layers"],
        "width": args.width or defaults["width"],
        "batch": args.batch or defaults["batch"],
        "seq_len": 64,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "max_norm": args.max_norm,
        "cases": [c for c in CASES if c.split("_", 1)[0] in frameworks],
    }
    root = Path(args.profile_dir or tempfile.mkdtemp(prefix="integrations_overlap-"))
    if any(root.glob("*/*.pt.trace.json*")):
        raise SystemExit(f"{root} already holds traces; pass a fresh --profile-dir")
    print(f"integrations_overlap: 2 gloo ranks, {cfg}", flush=True)
    try:
        per_rank = run_on_ranks(
            rank_main,
            2,
            cfg,
            str(root),
            collective_timeout_s=120,
            total_timeout_s=3600,
            env=OFFLINE,
        )
        exposed = {name: exposed_share(root / name) for name in cfg["cases"]}
    finally:
        if args.profile_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    report = build_report(per_rank, exposed, cfg)
    print_table(report)
    write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
