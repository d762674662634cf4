"""Does the auto-planner rank layouts the way they run? 4 gloo ranks on two emulated nodes.

Two emulated nodes (``bench.harness.two_nodes``: network namespaces joined by a veth pair
limited to ``--rate``) run two gloo ranks each, as ``bench.placement`` does
(``bench.harness.two_node_bench``). Every rank detects the topology (2 nodes x 2 ranks), fits
the cost model to this machine (``two_node_bench.calibrated_topology``: the link, and the
in-node path while both nodes use theirs) and measures the host terms the planner's
``StepOptions`` take (``overlapkit.train.planning.host_calibration``): the model's own compute rate
(the planner's "achievable TFLOP/s" here), the tensor-parallel plan's dispatch per layer pass
(``tp_layer_dispatch_s``), what one collective call costs between busy ranks
(``collective_overhead_s``: milliseconds here, where four ranks share two cores), the AdamW
step per plain and per DTensor parameter tensor and per parameter (``optimizer_tensor_s``,
``optimizer_dtensor_s``, ``optimizer_param_s``) and the share of the compute that all-reduces
over the link hide behind (``overlap_efficiency``). The planner prices each layout as
overlapkit-train runs it (``autoplan.framework.OVERLAPKIT_TRAIN``; the layout is the one a run
of that config prices itself with, ``overlapkit.train.parallel.run_layout``). Then, for each
model (``gpt_tiny``, ``moe_tiny``), it trains every layout below exactly as overlapkit-train
runs it: the config composed from overlapkit-train's own groups (``overlapkit/conf``), its mesh
(``overlapkit.train.parallel.mesh.build_layout``), its wrapping
(``overlapkit.train.run.step.wrap_model``:
context parallelism, recomputation, the pipeline or the ``parallel`` group's wrapper) and its
step (``overlapkit.train.run.step.train_step``, ``train.grad_accum`` micro-batches of
``train.batch_size`` sequences from ``data=synthetic``; no clipping, which the planner does not
price). Every ok.ddp / ok.GradBucketer reduces in one 25 MiB bucket, as the planner's
Megatron-LM bucket rule gives for these models.

- ``ddp``: ``parallel=ddp`` over dp = 4 (the MoE model: ``parallel=bucketer``)
- ``fsdp``: ``parallel=fsdp`` over dp = 4
- ``hsdp``: ``parallel=hsdp``, sharded over dp_shard = 2 ranks, replicated over 2
- ``tp2``: ``parallel=tp_dp``, tensor parallel inside each node, dp = 2 (gpt_tiny)
- ``ep2``: ``parallel=ep_dp``, experts over 2 ranks inside each node, dp = 2 (moe_tiny)
- ``pp2``: ``parallel=pp_dp``, 2 pipeline stages (1F1B over the step's micro-batches) x dp = 2
- ``cp2``: ``parallel=cp_dp``, each sequence split over 2 ranks (K/V all-gathered) x dp = 2
- ``zero1``, ``zero2``: ``parallel=zero1`` / ``zero2`` (``ok.fsdp(zero=1|2)``) over dp = 4
- ``full``, ``selective``: ``parallel=ddp`` with ``train.recompute=full`` / ``selective``

Rounds run every layout once, in a rotating order, so noise on a shared machine hits all alike;
a step's time is the slowest rank's. Per layout: its measured median step over the predicted one.
Per pair of layouts: the median over rounds of their time ratio, the noise (half the
interquartile range of that ratio), and whether the planner's predicted step times order them
the same way. The planner's top choice must be the measured fastest or within the noise of it.
Every layout runs ``--micro-batches`` micro-batches of ``--batch`` sequences per data-parallel
replica and step (a pipeline needs as many as it has stages, and ZeRO-2 differs from ZeRO-1
only with more than one); the layouts with dp = 2 therefore take half the global batch.

Example::

    python -m bench.planner_ranking --json bench/results/planner_ranking.json
    python -m bench.planner_ranking --rate 1gbit --rounds 9    # compute-bound: CPU costs decide
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

import overlapkit as ok
from bench.harness.json_report import write_json_report
from bench.harness.train_layout import PHASES, LayoutRun, compose_run, layout_run, planned_layout
from bench.harness.two_node_bench import (
    CALIBRATION_FLAGS,
    add_calibration_arguments,
    add_two_node_arguments,
    forwarded_flags,
    run_workers,
    start_calibrated_worker,
    two_node_main,
)
from overlapkit.autoplan.compute import measured_accelerator
from overlapkit.autoplan.framework import OVERLAPKIT_TRAIN
from overlapkit.autoplan.group_costs import AxisCosts
from overlapkit.autoplan.memory import FP32
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.models import train_model_spec
from overlapkit.autoplan.step_time import StepOptions, predict_step
from overlapkit.layout import TrainingLayout
from overlapkit.train.models import GPT, GPTConfig, MoEConfig, MoEGPT
from overlapkit.train.planning.host_calibration import (
    compute_calibration,
    one_rank_group,
    optimizer_calibration,
    overlap_calibration,
    slowest_medians,
)

TENSOR_PARALLEL = ("gpt_tiny",)
"""The models with a tensor-parallel layout (moe_tiny's experts go over ep instead)."""
SHAPE = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
MOE = dict(n_expert=4, top_k=2, expert_hidden=256)
ONE_BUCKET = "parallel.bucket_mb=25"
"""ok.ddp's bucket size: one bucket for these models, as the planner's bucket rule has it."""
DDP = ("parallel=ddp", ONE_BUCKET)
# name -> overlapkit-train overrides of the layout (the model, batch and micro-batches are
# the run's, ``run_config``).
LAYOUTS = {
    "gpt_tiny": {
        "ddp": DDP,
        "fsdp": ("parallel=fsdp",),
        "hsdp": ("parallel=hsdp",),
        "tp2": ("parallel=tp_dp",),
        "pp2": ("parallel=pp_dp", ONE_BUCKET),
        "cp2": ("parallel=cp_dp", ONE_BUCKET),
        "zero1": ("parallel=zero1",),
        "zero2": ("parallel=zero2",),
        "full": (*DDP, "train.recompute=full"),
        "selective": (*DDP, "train.recompute=selective"),
    },
    "moe_tiny": {
        "ddp": ("parallel=bucketer",),
        "fsdp": ("parallel=fsdp",),
        "hsdp": ("parallel=hsdp",),
        "ep2": ("parallel=ep_dp",),
    },
}


CONFIGS = {"gpt_tiny": GPTConfig(**SHAPE), "moe_tiny": MoEConfig(**SHAPE, **MOE)}


def run_config(name: str, layout_name: str, args: argparse.Namespace) -> DictConfig:
    """overlapkit-train's config of ``layout_name`` on model ``name`` (``CONFIGS``' shape)."""
    shape = SHAPE | (MOE if name == "moe_tiny" else {})
    overrides = [
        f"model={name}",
        *(f"model.config.{key}={value}" for key, value in shape.items()),
        f"train.batch_size={args.batch}",
        f"train.grad_accum={args.micro_batches}",
        "train.clip_grad_norm=null",
        "train.device=cpu",
        *LAYOUTS[name][layout_name],
    ]
    return compose_run(overrides)


def planner_spec(name: str) -> ModelSpec:
    """gpt_tiny / moe_tiny as the planner describes them."""
    return train_model_spec(CONFIGS[name], name=name)


def make_model(config: GPTConfig | MoEConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return (MoEGPT if isinstance(config, MoEConfig) else GPT)(config)


def batch(
    rank: int, args: argparse.Namespace, config: GPTConfig | MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of random tokens, for the host calibration."""
    generator = torch.Generator().manual_seed(100 + rank)
    shape = (args.batch, config.block_size + 1)
    idx = torch.randint(config.vocab_size, shape, generator=generator)
    return idx[:, :-1], idx[:, 1:]


def calibrate(
    config: GPTConfig | MoEConfig,
    alone: dist.ProcessGroup,
    args: argparse.Namespace,
    *,
    tensor_parallel: bool,
) -> dict:
    """The model's host terms for the planner (``overlapkit.train.planning.host_calibration``);
    ``tensor_parallel``: also its tensor-parallel dispatch."""
    inputs, targets = batch(dist.get_rank(), args, config)
    spec = train_model_spec(config, name="calibrated")
    flops = spec.model_flops_per_token(config.block_size) * args.batch * config.block_size
    rate, dispatch_s = compute_calibration(
        functools.partial(make_model, config),
        inputs,
        targets,
        flops=flops,
        layers=config.n_layer,
        tensor_parallel=tensor_parallel,
        alone=alone,
        steps=args.calibrate_steps,
    )
    overlap = overlap_calibration(make_model(config), inputs, targets, trials=args.overlap_trials)
    return {
        "compute_GFLOPs": rate / 1e9,
        "tp_layer_dispatch_s": dispatch_s,
        "overlap": overlap,
        **optimizer_calibration(make_model(config), alone=alone, steps=args.optimizer_steps),
    }


def step_options(measured: dict, overhead_s: float) -> StepOptions:
    """How the planner prices a step of these models here: the host terms ``measured``
    (``calibrate``), every collective call's ``overhead_s``, as overlapkit-train runs it."""
    return StepOptions(
        seq_len=SHAPE["block_size"],
        accelerator=measured_accelerator(measured["compute_GFLOPs"] / 1e3, memory_GB=8),
        achievable=1.0,  # the rate is the model's own, measured
        overlap_efficiency=measured["overlap"]["overlap_efficiency"],
        precision=FP32,
        framework=OVERLAPKIT_TRAIN,
        collective_overhead_s=overhead_s,
        tp_layer_dispatch_s=measured["tp_layer_dispatch_s"],
        optimizer_tensor_s=measured["optimizer_tensor_s"],
        optimizer_dtensor_s=measured["optimizer_dtensor_s"],
        optimizer_param_s=measured["optimizer_param_s"],
    )


def predictions(
    spec: ModelSpec,
    layouts: dict[str, TrainingLayout],
    predictor: ok.Topology,
    overhead_s: float,
    measured: dict,
) -> dict[str, dict]:
    """The planner's predicted step of every layout of ``spec`` (``StepTime.to_dict``:
    seconds), as overlapkit-train runs it, with the host terms ``measured`` here
    (``calibrate``), for sequences of ``SHAPE``'s ``block_size``."""
    options = step_options(measured, overhead_s)
    costs = AxisCosts(predictor.with_accelerator(options.accelerator))
    refused = {n: OVERLAPKIT_TRAIN.refusal(lay, layers=spec.layers) for n, lay in layouts.items()}
    refused = {n: why for n, why in refused.items() if why is not None}
    if refused:  # the layouts are overlapkit-train's own: the framework must run every one
        raise ValueError(f"{OVERLAPKIT_TRAIN.name} refuses {refused}")
    return {n: predict_step(spec, lay, options, costs).to_dict() for n, lay in layouts.items()}


def measure_model(
    runs: dict[str, LayoutRun], args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Each layout's step times (slowest rank, per round) and its phases' medians (ms, the
    slowest rank's)."""
    names = list(runs)
    for layout_name in names:  # warm-up: first steps allocate and connect
        for _ in range(args.warmup):
            runs[layout_name].step()
    times: dict[str, list[float]] = {n: [] for n in names}
    phases: dict[str, list[list[float]]] = {n: [] for n in names}
    for round_index in range(args.rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for layout_name in order:
            dist.barrier()
            start = time.perf_counter()
            phases[layout_name].append(runs[layout_name].step())
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[layout_name].append(elapsed.item())
    medians = {}
    for layout_name, rows in phases.items():
        slowest = slowest_medians(list(zip(*rows, strict=True)))
        medians[layout_name] = dict(zip(PHASES, (t * 1e3 for t in slowest), strict=True))
    return times, medians


def worker(args: argparse.Namespace) -> None:
    started = start_calibrated_worker(args)
    topology, predictor, calibration = started.topology, started.predictor, started.calibration
    overhead = started.overhead_s
    alone = one_rank_group()
    report = {
        "nodes": [list(n) for n in topology.nodes()],
        "calibration": calibration,
        "collective_overhead_us": {tier: s * 1e6 for tier, s in overhead.items()},
    }
    for name in args.models:
        configs = {n: run_config(name, n, args) for n in LAYOUTS[name]}
        layouts = {n: planned_layout(c, dist.get_world_size()) for n, c in configs.items()}
        measured = calibrate(CONFIGS[name], alone, args, tensor_parallel=name in TENSOR_PARALLEL)
        overhead_s = max(overhead.values())
        predicted = predictions(planner_spec(name), layouts, predictor, overhead_s, measured)
        runs = {n: layout_run(c, topology) for n, c in configs.items()}
        report[name] = {
            "measured_terms": measured,
            "planned_layouts": {n: lay.describe() for n, lay in layouts.items()},
            "predicted_s": {layout: step["step_s"] for layout, step in predicted.items()},
            "predicted_parts": predicted,
            "descriptions": {n: run.description for n, run in runs.items()},
        }
        report[name]["measured_s"], report[name]["measured_phases_ms"] = measure_model(runs, args)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(report, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def compare(measured: dict[str, list[float]], predicted: dict[str, float]) -> dict:
    """Pairs: measured median ratio, noise, predicted ratio, agreement; and the top choice."""
    pairs = []
    for a, b in itertools.combinations(measured, 2):
        ratios = sorted(x / y for x, y in zip(measured[a], measured[b], strict=True))
        median = statistics.median(ratios)
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else (median,) * 3
        noise = (q3 - q1) / 2
        predicted_ratio = predicted[a] / predicted[b]
        significant = abs(median - 1) > noise
        agree = (median > 1) == (predicted_ratio > 1)
        pairs.append(
            {
                "pair": [a, b],
                "measured_ratio": median,
                "noise": noise,
                "predicted_ratio": predicted_ratio,
                "significant": significant,
                "same_order": agree,
            }
        )
    medians = {name: statistics.median(t) for name, t in measured.items()}
    fastest = min(medians, key=medians.get)
    top = min(predicted, key=predicted.get)
    top_pair = next((p for p in pairs if set(p["pair"]) == {top, fastest}), None)
    top_ok = top == fastest or (top_pair is not None and not top_pair["significant"])
    return {
        "pairs": pairs,
        "medians_s": medians,
        "measured_over_predicted": {n: medians[n] / predicted[n] for n in medians},
        "measured_fastest": fastest,
        "planner_top": top,
        "top_within_noise": top_ok,
        "ordered_right": all(p["same_order"] for p in pairs if p["significant"]),
    }


def phase_text(phases_ms: dict[str, float]) -> str:
    """``forward 57 backward 160 finish_backward 0 optimizer 7 ms``; a pipeline's forwards and
    backwards as one ``schedule``."""
    parts = dict(phases_ms)
    if parts["forward"] == 0:  # the schedule calls the stages, not the model
        parts = {"schedule": parts.pop("backward")} | {
            k: v for k, v in parts.items() if k != "forward"
        }
    return " ".join(f"{p} {ms:.0f}" for p, ms in parts.items()) + " ms"


def render(report: dict, args: argparse.Namespace) -> str:
    lines = [
        f"planner ranking: 2 emulated nodes x 2 gloo ranks, link {args.rate}, "
        f"{args.micro_batches} micro-batches of {args.batch} x {SHAPE['block_size']} tokens per "
        f"replica and step, {args.rounds} rounds; load {report['load']}",
    ]
    for tier, fit in report["calibration"].items():
        lines.append(
            f"calibrated {tier}: {fit['bandwidth_GBps']:.3g} GB/s, {fit['latency_us']:.3g} us"
        )
    lines.append(
        "a tiny all-reduce between busy ranks (the predictions' collective_overhead_s, the "
        "larger): "
        + ", ".join(f"{t} {us:.0f} us" for t, us in report["collective_overhead_us"].items())
    )
    for name in args.models:
        result = report[name]
        terms = result["measured_terms"]
        overlap = terms["overlap"]
        verdict = result["comparison"]
        lines += [
            "",
            f"{name}: measured compute {terms['compute_GFLOPs']:.3g} GFLOP/s per rank"
            + (
                f", tp dispatch {terms['tp_layer_dispatch_s'] * 1e3:.3g} ms per layer pass"
                if name in TENSOR_PARALLEL
                else ""
            )
            + f"; AdamW {terms['optimizer_tensor_s'] * 1e6:.3g} us per tensor, "
            f"{terms['optimizer_dtensor_s'] * 1e6:.3g} us per DTensor, "
            f"{terms['optimizer_param_s'] * 1e9:.3g} ns per parameter; overlap efficiency "
            f"{overlap['overlap_efficiency']:.2f} (all-reduces {overlap['comm_s'] * 1e3:.0f} ms, "
            f"compute {overlap['window_s'] * 1e3:.0f} ms, both {overlap['both_s'] * 1e3:.0f} ms)",
            f"  {'layout':<9} {'measured (median)':>18} {'predicted':>10} {'meas/pred':>9}  "
            "as the planner prices it",
        ]
        for layout_name, median in verdict["medians_s"].items():
            lines.append(
                f"  {layout_name:<9} {median * 1e3:>15.1f} ms "
                f"{result['predicted_s'][layout_name] * 1e3:>7.1f} ms "
                f"{verdict['measured_over_predicted'][layout_name]:>9.2f}  "
                f"{result['planned_layouts'][layout_name]}"
            )
            lines.append(f"  {'':<9} {phase_text(result['measured_phases_ms'][layout_name])}")
        lines.append(f"  {'pair':<19} {'measured':>9} {'noise':>7} {'predicted':>9}  order")
        for p in verdict["pairs"]:
            mark = "same" if p["same_order"] else "REVERSED"
            if not p["significant"]:
                mark += " (within noise)"
            lines.append(
                f"  {p['pair'][0] + '/' + p['pair'][1]:<19} {p['measured_ratio']:>9.3f} "
                f"{p['noise']:>7.3f} {p['predicted_ratio']:>9.3f}  {mark}"
            )
        lines.append(
            f"  planner's top {verdict['planner_top']}, measured fastest "
            f"{verdict['measured_fastest']}: "
            + ("agrees" if verdict["top_within_noise"] else "DISAGREES beyond the noise")
            + "; pairs beyond the noise "
            + ("all ordered the same way" if verdict["ordered_right"] else "NOT all ordered")
        )
    return "\n".join(lines)


def launch(args: argparse.Namespace) -> dict:
    """Run the workers on two emulated nodes; rank 0's report."""
    flags = forwarded_flags(
        args, ("batch", "micro_batches", "rounds", "warmup", "models", *CALIBRATION_FLAGS)
    )
    return run_workers("bench.planner_ranking", args, flags)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # At 200 Mbit/s the link carries a gradient all-reduce in about as long as a step computes
    # here, as a NIC does for a large model; at 1 Gbit/s this CPU's per-call costs dominate.
    parser.add_argument("--rate", default="200mbit", help="link rate per direction (200mbit)")
    parser.add_argument(
        "--batch", type=int, default=8, help="sequences per micro-batch and replica (8)"
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=2,
        help="micro-batches per step (train.grad_accum), >= 2: pp2's stages (2)",
    )
    parser.add_argument("--rounds", type=int, default=7, help="paired rounds, >= 5 (7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per layout (2)")
    parser.add_argument(
        "--models", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS), help="models"
    )
    add_calibration_arguments(
        parser,
        calibrate_steps=11,
        latency_probes=30,
        probe_work=2,
        overlap_trials=5,
        optimizer_steps=31,
    )
    add_two_node_arguments(parser, timeout_s=900)
    args = parser.parse_args(argv)
    if args.micro_batches < 2:
        parser.error(
            f"--micro-batches must be >= 2 (pp2's 1F1B keeps 2 in flight), got {args.micro_batches}"
        )
    if args.rounds < 5:
        parser.error(f"--rounds must be >= 5 (medians of paired rounds), got {args.rounds}")
    return args


def drive(args: argparse.Namespace) -> int:
    """The driver: launch the workers, compare, print, write ``--json``; 1 on a disagreement."""
    load_before = os.getloadavg()[0]
    report = launch(args)
    report["load"] = f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after (1-minute)"
    for name in args.models:
        result = report[name]
        result["comparison"] = compare(result["measured_s"], result["predicted_s"])
    print(render(report, args))
    write_json_report(Path(args.json) if args.json else None, report)
    ok_all = all(
        report[n]["comparison"]["top_within_noise"] and report[n]["comparison"]["ordered_right"]
        for n in args.models
    )
    return 0 if ok_all else 1


def main(argv: list[str] | None = None) -> int:
    return two_node_main("planner_ranking", argv, parse_args=parse_args, worker=worker, drive=drive)


if __name__ == "__main__":
    sys.exit(main())
