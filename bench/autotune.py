"""Does ``"auto"`` find the best setting? Auto-tuning vs an exhaustive sweep of fixed settings.

For each combination of model (``--models``) and emulated link rate (``--rates``), one run on two
gloo ranks behind that link (a child process per combination, ``bench.harness.emulated_link``)
holds, per wrapper (``--wrappers``: ``ok_ddp``, ``bucketer``):

- one case per fixed bucket size of the sweep (powers of two from ``--min-mb`` MiB up to the
  first that puts every gradient in one bucket, one per distinct bucket layout; or ``--sweep``),
  and
- one ``@auto`` case (``bucket_mb="auto"``).

The auto cases are first trained alone, step after step, until ``ok.tuning_report`` says they
have settled (their tuning steps are timed and reported separately). Then every case runs
interleaved round-robin (each timed step after a barrier; a step's time is the slower rank's),
so machine noise hits all cases alike. The table shows, per combination and wrapper, the best
fixed setting and its median step, auto's choice and its median step, the ratio auto/best
(target <= 1.05), and the fixed case at auto's choice over the best fixed one (how good the
choice was, apart from the noise between two cases with one setting). ``--fsdp-rate`` adds one
FSDP combination (MLP of ``--fsdp-blocks`` x ``--fsdp-width``): ``ok.fsdp(prefetch=0|1|2)`` vs
``prefetch="auto"``.

Example::

    python -m bench.autotune --json bench/results/autotune.json
    python -m bench.autotune --models mlp --rates 4gbit --wrappers ok_ddp --rounds 2
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
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import overlapkit as ok
from bench.harness.cpu_priority import prioritize
from bench.harness.emulated_link import current_link, enter_emulated_link
from bench.harness.json_report import write_json_report
from bench.harness.workloads import make_mlp, workload_of
from overlapkit.train.models.workload import DEFAULT_SIZES
from overlapkit.tuning.decide import bucket_ladder
from overlapkit.workers.local_ranks import run_on_ranks

MiB = 1024 * 1024
TARGET_RATIO = 1.05
WRAPPERS = ("ok_ddp", "bucketer")
MAX_TUNING_STEPS = 80


def fixed_sweep(param_bytes: list[int], min_mb: float) -> list[float]:
    """Powers of two from ``min_mb`` MiB up to the first giving a single bucket, one per layout.

    Sizes that give the same bucket layout as a smaller one are left out: they would measure the
    same thing, and extra copies of one setting would only let noise pick a lucky "best".
    """
    return bucket_ladder(param_bytes[::-1], min_mb=min_mb, max_candidates=64)


def _ddp_cases(cfg: dict, rank: int) -> dict[str, tuple[Callable[[], None], object]]:
    """Step function and tuning owner (None for fixed settings) per case name."""
    workload = workload_of(cfg, rank)
    new_model, loss = workload.new_model, workload.loss
    cases = {}
    for wrapper in cfg["wrappers"]:
        for setting in [*cfg["sweep"], "auto"]:
            model = new_model()
            if wrapper == "ok_ddp":
                model = ok.ddp(model, bucket_mb=setting)
                owner, finish = model, None
            else:
                owner = ok.GradBucketer(model, bucket_mb=setting)
                finish = owner.wait
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

            def step(model=model, finish=finish, optimizer=optimizer) -> None:
                loss(model).backward()
                if finish is not None:
                    finish()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            name = f"{wrapper}@{setting if setting == 'auto' else f'{setting:g}'}"
            cases[name] = (step, owner if setting == "auto" else None)
    return cases


def _fsdp_cases(cfg: dict, rank: int) -> dict[str, tuple[Callable[[], None], object]]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g)
    cases = {}
    for setting in (0, 1, 2, "auto"):
        model = ok.fsdp(make_mlp(cfg["layers"], cfg["width"]), prefetch=setting)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step(model=model, optimizer=optimizer) -> None:
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        cases[f"ok_fsdp@{setting}"] = (step, model if setting == "auto" else None)
    return cases


def _timed(step: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3


def _rank_main(rank: int, world_size: int, cfg: dict) -> dict:
    cases = _fsdp_cases(cfg, rank) if cfg["kind"] == "fsdp" else _ddp_cases(cfg, rank)
    tuning = {}
    for name, (step, owner) in cases.items():
        if owner is None:
            continue
        times = []
        # Both ranks settle at the same step (the decision is shared), so both leave together.
        while not ok.tuning_report(owner).settled:
            if len(times) == MAX_TUNING_STEPS:
                raise RuntimeError(f"{name} did not settle in {MAX_TUNING_STEPS} steps")
            times.append(_timed(step))
        tuning[name] = {"steps": len(times), "ms": times, "report": ok.tuning_report(owner)}
    for step, _ in cases.values():
        for _ in range(cfg["warmup"]):
            _timed(step)
    wall: dict[str, list[float]] = {name: [] for name in cases}
    for round_index in range(cfg["rounds"]):
        for name, (step, _) in cases.items():
            for _ in range(cfg["steps"]):
                wall[name].append(_timed(step))
        if rank == 0:
            print(f"  round {round_index + 1}/{cfg['rounds']} done", flush=True)
    return {
        "wall": wall,
        "tuning_ms": {name: t["ms"] for name, t in tuning.items()},
        "reports": {name: t["report"].to_json() for name, t in tuning.items()},
    }


def _slowest_median(per_rank: list[list[float]]) -> float:
    return statistics.median(max(step) for step in zip(*per_rank, strict=True))


def summarize_combination(results: list[dict], cfg: dict) -> dict:
    """Medians per case and, per wrapper, best fixed vs auto (cases: docs/json-contracts.md)."""
    medians = {
        name: _slowest_median([r["wall"][name] for r in results]) for name in results[0]["wall"]
    }
    rows, cases = [], []
    for wrapper in sorted({name.split("@")[0] for name in medians}):
        fixed = {
            n: t for n, t in medians.items() if n.startswith(wrapper + "@") and "auto" not in n
        }
        auto_name = f"{wrapper}@auto"
        best_name = min(fixed, key=fixed.get)
        report = results[0]["reports"][auto_name]
        tuning_ms = _slowest_median([r["tuning_ms"][auto_name] for r in results])
        rows.append(
            {
                "wrapper": wrapper,
                "best_fixed": best_name.split("@")[1],
                "best_fixed_ms": round(fixed[best_name], 2),
                "auto_chosen": report["chosen"],
                "auto_ms": round(medians[auto_name], 2),
                "ratio_auto_vs_best": round(medians[auto_name] / fixed[best_name], 3),
                # How good the choice was, free of the noise between two identical cases.
                "ratio_chosen_fixed_vs_best": (
                    round(fixed[chosen_name] / fixed[best_name], 3)
                    if (chosen_name := f"{wrapper}@{report['chosen']:g}") in fixed
                    else None
                ),
                "tuning_steps": len(results[0]["tuning_ms"][auto_name]),
                "tuning_median_step_ms": round(tuning_ms, 2),
                "report": report,
            }
        )
        for name in [*fixed, auto_name]:
            cases.append(
                {
                    "name": name,
                    "median_ms": round(medians[name], 2),
                    "overlap_efficiency": None,
                    "speedup_vs_baseline": round(fixed[best_name] / medians[name], 3),
                }
            )
    return {
        "model": cfg["model"],
        "link": current_link() or {"rate": "none (loopback)", "delay": "0ms"},
        "rows": rows,
        "cases": cases,
        "config": cfg,
    }


def _run_one(args: argparse.Namespace) -> int:
    """One combination, inside its emulated link: write its summary to ``--json``."""
    enter_emulated_link(args.rate)
    if args.model == "fsdp_mlp":
        cfg = {
            "kind": "fsdp",
            "model": f"fsdp_mlp {args.fsdp_blocks}x{args.fsdp_width}",
            "layers": args.fsdp_blocks,
            "width": args.fsdp_width,
            "batch": 64,
        }
    else:
        cfg = {"kind": "ddp", "model": args.model, **DEFAULT_SIZES[args.model], "seq_len": 64}
        model = workload_of(cfg, 0).new_model()
        param_bytes = [p.numel() * p.element_size() for p in model.parameters()]
        cfg["sweep"] = (
            [float(s) for s in args.sweep.split(",")]
            if args.sweep
            else fixed_sweep(param_bytes, args.min_mb)
        )
        cfg["wrappers"] = args.wrappers.split(",")
    cfg.update(steps=args.steps, rounds=args.rounds, warmup=args.warmup)
    print(f"autotune: {args.rate}, {cfg}", flush=True)
    load_before = os.getloadavg()
    results = run_on_ranks(_rank_main, 2, cfg, collective_timeout_s=120, total_timeout_s=3600)
    summary = summarize_combination(results, cfg)
    summary["load_average"] = {"before": load_before, "after": os.getloadavg()}
    args.json.write_text(json.dumps(summary, indent=2))
    return 0


def print_table(combos: list[dict]) -> None:
    print(
        f"\n{'model':<20} {'link':<7} {'wrapper':<9} {'best fixed':>10} {'ms':>8} "
        f"{'auto chose':>10} {'ms':>8} {'auto/best':>9} {'fixed@chosen/best':>17} "
        f"{'tuning steps':>12} {'load':>10}"
    )
    for combo in combos:
        load = combo["load_average"]
        for row in combo["rows"]:
            chosen_ratio = row["ratio_chosen_fixed_vs_best"]
            print(
                f"{combo['model']:<20} {combo['link']['rate']:<7} {row['wrapper']:<9} "
                f"{row['best_fixed']:>10} {row['best_fixed_ms']:>8.1f} "
                f"{row['auto_chosen']:>10g} {row['auto_ms']:>8.1f} "
                f"{row['ratio_auto_vs_best']:>9.3f} "
                f"{'-' if chosen_ratio is None else f'{chosen_ratio:.3f}':>17} "
                f"{row['tuning_steps']:>12} "
                f"{load['before'][0]:>4.1f}-{load['after'][0]:<4.1f}"
            )
    print("\nevery case (median ms of the slower rank):")
    for combo in combos:
        cells = "  ".join(f"{c['name']} {c['median_ms']:.1f}" for c in combo["cases"])
        print(f"  {combo['model']} {combo['link']['rate']}: {cells}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default="mlp,gpt_tiny", help="comma-separated ddp_overlap models"
    )
    parser.add_argument("--rates", default="1gbit,4gbit", help="comma-separated tc rates")
    parser.add_argument("--wrappers", default=",".join(WRAPPERS), help="ok_ddp and/or bucketer")
    parser.add_argument("--sweep", default="", help="fixed bucket sizes in MiB (default: ladder)")
    parser.add_argument("--min-mb", type=float, default=0.25, help="smallest fixed bucket size")
    parser.add_argument("--fsdp-rate", default="4gbit", help="rate of the FSDP case ('' skips it)")
    parser.add_argument("--fsdp-blocks", type=int, default=8)
    parser.add_argument("--fsdp-width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case per round")
    parser.add_argument("--rounds", type=int, default=4, help="round-robin passes over the cases")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per case first")
    parser.add_argument("--json", type=Path, help="write the report here as JSON")
    # Internal: run one combination (the parent starts one child per combination).
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        return _run_one(args)
    print(f"[cpu priority] {prioritize()}", flush=True)
    combos_to_run = [(m, r) for m in args.models.split(",") for r in args.rates.split(",")]
    if args.fsdp_rate:
        combos_to_run.append(("fsdp_mlp", args.fsdp_rate))
    shared = [
        "--wrappers",
        args.wrappers,
        "--sweep",
        args.sweep,
        "--min-mb",
        str(args.min_mb),
        "--fsdp-blocks",
        str(args.fsdp_blocks),
        "--fsdp-width",
        str(args.fsdp_width),
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
        "--warmup",
        str(args.warmup),
    ]
    combos = []
    with tempfile.TemporaryDirectory(prefix="ovk-autotune-") as scratch:
        for i, (model, rate) in enumerate(combos_to_run):
            out = Path(scratch) / f"{i}.json"
            command = [
                sys.executable,
                "-m",
                "bench.autotune",
                "--one",
                "--model",
                model,
                "--rate",
                rate,
                "--json",
                str(out),
                *shared,
            ]
            subprocess.run(command, check=True)
            combos.append(json.loads(out.read_text()))
    print_table(combos)
    if args.json:
        report = {
            "cases": [
                {**case, "name": f"{c['model']}/{c['link']['rate']}/{case['name']}"}
                for c in combos
                for case in c["cases"]
            ],
            "baseline": "best fixed setting of the same wrapper, model and link",
            "link": {"rate": args.rates, "delay": "0ms"},
            "target_ratio_auto_vs_best": TARGET_RATIO,
            "combinations": combos,
        }
        write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
