"""In-layer overlap: tp and ep communication per step, synchronous against each overlapped mode.

Two emulated nodes (``bench.harness.two_nodes``: network namespaces joined by a veth pair
limited to ``--rate``, 8 Gbit/s by default) run two gloo ranks each, as ``bench.placement``
does (``bench.harness.two_node_bench``); the tp and ep groups sit inside a node, dp crosses the
link. Each case is trained exactly as overlapkit-train runs it (``bench.harness.train_layout``:
the config composed from overlapkit-train's groups, its mesh, wrapping and step):

- ``moe_tiny`` ep2 x dp2 (``parallel=ep_dp``): ``parallel.plan.ep_chunks`` 1 (sync), 2, 4;
- ``gpt_tiny`` tp2 x dp2 (``parallel=tp_dp``): ``parallel.plan.tp_comm`` sync, split, ring
  (where this checkout's ``parallel.plan`` has the key; a case it refuses is reported so).

Rounds run every case of a model once, in a rotating order, so that noise on the shared machine
hits all alike: one timed step (the slowest rank's wall time, and each rank's CPU time: the
process's, gloo's threads included), then two profiled steps (``ok.profile``: the first warms
the profiler and is discarded). Per case, the profiled steps' traces are analysed by
``overlapkit report``'s code, and the step's exposed communication of the case's dimension
(``dims``: tp or ep) is read from it, averaged over the ranks; the median over rounds is shown.
Tokens per second are the global batch's tokens over the median step. The planner's prediction
for each case is ``predict_step`` with the host terms measured here
(``bench.planner_ranking.calibrate``) and the case's mode (``StepOptions.ep_chunks``, and the tp
mode where ``StepOptions`` has a field of that name). Every case starts from the same weights and
trains on the same batches, so the modes must end with the same parameters as ``sync``: the
largest difference is printed.

On this machine the four ranks share two cores with gloo's transfer threads: hiding a transfer
behind compute cannot shorten a step whose cores are already busy, so the exposed time (what the
trace shows waiting) is the measure of the overlap, and the CPU time per step says what the
extra chunks cost. On GPUs the transfers run on the NIC and the copy engines, and the exposed
time saved is step time saved.

Example::

    python -m bench.inlayer_overlap --json bench/results/inlayer_overlap.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

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
from bench.planner_ranking import (
    CONFIGS,
    MOE,
    SHAPE,
    TENSOR_PARALLEL,
    calibrate,
    step_options,
)
from overlapkit.autoplan.group_costs import AxisCosts
from overlapkit.autoplan.models import train_model_spec
from overlapkit.autoplan.step_time import StepOptions, predict_step
from overlapkit.profiling.analysis import analyze_run
from overlapkit.train.parallel.mesh import split_parallel
from overlapkit.train.planning.host_calibration import one_rank_group

CASES = {
    "moe_tiny": {
        "ep sync": ("parallel=ep_dp", "parallel.plan.ep_chunks=1"),
        "ep chunks=2": ("parallel=ep_dp", "parallel.plan.ep_chunks=2"),
        "ep chunks=4": ("parallel=ep_dp", "parallel.plan.ep_chunks=4"),
    },
    "gpt_tiny": {
        "tp sync": ("parallel=tp_dp", "parallel.plan.tp_comm=sync"),
        "tp split": ("parallel=tp_dp", "parallel.plan.tp_comm=split"),
        "tp ring": ("parallel=tp_dp", "parallel.plan.tp_comm=ring"),
    },
}
DIM = {"moe_tiny": "ep", "gpt_tiny": "tp"}
"""The dimension whose exposed communication each model's cases compare."""
MODES = ("ep_chunks", "tp_comm", "tp_chunks")
"""``parallel.plan`` keys of the in-layer modes; the planner prices those ``StepOptions`` has."""


def run_config(name: str, case: str, args: argparse.Namespace) -> DictConfig:
    """overlapkit-train's config of ``case`` on model ``name``."""
    shape = SHAPE | (MOE if name == "moe_tiny" else {})
    return compose_run(
        [
            f"model={name}",
            *(f"model.config.{key}={value}" for key, value in shape.items()),
            f"train.batch_size={args.batch}",
            "train.grad_accum=1",
            "train.clip_grad_norm=null",
            "train.device=cpu",
            *CASES[name][case],
        ]
    )


def case_configs(name: str, args: argparse.Namespace) -> tuple[dict[str, DictConfig], dict]:
    """Each case's config, and why a case cannot run here (its mode's key refused)."""
    configs, refused = {}, {}
    for case in CASES[name]:
        try:
            config = run_config(name, case, args)
            split_parallel(config.parallel)
        except Exception as err:  # Hydra's composition error or PlanConfig's ValueError
            refused[case] = str(err).splitlines()[0]
            continue
        configs[case] = config
    return configs, refused


