"""Placement benchmark: one TP x DP training step, laid out by ``ok.plan`` and laid out wrong.

Two emulated nodes (``bench.harness.two_nodes``: network namespaces joined by a veth pair limited to
``--rate``) run two gloo ranks each, started through torchrun's multi-node c10d rendezvous. Every
rank detects the topology (it must find 2 nodes x 2 ranks) and calibrates the cost model on it with
``overlapkit calibrate``'s all-reduce fit: scale-out from one rank per node (the link), and scale-up
with both nodes' pairs all-reducing at once, because the emulated nodes share this machine's cores
and loopback copies cost CPU (on real nodes each would have its own). Then:

- **planned**: ``ok.plan(topology, tp=2)``: tp inside each node, dp across the link.
- **tp_across_link**: the same sizes with tp outside dp (``order=(..., "tp", "dp")``,
  ``allow_split=True``): tp pairs cross the link, dp stays inside the nodes.

Both run the same step on the same data: an MLP whose Linear layers alternate
``ColwiseParallel`` / ``RowwiseParallel`` (torch's ``parallelize_module`` over ``mesh["tp"]``), then
one flat all-reduce of the local gradient shards over ``mesh["dp"]``, then SGD. Per step, the tp
group all-reduces ``batch x width`` fp32 activations ``layers - 1`` times (each Rowwise output
in forward, each Colwise input gradient in backward except the first layer's, whose input needs
no gradient); the dp group all-reduces the gradient shard once. The cost model's prediction is
``ok.estimate(..., placement=p, group="tp"|"dp")`` for exactly those.

(The gradients go through one flat all-reduce rather than ``ok.GradBucketer``, which cannot take
DTensor parameters yet.)

Steps alternate between the layouts (planned, wrong, wrong, planned, ...) so that noise on a
shared machine hits both alike; a step's time is the slowest rank's. After each step the same
collectives run alone ("comm alone"), which is what the model predicts. Checks printed: the two
layouts end with the same parameters, and the data-parallel replicas agree.

Example::

    python -m bench.placement --json bench/results/placement.json
    python -m bench.placement --rate 1gbit --width 256 --batch 4096
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import overlapkit as ok
from bench.harness.json_report import write_json_report
from bench.harness.two_node_bench import (
    add_two_node_arguments,
    calibrated_topology,
    run_workers,
    two_node_main,
)
from overlapkit.train.models import MLP, MLPConfig

LAYOUTS = ("planned", "tp_across_link")
WRONG_ORDER = ("pp", "ep", "cp", "tp", "dp")


def placements(topology: ok.Topology) -> dict[str, ok.Placement]:
    """The planned layout and the deliberately wrong one (tp across the link)."""
    return {
        "planned": ok.plan(topology, tp=2),
        "tp_across_link": ok.plan(topology, tp=2, order=WRONG_ORDER, allow_split=True),
    }


def predicted_comm(placement: ok.Placement, args: argparse.Namespace, dp_bytes: int) -> dict:
    """The cost model's seconds per step for this benchmark's collectives on ``placement``."""
    activation_bytes = args.batch * args.width * 4
    tp_calls = tp_all_reduces_per_step(args.layers)
    tp = ok.estimate("all_reduce", nbytes=activation_bytes, placement=placement, group="tp")
    dp = ok.estimate("all_reduce", nbytes=dp_bytes, placement=placement, group="dp")
    return {
        "tp_s": tp_calls * tp.time_s,
        "dp_s": dp.time_s,
        "total_s": tp_calls * tp.time_s + dp.time_s,
        "tp_each_s": tp.time_s,
        "tp_bytes": activation_bytes,
        "dp_bytes": dp_bytes,
    }


def tp_all_reduces_per_step(layers: int) -> int:
    """Rowwise outputs in forward (layers/2) + Colwise input gradients but the first's."""
    return layers - 1


