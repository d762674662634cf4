"""Pipeline schedules side by side: measured bubble, data-parallel exposure and step against the
planner's, on 4 gloo ranks across two emulated nodes.

Two emulated nodes (``bench.harness.two_nodes``: network namespaces joined by a veth pair
limited to ``--rate``, 8 Gbit/s by default) run two gloo ranks each, as ``bench.placement`` and
``bench.planner_ranking`` do (``bench.harness.two_node_bench``). Every rank fits the cost model
to this machine and measures the host terms the planner's ``StepOptions`` take
(``bench.planner_ranking.calibrate``). Then gpt_tiny with 8 layers trains, exactly as
overlapkit-train runs it (``bench.harness.train_layout``: ``parallel=pp_dp``, the stages' ok.ddp
in one bucket, ``train.grad_accum`` micro-batches per step), in two shapes:

- ``pp2_dp2``: 2 pipeline stages across the link (ok.plan puts pp outermost) x dp = 2 inside
  each node;
- ``pp4``: 4 stages, the link between the second and the third;

each under every schedule of ``SCHEDULES`` that overlapkit-train runs (one it refuses is
reported with its one-line refusal and skipped). Rounds run every (shape, schedule) once, in a
rotating order, so noise on the shared machine hits all alike: one step timed (the slowest
rank's), then one step profiled (``ok.profile``, after one warm-up step). From each profiled
step's report, per rank: the exposed pipeline send/recv (``send_recv`` exposed: the bubble,
waiting for the neighbour stage, plus the transfers) and the exposed all-reduces (``all_reduce``:
the data-parallel reduction, and the tied embedding's between the first and last stage).
Reported per run: medians over rounds of the step, of the bubble (mean over the ranks) and its
share of the step, of the data-parallel exposure (the slowest rank's), and the planner's
predicted step and bubble for the same layout (``autoplan.pipeline_schedule``).

Four ranks share this machine's cores: a waiting stage gives its core to a computing one, so
wall time blurs what a dedicated core per rank would show (``bench.planner_ranking`` found the
same); the bubble read from the trace is the time a rank waits, which the sharing changes too.

Example::

    python -m bench.pipeline_schedules --json bench/results/pipeline_schedules.json
    python -m bench.pipeline_schedules --rounds 3 --micro-batches 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import overlapkit as ok
from bench.harness.json_report import write_json_report
from bench.harness.train_layout import LayoutRun, compose_run, layout_run, planned_layout
from bench.harness.two_node_bench import (
    CALIBRATION_FLAGS,
    add_calibration_arguments,
    add_two_node_arguments,
    forwarded_flags,
    run_workers,
    start_calibrated_worker,
    two_node_main,
)
from bench.planner_ranking import ONE_BUCKET, calibrate, predictions
from overlapkit.autoplan.models import train_model_spec
from overlapkit.autoplan.pipeline_schedule import SHAPES as PRICED
from overlapkit.train.launch.cli import check_job
from overlapkit.train.launch.elastic import LauncherConfig
from overlapkit.train.models import GPTConfig
from overlapkit.train.planning.host_calibration import one_rank_group

SHAPE = dict(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=128)
CONFIG = GPTConfig(**SHAPE)
PIPELINES = {"pp2_dp2": 2, "pp4": 4}
"""Shape name -> pipeline stages (ranks) of the 4; dp is what is left."""
SCHEDULES = {
    "1F1B": 1,
    "Interleaved1F1B": 2,
    "InterleavedZeroBubble": 2,
    "ZBVZeroBubble": 2,
    "DualPipeV": 2,
}
"""Schedule -> stages per rank (``parallel.plan.virtual_stages``)."""


def run_overrides(pp: int, schedule: str, args: argparse.Namespace) -> list[str]:
    """overlapkit-train's overrides of gpt_tiny (``SHAPE``) on ``pp`` stages under ``schedule``."""
    return [
        "model=gpt_tiny",
        *(f"model.config.{key}={value}" for key, value in SHAPE.items()),
        f"train.batch_size={args.batch}",
        f"train.grad_accum={args.micro_batches}",
        "train.clip_grad_norm=null",
        "train.device=cpu",
        "parallel=pp_dp",
        ONE_BUCKET,
        f"parallel.plan.pp={pp}",
        f"parallel.plan.schedule={schedule}",
        f"parallel.plan.virtual_stages={SCHEDULES[schedule]}",
    ]