def predicted_step(
    name: str, config: DictConfig, options: StepOptions, predictor: ok.Topology
) -> dict:
    """The planner's step (``StepTime.to_dict``) of ``config``'s layout and in-layer mode."""
    plan, _ = split_parallel(config.parallel)
    fields = {f.name for f in dataclasses.fields(StepOptions)}
    mode = {key: getattr(plan, key) for key in MODES if key in fields and hasattr(plan, key)}
    layout = planned_layout(config, dist.get_world_size())
    spec = train_model_spec(CONFIGS[name], name=name)
    topology = predictor.with_accelerator(options.accelerator)
    step = predict_step(spec, layout, dataclasses.replace(options, **mode), AxisCosts(topology))
    return step.to_dict() | {"priced_mode": mode}


def full_parameters(run: LayoutRun) -> torch.Tensor:
    """Every parameter of the case's model, whole (DTensors gathered), flattened."""
    params = run.clock.par.model.parameters()
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]
    return torch.cat([t.reshape(-1) for t in full])


def _max_over_ranks(value: float) -> float:
    tensor = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def _mean_over_ranks(value: float) -> float:
    tensor = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()


def _timed_step(run: LayoutRun) -> tuple[float, float]:
    """(slowest rank's wall s, mean CPU s over ranks) of one step."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    run.step()
    return _max_over_ranks(time.perf_counter() - wall), _mean_over_ranks(time.process_time() - cpu)


def _profiled_steps(run: LayoutRun, logdir: Path) -> None:
    dist.barrier()
    with ok.profile(logdir, wait=0, warmup=1, active=1, record_shapes=True) as prof:
        for _ in range(2):
            run.step()
            prof.step()


def _exposed(logdir: Path, dim: str) -> dict[str, float]:
    """The profiled step's ``dim`` numbers (ms), averaged over the ranks (rank 0 reads)."""
    rows = analyze_run(logdir, jobs=1).steps
    picked = [row.dims.get(dim) for row in rows]
    return {
        "exposed_ms": statistics.mean(s.exposed_ms if s else 0.0 for s in picked),
        "time_ms": statistics.mean(s.time_ms if s else 0.0 for s in picked),
        "count": statistics.mean(s.count if s else 0 for s in picked),
        "step_exposed_ms": statistics.mean(row.exposed_comm_ms for row in rows),
    }


def measure(name: str, runs: dict[str, LayoutRun], traces: Path, args) -> dict[str, dict]:
    """Every case's timed and profiled steps, rounds interleaved (see the module docstring)."""
    cases = list(runs)
    for case in cases:  # warm-up: first steps allocate and connect
        for _ in range(args.warmup):
            runs[case].step()
    out = {c: {"wall_s": [], "cpu_s": [], "dims": []} for c in cases}
    for round_index in range(args.rounds):
        order = cases[round_index % len(cases) :] + cases[: round_index % len(cases)]
        for case in order:
            wall, cpu = _timed_step(runs[case])
            out[case]["wall_s"].append(wall)
            out[case]["cpu_s"].append(cpu)
            logdir = traces / name / case.replace(" ", "_") / f"round{round_index}"
            _profiled_steps(runs[case], logdir)
            dist.barrier()
            if dist.get_rank() == 0:
                out[case]["dims"].append(_exposed(logdir, DIM[name]))
            dist.barrier()
    reference = full_parameters(runs[cases[0]])
    for case in cases:
        difference = (full_parameters(runs[case]) - reference).abs().max().item()
        out[case]["max_parameter_difference_vs_sync"] = difference
    return out