def build(mesh, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP(MLPConfig(width=args.width, n_layer=args.layers))
    tp_plan = {
        f"blocks.{i}.0": ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
        for i in range(args.layers)
    }
    model = parallelize_module(model, mesh["tp"], tp_plan)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def local_tensors(model: nn.Module, *, grads: bool = False) -> list[torch.Tensor]:
    """This rank's shard of every parameter (or of its gradient)."""
    tensors = [p.grad if grads else p.detach() for p in model.parameters()]
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def train_step(model, optimizer, x, y, dp_group) -> float:
    optimizer.zero_grad(set_to_none=False)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    grads = local_tensors(model, grads=True)
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat /= dist.get_world_size(dp_group)
    dist.all_reduce(flat, group=dp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    optimizer.step()
    return loss.item()


def batch_for(dp_index: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + dp_index)
    x = torch.randn(args.batch, args.width, generator=generator)
    return x, torch.randn(args.batch, args.width, generator=generator)


def full_parameters(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]


def worker(args: argparse.Namespace) -> None:
    # The first layer's input needs no gradient, which torch's module hooks warn about.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    rank = dist.get_rank()
    topology = ok.detect_topology()
    detected = placements(topology)["planned"]
    report: dict = {
        "world_size": topology.world_size,
        "nodes": [list(r) for r in topology.nodes()],
        "detected_tp_groups": [list(g) for g in detected.groups("tp")],
        "detected_dp_groups": [list(g) for g in detected.groups("dp")],
    }
    if not args.detect_only:
        report |= measure(topology, args)
    if rank == 0:
        Path(args.out).write_text(json.dumps(report, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def measure(topology: ok.Topology, args: argparse.Namespace) -> dict:
    predictor, calibration = calibrated_topology(
        topology, args.calibrate_min, args.calibrate_max, args.calibrate_budget
    )
    layouts = placements(predictor)
    runs = {}
    for name, placement in layouts.items():
        mesh = placement.device_mesh("cpu")
        model, optimizer = build(mesh, args)
        dp_bytes = sum(t.numel() * t.element_size() for t in local_tensors(model))
        runs[name] = {
            "mesh": mesh,
            "model": model,
            "optimizer": optimizer,
            "batch": batch_for(mesh.get_local_rank("dp"), args),
            "comm_buffers": (torch.ones(args.batch, args.width), torch.ones(dp_bytes // 4)),
            "times": [],
            "comm_times": [],
            "losses": [],
            "predicted": predicted_comm(placement, args, dp_bytes),
        }
    initial = [t.clone() for t in full_parameters(runs["planned"]["model"])]
    for name in LAYOUTS:  # warm-up: the first steps allocate and connect
        for _ in range(args.warmup):
            _timed_step(runs[name])
    for step in range(args.steps):
        for name in LAYOUTS if step % 2 == 0 else tuple(reversed(LAYOUTS)):
            runs[name]["times"].append(_timed_step(runs[name]))
            runs[name]["comm_times"].append(_timed_comm(runs[name], args))
    slowest = {name: _slowest(runs[name]["times"]) for name in LAYOUTS}
    comm = {name: _slowest(runs[name]["comm_times"]) for name in LAYOUTS}
    difference = max(
        (a - b).abs().max().item()
        for a, b in zip(
            full_parameters(runs["planned"]["model"]),
            full_parameters(runs["tp_across_link"]["model"]),
            strict=True,
        )
    )
    replicas = max(_replica_spread(runs[name]) for name in LAYOUTS)
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(full_parameters(runs["planned"]["model"]), initial, strict=True)
    )
    return {
        "calibration": calibration,
        "layouts": {
            name: {
                "tp_groups": [list(g) for g in layouts[name].groups("tp")],
                "dp_groups": [list(g) for g in layouts[name].groups("dp")],
                "step_times_s": slowest[name],
                "median_s": statistics.median(slowest[name]),
                "comm_times_s": comm[name],
                "comm_median_s": statistics.median(comm[name]),
                "predicted": runs[name]["predicted"],
                "losses": runs[name]["losses"],
            }
            for name in LAYOUTS
        },
        "max_parameter_difference": difference,
        "max_parameter_change": moved,
        "max_replica_difference": replicas,
    }


def _replica_spread(run: dict) -> float:
    """Largest difference of a parameter between data-parallel replicas (0 when in sync)."""
    local = torch.cat([t.reshape(-1) for t in local_tensors(run["model"])])
    high, low = local.clone(), local.clone()
    group = run["mesh"].get_group("dp")
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    spread = (high - low).abs().max()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return spread.item()


def _slowest(times: list[float]) -> list[float]:
    """Each step's time on the slowest rank."""
    tensor = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _timed_comm(run: dict, args: argparse.Namespace) -> float:
    """The step's collectives alone: what the cost model predicts, with no compute beside."""
    activations, grads = run["comm_buffers"]
    mesh = run["mesh"]
    dist.barrier()
    start = time.perf_counter()
    for _ in range(tp_all_reduces_per_step(args.layers)):
        dist.all_reduce(activations, group=mesh.get_group("tp"))
    dist.all_reduce(grads, group=mesh.get_group("dp"))
    return time.perf_counter() - start


def _timed_step(run: dict) -> float:
    dp_group = run["mesh"].get_group("dp")
    x, y = run["batch"]
    dist.barrier()
    start = time.perf_counter()
    run["losses"].append(train_step(run["model"], run["optimizer"], x, y, dp_group))
    return time.perf_counter() - start


def launch(args: argparse.Namespace) -> dict:
    """Run the workers on two emulated nodes; rank 0's report."""
    forwarded = [
        "--width", str(args.width),
        "--layers", str(args.layers),
        "--batch", str(args.batch),
        "--steps", str(args.steps),
        "--warmup", str(args.warmup),
    ]  # fmt: skip
    if args.detect_only:
        forwarded.append("--detect-only")
    report = run_workers("bench.placement", args, forwarded)
    report["link"] = {"rate": args.rate, "delay": "0ms"}
    return report


def render(report: dict, args: argparse.Namespace) -> str:
    lines = [
        f"placement benchmark: 2 emulated nodes x 2 gloo ranks, link {args.rate} (tc tbf), MLP "
        f"{args.layers} x Linear({args.width}), batch {args.batch} per dp rank, fp32",
        f"detected nodes {report['nodes']}; ok.plan(tp=2) puts tp groups "
        f"{report['detected_tp_groups']}, dp groups {report['detected_dp_groups']}",
    ]
    for tier, fit in report["calibration"].items():
        lines.append(
            f"calibrated {tier}: {fit['bandwidth_GBps']:.3g} GB/s per rank, "
            f"{fit['latency_us']:.3g} us per step"
        )
    lines.append("the predictions use scale_out and scale_up_all_nodes_busy")
    header = (
        f"{'layout':<16} {'tp groups':<18} {'step':>10} {'comm alone':>11} "
        f"{'predicted comm (tp + dp)':>28}"
    )
    lines += ["", header, f"{'':<35} {'(median, slowest rank)':>22}"]
    layouts = report["layouts"]
    for name, case in layouts.items():
        p = case["predicted"]
        lines.append(
            f"{name:<16} {json.dumps(case['tp_groups']):<18} {case['median_s'] * 1e3:>7.1f} ms "
            f"{case['comm_median_s'] * 1e3:>8.1f} ms {p['total_s'] * 1e3:>9.1f} ms "
            f"({p['tp_s'] * 1e3:.1f} + {p['dp_s'] * 1e3:.1f} ms)"
        )
    planned, wrong = layouts["planned"], layouts["tp_across_link"]
    measured = wrong["median_s"] / planned["median_s"]
    ratios = [w / p for w, p in zip(wrong["step_times_s"], planned["step_times_s"], strict=True)]
    paired = statistics.median(ratios)
    wins = sum(r > 1 for r in ratios)
    predicted_delta = wrong["predicted"]["total_s"] - planned["predicted"]["total_s"]
    measured_delta = wrong["median_s"] - planned["median_s"]
    ranks_right = (predicted_delta > 0) == (measured_delta > 0)
    comm_delta = wrong["comm_median_s"] - planned["comm_median_s"]
    lines += [
        "",
        f"planned is {measured:.2f}x faster measured (step {measured_delta * 1e3:+.1f} ms; "
        f"median of step pairs {paired:.2f}x, faster in {wins} of {len(ratios)} pairs); "
        f"the model predicts {predicted_delta * 1e3:+.1f} ms of communication "
        f"(measured alone {comm_delta * 1e3:+.1f} ms): "
        f"ranks them {'correctly' if ranks_right else 'WRONGLY'}",
        f"same training step: max |parameter difference| between layouts "
        f"{report['max_parameter_difference']:.3g} (training moved them by up to "
        f"{report['max_parameter_change']:.3g}); data-parallel replicas differ by "
        f"{report['max_replica_difference']:.3g}",
        f"load average: {report.get('load', '?')}",
    ]
    return "\n".join(lines)


def to_benchmark_json(report: dict) -> dict:
    """The benchmark document (docs/json-contracts.md), with the predictions and raw times."""
    layouts = report["layouts"]
    baseline = layouts["tp_across_link"]["median_s"]
    return {
        "cases": [
            {
                "name": name,
                "median_ms": case["median_s"] * 1e3,
                "overlap_efficiency": None,
                "speedup_vs_baseline": baseline / case["median_s"],
                "predicted_comm_ms": case["predicted"]["total_s"] * 1e3,
                "predicted_tp_ms": case["predicted"]["tp_s"] * 1e3,
                "predicted_dp_ms": case["predicted"]["dp_s"] * 1e3,
                "comm_alone_median_ms": case["comm_median_s"] * 1e3,
                "tp_groups": case["tp_groups"],
                "dp_groups": case["dp_groups"],
                "step_times_ms": [t * 1e3 for t in case["step_times_s"]],
            }
            for name, case in layouts.items()
        ],
        "baseline": "tp_across_link",
        "link": report["link"],
        "nodes": report["nodes"],
        "calibration": report["calibration"],
        "max_parameter_difference": report["max_parameter_difference"],
        "max_parameter_change": report["max_parameter_change"],
        "max_replica_difference": report["max_replica_difference"],
        "load": report.get("load"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="4gbit", help="link rate per direction (tc spelling)")
    parser.add_argument("--width", type=int, default=128, help="MLP width (128)")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers, even (8)")
    parser.add_argument("--batch", type=int, default=8192, help="rows per dp rank (8192)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per layout (20)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per layout (2)")
    add_two_node_arguments(parser, timeout_s=600)
    parser.add_argument(
        "--detect-only", action="store_true", help="only detect and plan (no training)"
    )
    args = parser.parse_args(argv)
    if args.layers < 2 or args.layers % 2:
        parser.error(f"--layers must be even and >= 2 (Colwise/Rowwise pairs), got {args.layers}")
    return args


def drive(args: argparse.Namespace) -> int:
    """The driver: launch the workers, print what they measured, write ``--json``."""
    report = launch(args)
    report["load"] = " ".join(f"{load:.2f}" for load in os.getloadavg())
    if args.detect_only:
        print(json.dumps(report, indent=2))
        return 0
    print(render(report, args))
    write_json_report(Path(args.json) if args.json else None, to_benchmark_json(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    return two_node_main("placement", argv, parse_args=parse_args, worker=worker, drive=drive)


if __name__ == "__main__":
    sys.exit(main())