def build_runs(args: argparse.Namespace, topology: ok.Topology) -> tuple[dict, dict, dict]:
    """(runs, their layouts, refusals) of every (shape, schedule) asked for."""
    runs, layouts, refused = {}, {}, {}
    for shape, pp in PIPELINES.items():
        for schedule in args.schedules:
            name = f"{shape} {schedule}"
            config = compose_run(run_overrides(pp, schedule, args))
            try:  # what overlapkit-train checks before it starts a worker; every rank alike
                check_job(config, LauncherConfig(nnodes=1, nproc_per_node=4))
            except ValueError as err:
                refused[name] = str(err).splitlines()[0]
                continue
            runs[name] = layout_run(config, topology)
            layouts[name] = planned_layout(config, dist.get_world_size())
    return runs, layouts, refused


def profiled_step(run: LayoutRun, logdir: Path) -> tuple[float, float, float, float]:
    """(step, exposed send/recv, exposed all-reduce, compute) ms of one profiled step on this
    rank."""
    with ok.profile(logdir, wait=0, warmup=1, active=1, write_outputs=False) as prof:
        for _ in range(2):
            run.step()
            prof.step()
    step = prof.summary()[-1]

    def exposed(kind: str) -> float:
        stats = step.kinds.get(kind)
        return 0.0 if stats is None else stats.exposed_ms

    return step.step_ms, exposed("send_recv"), exposed("all_reduce"), step.compute_ms