def worker(args: argparse.Namespace) -> None:
    started = start_calibrated_worker(args)
    topology, predictor, calibration = started.topology, started.predictor, started.calibration
    overhead = started.overhead_s
    alone = one_rank_group()
    report: dict = {
        "nodes": [list(n) for n in topology.nodes()],
        "calibration": calibration,
        "collective_overhead_us": {tier: s * 1e6 for tier, s in overhead.items()},
    }
    with tempfile.TemporaryDirectory(prefix="ovk-inlayer-") as scratch:
        shared = [scratch]
        dist.broadcast_object_list(shared, src=0)  # every rank traces into rank 0's folder
        for name in args.models:
            configs, refused = case_configs(name, args)
            measured = calibrate(
                CONFIGS[name], alone, args, tensor_parallel=name in TENSOR_PARALLEL
            )
            options = step_options(measured, max(overhead.values()))
            runs = {case: layout_run(c, topology) for case, c in configs.items()}
            predicted = {
                c: predicted_step(name, cfg, options, predictor) for c, cfg in configs.items()
            }
            plan, _ = split_parallel(next(iter(configs.values())).parallel)
            shards = dist.get_world_size() // (plan.sizes.tp * plan.sizes.cp * plan.sizes.pp)
            report[name] = {
                "cases": measure(name, runs, Path(shared[0]), args),
                "predicted": predicted,
                "refused": refused,
                "descriptions": {case: run.description for case, run in runs.items()},
                "tokens_per_step": shards * args.batch * SHAPE["block_size"],
            }
        dist.barrier()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(report, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def summarise(report: dict, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Per model, one row per case: medians over rounds, and ratios to the sync case."""
    tables = {}
    for name in args.models:
        result = report[name]
        rows = []
        for case, got in result["cases"].items():
            step_s = statistics.median(got["wall_s"])
            dims = got["dims"]
            predicted = result["predicted"][case]
            rows.append(
                {
                    "case": case,
                    "exposed_ms": statistics.median(d["exposed_ms"] for d in dims),
                    "comm_ms": statistics.median(d["time_ms"] for d in dims),
                    "collectives": statistics.median(d["count"] for d in dims),
                    "step_ms": step_s * 1e3,
                    "cpu_ms": statistics.median(got["cpu_s"]) * 1e3,
                    "tokens_per_s": result["tokens_per_step"] / step_s,
                    "predicted_step_ms": predicted["step_s"] * 1e3,
                    "predicted_exposed_ms": predicted["exposed_s"][DIM[name]] * 1e3,
                    "predicted_hidden_share": predicted["hidden_share"].get(DIM[name], 0.0),
                    "max_parameter_difference_vs_sync": got["max_parameter_difference_vs_sync"],
                }
            )
        sync = rows[0]
        for row in rows:
            # The measured counterpart of the planner's hidden share: 1 - exposed / total.
            row["hidden_share"] = (
                1.0 - row["exposed_ms"] / row["comm_ms"] if row["comm_ms"] else 0.0
            )
            row["exposed_vs_sync"] = row["exposed_ms"] / sync["exposed_ms"]
            row["step_vs_sync"] = row["step_ms"] / sync["step_ms"]
        tables[name] = rows
    return tables


def render(report: dict, tables: dict[str, list[dict]], args: argparse.Namespace) -> str:
    lines = [
        f"in-layer overlap: 2 emulated nodes x 2 gloo ranks, link {args.rate}; tp / ep inside "
        f"a node; {args.rounds} rounds, batch {args.batch} x {SHAPE['block_size']} tokens "
        f"per replica; {report.get('load', '')}",
        "",
        f"{'case':<13} {'exposed':>8} {'comm':>7} {'vs sync':>7} {'step':>8} {'vs sync':>7} "
        f"{'hidden':>6} {'cpu/rank':>8} {'tok/s':>8} {'pred step':>9} {'pred exp':>8} "
        f"{'pred hid':>8} {'|dw|':>8}",
    ]
    for name, rows in tables.items():
        lines.append(f"{name} ({DIM[name]}; ms per step, medians over rounds):")
        for r in rows:
            lines.append(
                f"{r['case']:<13} {r['exposed_ms']:>8.2f} {r['comm_ms']:>7.2f} "
                f"{r['exposed_vs_sync']:>7.2f} {r['step_ms']:>8.1f} {r['step_vs_sync']:>7.2f} "
                f"{r['hidden_share']:>6.0%} {r['cpu_ms']:>8.1f} {r['tokens_per_s']:>8.0f} "
                f"{r['predicted_step_ms']:>9.1f} {r['predicted_exposed_ms']:>8.2f} "
                f"{r['predicted_hidden_share']:>8.0%} "
                f"{r['max_parameter_difference_vs_sync']:>8.1e}"
            )
        for case, why in report[name]["refused"].items():
            lines.append(f"{case:<13} not run: {why}")
    return "\n".join(lines)


def launch(args: argparse.Namespace) -> dict:
    flags = forwarded_flags(args, ("batch", "rounds", "warmup", "models", *CALIBRATION_FLAGS))
    return run_workers("bench.inlayer_overlap", args, flags)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="8gbit", help="link rate per direction (8gbit)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per replica (8)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per case (2)")
    parser.add_argument(
        "--models", nargs="+", default=list(CASES), choices=list(CASES), help="models"
    )
    add_calibration_arguments(
        parser,
        calibrate_steps=5,
        latency_probes=20,
        probe_work=2,
        overlap_trials=3,
        optimizer_steps=11,
    )
    add_two_node_arguments(parser, timeout_s=1200)
    return parser.parse_args(argv)


def drive(args: argparse.Namespace) -> int:
    load_before = os.getloadavg()[0]
    report = launch(args)
    report["load"] = f"load {load_before:.2f} before, {os.getloadavg()[0]:.2f} after (1-minute)"
    tables = summarise(report, args)
    print(render(report, tables, args))
    write_json_report(Path(args.json) if args.json else None, report | {"tables": tables})
    return 0


def main(argv: list[str] | None = None) -> int:
    return two_node_main("inlayer_overlap", argv, parse_args=parse_args, worker=worker, drive=drive)


if __name__ == "__main__":
    sys.exit(main())
