"""How much gradient all-reduce each data-parallel path hides behind backward, side by side.

Two gloo ranks run every case interleaved in one process group (round-robin, so machine noise hits
all cases alike), behind an emulated scale-out link by default (``--rate 8gbit``; ``--rate none``
for plain loopback). Each timed step starts after a barrier; a step's time is the slower rank's.

Cases:
    compute_only     forward + backward, no communication (also gives the forward time)
    comm_only        one all-reduce of all gradient bytes, no compute
    no_overlap       backward, then one flat all-reduce of the gradients
    ddp_default      torch DistributedDataParallel with its defaults (the baseline)
    ok_ddp           ok.ddp(model) with overlapkit's default bucket size
    bucketer         ok.GradBucketer(model) with its default bucket size
    ok_ddp_bf16      ok.ddp(model, compress="bf16")

With ``--optimizer sgd|adamw`` (default adamw; ``none`` leaves them out), four cases that include
the optimizer step, each timed as ``--steps`` consecutive steps with no barrier in between (the
per-bucket updates of one step overlap the next step's forward, so a barrier per step would hide
their cost); the block ends when every update is applied:
    ddp_opt          DDP with the bucketer's bucket size and gradient_as_bucket_view=True,
                     optimizer.step(), zero_grad()
    bucketer_opt     ok.GradBucketer: wait(), optimizer.step(), zero_grad()
    bucketer_overlap ok.GradBucketer(optimizer=opt): step() (per-bucket updates, the next forward
                     waits per module), same default bucket size
    ddp_opt_default  as ddp_opt, with DDP's defaults (25 MiB buckets, gradients copied in and out)
and the same three with global-norm clipping to 1.0 (train.clip_grad_norm's default):
    ddp_opt_clip          DDP, clip_grad_norm_(1.0), optimizer.step(), zero_grad()
    bucketer_opt_clip     ok.GradBucketer: wait(), clip_grad_norm_(1.0), optimizer.step()
    bucketer_overlap_clip ok.GradBucketer(optimizer=opt): step(clip_grad_norm=1.0), the exact
                          clip folded into the per-bucket updates
With ``--only views`` (and an optimizer), ok.ddp(model) with its default bucket size and the
optimizer, gradients copied into the buckets and back or kept as views of them, each with
``zero_grad()`` (torch's default: gradients freed) and ``zero_grad(set_to_none=False)``; the
setting ``ok.ddp``'s ``gradient_as_bucket_view`` default was chosen on (docs/ddp.md):
    ok_ddp_copy          ok.ddp(model, gradient_as_bucket_view=False), step(), zero_grad()
    ok_ddp_view          ok.ddp(model, gradient_as_bucket_view=True), step(), zero_grad()
    ok_ddp_copy_zeroed   as ok_ddp_copy, zero_grad(set_to_none=False)
    ok_ddp_view_zeroed   as ok_ddp_view, zero_grad(set_to_none=False)
``--profile-dir DIR`` then profiles the bucketer cases with an optimizer and ddp_opt_clip with
``ok.profile`` and reports their exposed communication per step (``overlapkit report
DIR/<case>`` for detail).

Models: ``--model mlp`` (default: 8 blocks of Linear(1024) + ReLU, 64 rows per rank) or
``--model gpt_tiny`` (4 blocks, width 256, 2 sequences of 64 tokens per rank).

Overlap efficiency (docs/architecture.md) is ``(T_no_overlap - T) / (T_no_overlap - T_bound)`` with
``T_bound = max(T_compute, T_forward + T_comm)``, all medians from this run. Because gloo's
transfers cost CPU on the cores that also compute, the table adds each case's CPU time (all threads
of all ranks) and the efficiency against a CPU-aware bound,
``max(T_bound, (CPU_compute + CPU_comm) / cores)``.

Example::

    python -m bench.ddp_overlap --json bench/results/ddp_overlap.json
    python -m bench.ddp_overlap --rate none --layers 4 --width 512
    python -m bench.ddp_overlap --model gpt_tiny
    python -m bench.ddp_overlap --sweep 1,2,4,8,25   # ok_ddp / bucketer at these bucket sizes
    python -m bench.ddp_overlap --only optimizer --profile-dir runs/bucketer_overlap
    python -m bench.ddp_overlap --only optimizer --tails 0,4   # other forward_order_tail values
    python -m bench.ddp_overlap --only views --rounds 9   # ok.ddp's gradient_as_bucket_view
    python -m bench.ddp_overlap --device cuda --rate none   # NCCL ranks on GPU 0 (gpu/overlap.sh)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import overlapkit as ok
from bench.harness.cpu_priority import prioritize
from bench.harness.ddp_cases import (
    BASELINE,
    CLIPPED_CASES,
    CLIPPED_TAIL_CASE,
    MAX_NORM,
    OPTIMIZER_BASELINE,
    OPTIMIZER_CASES,
    OPTIMIZERS,
    VIEW_BASELINE,
    VIEW_CASES,
    optimizer_cases,
    rank_main,
    summarize,
    with_optimizer,
    workload_config,
)
from bench.harness.device import backend_for, enter_device
from bench.harness.emulated_link import current_link, enter_emulated_link
from bench.harness.exposed_comm import exposed_share
from bench.harness.json_report import write_json_report
from bench.harness.workloads import workload_of
from overlapkit.train.models.workload import DEFAULT_SIZES
from overlapkit.workers.local_ranks import run_on_ranks

PROFILED = (
    "bucketer_opt",
    "bucketer_overlap",
    "ddp_opt_clip",
    "bucketer_opt_clip",
    "bucketer_overlap_clip",
)


def build_report(wall: dict[str, float], cpu: dict[str, float], cfg: dict, grad_bytes: int):
    """The benchmark JSON (docs/json-contracts.md keys plus CPU accounting), from medians in ms.

    On CPU, gloo's transfers and reductions run on the same cores as compute, so besides the
    definition's ``T_bound`` (docs/architecture.md) there is a second lower bound: all CPU work
    of compute and comm spread over the machine's cores. ``overlap_efficiency_cpu`` measures
    against the larger of the two.
    """
    t_compute, t_comm = wall["compute_only"], wall["comm_only"]
    t_bound = max(t_compute, wall["forward"] + t_comm)
    cores = len(os.sched_getaffinity(0))
    t_cpu_bound = max(t_bound, (cpu["compute_only"] + cpu["comm_only"]) / cores)
    t_no_overlap = wall["no_overlap"]

    def efficiency(t: float, bound: float) -> float:
        return round((t_no_overlap - t) / (t_no_overlap - bound), 3)

    cases = []
    for name, t in wall.items():
        if name == "forward":
            continue
        # Cases with an optimizer step are compared with DDP + the same optimizer only: the
        # efficiency's bounds have no optimizer in them.
        overlapping = name not in ("compute_only", "comm_only", "no_overlap") and not (
            with_optimizer(name)
        )
        case = {
            "name": name,
            "median_ms": round(t, 2),
            "overlap_efficiency": efficiency(t, t_bound) if overlapping else None,
            "speedup_vs_baseline": round(wall[BASELINE] / t, 3),
            "cpu_ms_all_ranks": round(cpu[name], 2),
            "overlap_efficiency_cpu": efficiency(t, t_cpu_bound) if overlapping else None,
        }
        if name in VIEW_CASES:
            case["speedup_vs_ok_ddp_copy"] = round(wall[VIEW_BASELINE] / t, 3)
        elif with_optimizer(name):
            case["speedup_vs_ddp_opt"] = round(wall[OPTIMIZER_BASELINE] / t, 3)
            if "bucketer_opt" in wall:
                case["speedup_vs_bucketer_opt"] = round(wall["bucketer_opt"] / t, 3)
            if name in CLIPPED_CASES or name.startswith(CLIPPED_TAIL_CASE):
                case["speedup_vs_ddp_opt_clip"] = round(wall["ddp_opt_clip"] / t, 3)
        cases.append(case)
    link = current_link() or {"rate": "none (loopback)", "delay": "0ms"}
    return {
        "cases": cases,
        "baseline": BASELINE,
        "link": link,
        "forward_ms": round(wall["forward"], 2),
        "t_bound_ms": round(t_bound, 2),
        "t_cpu_bound_ms": round(t_cpu_bound, 2),
        "cores": cores,
        "grad_mib": round(grad_bytes / 2**20, 2),
        "config": cfg,
    }


def print_table(report: dict) -> None:
    link, cfg = report["link"], report["config"]
    print(
        f"\nlink: {link['rate']} delay {link['delay']}; model {cfg['model']} {cfg['layers']} "
        f"layers x {cfg['width']}, batch {cfg['batch']} per rank, {report['grad_mib']} MiB of "
        f"gradients; forward {report['forward_ms']} ms; T_bound {report['t_bound_ms']} ms; "
        f"CPU-aware bound {report['t_cpu_bound_ms']} ms on {report['cores']} cores"
    )
    print(
        f"{'case':<20} {'median ms':>10} {'overlap eff':>12} {'vs ' + BASELINE:>16} "
        f"{'CPU ms (all ranks)':>19} {'eff vs CPU bound':>17}"
    )
    for case in report["cases"]:
        eff, eff_cpu = case["overlap_efficiency"], case["overlap_efficiency_cpu"]
        print(
            f"{case['name']:<20} {case['median_ms']:>10.1f} "
            f"{'-' if eff is None else f'{eff:.2f}':>12} {case['speedup_vs_baseline']:>15.2f}x "
            f"{case['cpu_ms_all_ranks']:>19.1f} {'-' if eff_cpu is None else f'{eff_cpu:.2f}':>17}"
        )
    with_optimizer = [c for c in report["cases"] if "speedup_vs_ddp_opt" in c]
    if with_optimizer:
        print(f"\nwith {cfg['optimizer']} steps (blocks of {cfg['steps']} back-to-back steps):")
        print(
            f"{'case':<22} {'median ms':>10} {'vs ddp_opt':>11} {'vs bucketer_opt':>16} "
            f"{'vs ddp_opt_clip':>16}"
        )
        for case in with_optimizer:
            print(
                f"{case['name']:<22} {case['median_ms']:>10.1f} "
                f"{case['speedup_vs_ddp_opt']:>10.2f}x "
                f"{case.get('speedup_vs_bucketer_opt', float('nan')):>15.2f}x "
                f"{case.get('speedup_vs_ddp_opt_clip', float('nan')):>15.2f}x"
            )
    views = [c for c in report["cases"] if "speedup_vs_ok_ddp_copy" in c]
    if views:
        print(
            f"\nok.ddp + {cfg['optimizer']}, gradient_as_bucket_view (blocks of {cfg['steps']} "
            "back-to-back steps):"
        )
        print(f"{'case':<22} {'median ms':>10} {'vs ' + VIEW_BASELINE:>15}")
        for case in views:
            print(
                f"{case['name']:<22} {case['median_ms']:>10.1f} "
                f"{case['speedup_vs_ok_ddp_copy']:>14.2f}x"
            )


def _profile_rank(rank: int, world_size: int, cfg: dict, root: str) -> None:
    enter_device(cfg, rank)
    workload = workload_of(cfg, rank)
    steps, finish = optimizer_cases(cfg, workload.new_model, workload.loss)
    clipped_steps, clipped_finish = optimizer_cases(
        cfg, workload.new_model, workload.loss, max_norm=MAX_NORM
    )
    steps, finish = steps | clipped_steps, finish | clipped_finish
    for name in PROFILED:
        with ok.profile(str(Path(root) / name), wait=1, warmup=1, active=cfg["steps"]) as prof:
            for _ in range(2 + cfg["steps"]):
                steps[name]()
                prof.step()
        if name in finish:
            finish[name]()


def profile_exposed_comm(cfg: dict, root: Path) -> dict[str, dict]:
    """Exposed comm per step of ``PROFILED`` under ``ok.profile`` (``overlapkit report``'s math)."""
    for name in PROFILED:
        if any((root / name).glob("*.pt.trace.json*")):
            raise SystemExit(f"{root / name} already holds traces; pass a fresh --profile-dir")
    run_on_ranks(
        _profile_rank,
        2,
        {**cfg, "optimizer": cfg["optimizer"] or "adamw"},
        str(root),
        collective_timeout_s=120,
        total_timeout_s=1800,
        backend=backend_for(cfg),
    )
    out = {name: exposed_share(root / name) for name in PROFILED}
    print(f"\nok.profile, {cfg['steps']} profiled steps per rank:")
    print(f"{'case':<20} {'step ms':>8} {'comm ms':>8} {'exposed ms':>11} {'exposed share':>14}")
    for name, r in out.items():
        print(
            f"{name:<20} {r['median_ms']:>8.1f} {r['comm_ms_per_step']:>8.1f} "
            f"{r['exposed_comm_ms_per_step']:>11.1f} {r['exposed_share']:>14.0%}"
        )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="8gbit", help="tc rate of the emulated link, or 'none'")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (needs netem)")
    parser.add_argument("--model", choices=sorted(DEFAULT_SIZES), default="mlp")
    parser.add_argument("--layers", type=int, help="blocks (default per model)")
    parser.add_argument("--width", type=int, help="block width (default per model)")
    parser.add_argument("--batch", type=int, help="rows or sequences per rank (default per model)")
    parser.add_argument("--seq-len", type=int, default=64, help="gpt_tiny tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="steps per case per round")
    parser.add_argument("--rounds", type=int, default=5, help="round-robin passes over the cases")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps in the first round")
    parser.add_argument("--sweep", default="", help="comma-separated extra bucket sizes in MiB")
    parser.add_argument(
        "--optimizer",
        choices=[*OPTIMIZERS, "none"],
        default="adamw",
        help="optimizer of the cases with an optimizer step (--only optimizer)",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated cases to run besides the reference ones; 'optimizer' means "
        + ",".join((*OPTIMIZER_CASES, *CLIPPED_CASES))
        + "; 'views' means "
        + ",".join(VIEW_CASES),
    )
    parser.add_argument(
        "--tails",
        default="",
        help="comma-separated forward_order_tail values: extra bucketer_overlap@tail<N> and "
        "bucketer_overlap_clip@tail<N> cases",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: two NCCL ranks on GPU 0 (start CUDA MPS first; bench/gpu/overlap.sh does)",
    )
    parser.add_argument(
        "--profile-dir",
        type=Path,
        help="also profile bucketer_opt and bucketer_overlap here and report exposed comm",
    )
    parser.add_argument("--json", type=Path, help="write the report here as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = workload_config(args, sweep=[float(s) for s in args.sweep.split(",") if s])
    if current_link() is None:
        print(f"[cpu priority] {prioritize()}", flush=True)
    enter_emulated_link(args.rate, args.delay_ms)
    cfg["optimizer"] = None if args.optimizer == "none" else args.optimizer
    cfg["device"] = args.device
    cfg["tails"] = [int(t) for t in args.tails.split(",") if t]
    only = [c for c in args.only.split(",") if c]
    groups = {"optimizer": (*OPTIMIZER_CASES, *CLIPPED_CASES), "views": VIEW_CASES}
    cfg["only"] = [c for o in only for c in groups.get(o, (o,))]
    print(f"ddp_overlap: 2 gloo ranks, {cfg}", flush=True)
    results = run_on_ranks(
        rank_main, 2, cfg, collective_timeout_s=120, total_timeout_s=3600, backend=backend_for(cfg)
    )
    report = build_report(
        summarize([r["wall"] for r in results], max),
        summarize([r["cpu"] for r in results], sum),
        cfg,
        results[0]["grad_bytes"],
    )
    print_table(report)
    if args.profile_dir is not None:
        report["profiled"] = profile_exposed_comm(cfg, args.profile_dir)
    write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