def measure(runs: dict[str, LayoutRun], args: argparse.Namespace, scratch: Path) -> dict:
    """Per run and round: the timed step (slowest rank, s) and each rank's profiled figures."""
    names = list(runs)
    for name in names:  # warm-up: first steps allocate and connect
        for _ in range(args.warmup):
            runs[name].step()
    rows: dict[str, dict[str, list]] = {n: {"step_s": [], "profiled": []} for n in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            runs[name].step()
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            rows[name]["step_s"].append(elapsed.item())
            logdir = scratch / name.replace(" ", "_") / str(round_index)
            mine = torch.tensor(profiled_step(runs[name], logdir), dtype=torch.float64)
            every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            rows[name]["profiled"].append([t.tolist() for t in every])
    return rows


def worker(args: argparse.Namespace) -> None:
    started = start_calibrated_worker(args)
    topology, predictor, calibration = started.topology, started.predictor, started.calibration
    overhead = started.overhead_s
    measured = calibrate(CONFIG, one_rank_group(), args, tensor_parallel=False)
    runs, layouts, refused = build_runs(args, topology)
    if not runs:
        raise RuntimeError(f"overlapkit-train refuses every run asked for: {refused}")
    spec = train_model_spec(CONFIG, name="gpt_tiny")
    predicted = predictions(spec, layouts, predictor, max(overhead.values()), measured)
    with tempfile.TemporaryDirectory(prefix=f"ovk-pipeline-rank{dist.get_rank()}-") as scratch:
        rows = measure(runs, args, Path(scratch))
    if dist.get_rank() == 0:
        report = {
            "nodes": [list(n) for n in topology.nodes()],
            "calibration": calibration,
            "measured_terms": measured,
            "refused": refused,
            "layouts": {n: lay.describe() for n, lay in layouts.items()},
            "descriptions": {n: run.description for n, run in runs.items()},
            "predicted": predicted,
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(report, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def summarize(report: dict) -> dict[str, dict]:
    """Per run: medians over rounds of the step, bubble (mean over ranks), its share, the
    data-parallel exposure (slowest rank), and the planner's predicted step and bubble (ms)."""
    out = {}
    for name, rows in report["rows"].items():
        bubbles = [statistics.fmean(r[1] for r in ranks) for ranks in rows["profiled"]]
        shares = [
            statistics.fmean(r[1] / r[0] for r in ranks if r[0] > 0) for ranks in rows["profiled"]
        ]
        dp = [max(r[2] for r in ranks) for ranks in rows["profiled"]]
        compute = [statistics.fmean(r[3] for r in ranks) for ranks in rows["profiled"]]
        step = report["predicted"][name]
        out[name] = {
            "step_ms": statistics.median(rows["step_s"]) * 1e3,
            "bubble_ms": statistics.median(bubbles),
            "bubble_share": statistics.median(shares),
            "dp_exposed_ms": statistics.median(dp),
            "compute_ms": statistics.median(compute),
            "profiled_step_ms": statistics.median(
                statistics.fmean(r[0] for r in ranks) for ranks in rows["profiled"]
            ),
            "predicted_step_ms": step["step_s"] * 1e3,
            "predicted_bubble_ms": step["bubble_s"] * 1e3,
            "predicted_bubble_share": step["bubble_s"] / step["step_s"],
            "predicted_compute_ms": step["compute_s"] * 1e3,
        }
    return out


def render(report: dict, summary: dict, args: argparse.Namespace) -> str:
    lines = [
        f"pipeline schedules: gpt_tiny ({SHAPE['n_layer']} layers), 2 emulated nodes x 2 gloo "
        f"ranks, link {args.rate}, {args.micro_batches} micro-batches of {args.batch} x "
        f"{SHAPE['block_size']} tokens per replica and step, {args.rounds} rounds; "
        f"load {report['load']}",
        f"  {'run':<29} {'step':>7} {'bubble':>7} {'share':>6} {'dp exp':>7} {'compute':>7} "
        f"{'pred step':>9} {'pred bubble':>11} {'share':>6} {'compute':>7}",
    ]
    for name, row in summary.items():
        lines.append(
            f"  {name:<29} {row['step_ms']:>7.1f} {row['bubble_ms']:>7.1f} "
            f"{row['bubble_share']:>6.1%} {row['dp_exposed_ms']:>7.1f} {row['compute_ms']:>7.1f} "
            f"{row['predicted_step_ms']:>9.1f} {row['predicted_bubble_ms']:>11.1f} "
            f"{row['predicted_bubble_share']:>6.1%} {row['predicted_compute_ms']:>7.1f}"
        )
    lines.append(
        "  (ms; step: unprofiled, slowest rank; bubble: exposed send/recv of a profiled step, mean "
        "over ranks, and its share of that step; dp exp: exposed all-reduce, slowest rank; "
        "compute: a rank's compute in the profiled step, mean over ranks)"
    )
    for name, why in report["refused"].items():
        lines.append(f"  {name}: refused: {why}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="8gbit", help="link rate per direction (8gbit)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch (2)")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=8,
        help="micro-batches per step (train.grad_accum), >= 8: DualPipeV's 2 x pp4 (8)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds (5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run (2)")
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=list(SCHEDULES),
        choices=list(SCHEDULES),
        help="schedules side by side (all)",
    )
    add_calibration_arguments(
        parser,
        calibrate_steps=7,
        latency_probes=20,
        probe_work=2,
        overlap_trials=3,
        optimizer_steps=11,
    )
    add_two_node_arguments(parser, timeout_s=1500)
    args = parser.parse_args(argv)
    unpriced = [s for s in args.schedules if s not in PRICED]
    if unpriced:
        parser.error(f"--schedules {unpriced} are not priced by the planner")
    return args


def launch(args: argparse.Namespace) -> dict:
    flags = forwarded_flags(
        args, ("batch", "micro_batches", "rounds", "warmup", "schedules", *CALIBRATION_FLAGS)
    )
    return run_workers("bench.pipeline_schedules", args, flags)


def drive(args: argparse.Namespace) -> int:
    """The driver: launch the workers, summarise, print, write ``--json``."""
    load_before = os.getloadavg()[0]
    report = launch(args)
    report["load"] = f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after (1-minute)"
    report["summary"] = summarize(report)
    print(render(report, report["summary"], args))
    write_json_report(Path(args.json) if args.json else None, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    return two_node_main(
        "pipeline_schedules", argv, parse_args=parse_args, worker=worker, drive=drive
    )


if __name__ == "__main__":
    sys.exit(main())
