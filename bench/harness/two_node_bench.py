"""A benchmark on two emulated nodes: its shared options, the cost model fitted there, its launch.

``bench.placement`` and ``bench.planner_ranking`` run the same way: the driver (root) makes two
network namespaces (``bench.harness.two_nodes``), starts ``python -m <module> --worker`` as two
gloo ranks on each through torchrun, and reads rank 0's report back; every worker fits the cost
model to the machine first (``calibrated_topology``).

    def drive(args):                         # parse_args used add_two_node_arguments
        report = run_workers("bench.placement", args, ["--width", str(args.width)])
        ...

    def main(argv=None):
        return two_node_main("placement", argv, parse_args=parse_args, worker=worker, drive=drive)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

import overlapkit as ok
from bench.harness.two_nodes import TwoNodes, unavailable_reason
from overlapkit.cost.calibrate import (
    calibrate_collective,
    fit_ring_all_reduce,
    measure_all_reduce,
    sizes_between,
)
from overlapkit.train.planning.host_calibration import collective_overhead

REPO = Path(__file__).resolve().parents[2]
"""The checkout: the ranks run ``python -m bench.<name>`` from here, wherever the driver runs."""


def add_two_node_arguments(parser: argparse.ArgumentParser, *, timeout_s: float) -> None:
    """The options every two-emulated-node benchmark takes: calibration, timeouts, output."""
    parser.add_argument("--calibrate-min", type=int, default=256 * 1024, help=argparse.SUPPRESS)
    parser.add_argument("--calibrate-max", type=int, default=16 * 2**20, help=argparse.SUPPRESS)
    parser.add_argument("--calibrate-budget", type=float, default=0.2, help=argparse.SUPPRESS)
    parser.add_argument("--collective-timeout", type=float, default=120, help=argparse.SUPPRESS)
    parser.add_argument(
        "--timeout", type=float, default=timeout_s, help=f"whole run, seconds ({timeout_s:g})"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)


def two_node_main(
    name: str,
    argv: list[str] | None,
    *,
    parse_args: Callable[[list[str] | None], argparse.Namespace],
    worker: Callable[[argparse.Namespace], None],
    drive: Callable[[argparse.Namespace], int],
) -> int:
    """A two-node benchmark's ``main``: a rank runs ``worker``; the driver runs ``drive``.

    Where two emulated nodes cannot be made (not root, no iproute2) the driver says why and
    returns 0, as ``bench.harness.emulated_link`` does, rather than fail ``make bench``.

    Returns:
        int: the exit status (``drive``'s).
    """
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    reason = unavailable_reason()
    if reason is not None:
        print(f"[{name}] two emulated nodes are unavailable here ({reason}); skipped")
        return 0
    return drive(args)


CALIBRATION_FLAGS = (
    "calibrate_steps",
    "latency_probes",
    "probe_work",
    "overlap_trials",
    "optimizer_steps",
)
"""How much the workers measure before the benchmark proper (the host terms the planner prices
with, ``collective_overhead``'s probes): hidden flags, forwarded to the workers."""


def add_calibration_arguments(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """The ``CALIBRATION_FLAGS``, hidden from ``--help``, each with its default in ``defaults``."""
    for name in CALIBRATION_FLAGS:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=defaults[name], help=argparse.SUPPRESS)


def forwarded_flags(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """The options ``names`` of ``args`` as the command-line flags that set them (a list
    option's values after its flag), for ``run_workers``."""
    flags: list[str] = []
    for name in names:
        value = getattr(args, name)
        values = value if isinstance(value, list) else [value]
        flags += ["--" + name.replace("_", "-"), *map(str, values)]
    return flags


def run_workers(module: str, args: argparse.Namespace, worker_arguments: Sequence[str]) -> dict:
    """Run ``python -m <module> --worker`` as 2 gloo ranks on each of two emulated nodes.

    The workers get ``worker_arguments``, the shared options (``add_two_node_arguments``) and
    ``--out PATH``, where rank 0 writes its report (JSON); each rank runs one thread
    (``OMP_NUM_THREADS=1``: four ranks share this machine's cores) at the top scheduling
    priority of its session.

    Returns:
        dict: rank 0's report.

    Raises:
        RuntimeError: the nodes cannot be made here, a node failed or ``args.timeout`` passed
            (the nodes' output in the message).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"two emulated nodes are unavailable here: {reason}")
    shared = [
        "--calibrate-min", str(args.calibrate_min),
        "--calibrate-max", str(args.calibrate_max),
        "--calibrate-budget", str(args.calibrate_budget),
        "--collective-timeout", str(args.collective_timeout),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ovk-two-node-bench-") as scratch:
        out = Path(scratch) / "report.json"
        with TwoNodes(rate=args.rate) as nodes:
            nodes.torchrun(
                ["-m", module, "--worker", "--out", str(out), *worker_arguments, *shared],
                nproc_per_node=2,
                timeout_s=args.timeout,
                env={"OMP_NUM_THREADS": "1"},
                autogroup_nice=-19,
                cwd=REPO,
            )
        return json.loads(out.read_text())


def calibrated_topology(
    topology: ok.Topology, min_bytes: int, max_bytes: int, budget_s: float
) -> tuple[ok.Topology, dict]:
    """The topology with the cost model fitted here (a collective: every rank calls it).

    Scale-out from ``overlapkit calibrate``'s one-rank-per-node fit; scale-up from in-node
    all-reduces measured while every node runs one (the emulated nodes share this machine's
    cores, and loopback copies cost CPU; on real nodes each would have its own). Returns the
    predictor topology and the fitted figures.
    """
    sizes = sizes_between(min_bytes, max_bytes)
    calibration = calibrate_collective(sizes, budget_s=budget_s, progress=False)
    if calibration.topology.nodes() != topology.nodes():
        raise RuntimeError(
            f"calibrated nodes {calibration.topology.nodes()} differ from the detected "
            f"{topology.nodes()}"
        )
    busy_latency_us, busy_GBps = _scale_up_with_all_nodes_busy(topology, sizes, budget_s)
    predictor = dataclasses.replace(
        calibration.topology,
        domains=tuple(
            dataclasses.replace(d, bandwidth_GBps=busy_GBps, latency_us=busy_latency_us)
            for d in calibration.topology.domains
        ),
    )
    fits = {
        f.tier: {"latency_us": f.latency_us, "bandwidth_GBps": f.bandwidth_GBps}
        for f in calibration.fits
    }
    fits["scale_up_all_nodes_busy"] = {"latency_us": busy_latency_us, "bandwidth_GBps": busy_GBps}
    return predictor, fits


@dataclasses.dataclass(frozen=True)
class CalibratedWorker:
    """What every planner-pricing benchmark's worker measures before its runs."""

    topology: ok.Topology
    """The detected topology (two emulated nodes)."""
    predictor: ok.Topology
    """``topology`` with the cost model fitted here (``calibrated_topology``)."""
    calibration: dict
    """The fit's report."""
    overhead_s: dict[str, float]
    """Per tier, a small collective's cost between busy ranks (``collective_overhead``)."""


def start_calibrated_worker(args: argparse.Namespace) -> CalibratedWorker:
    """Join the gloo group (``--collective-timeout``), detect the topology, fit the cost model
    to it and measure each tier's per-call overhead (``CALIBRATION_FLAGS``' probes)."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    topology = ok.detect_topology()
    predictor, calibration = calibrated_topology(
        topology, args.calibrate_min, args.calibrate_max, args.calibrate_budget
    )
    overhead_s = collective_overhead(topology, probes=args.latency_probes, work=args.probe_work)
    return CalibratedWorker(topology, predictor, calibration, overhead_s)


def _scale_up_with_all_nodes_busy(
    topology: ok.Topology, sizes: list[int], budget_s: float
) -> tuple[float, float]:
    """Fitted (latency us, GB/s) of in-node all-reduces while every node runs one."""
    # new_group is collective: every rank creates every node's group.
    groups = [dist.new_group(list(ranks)) for ranks in topology.nodes()]
    node = topology.devices[dist.get_rank()].node
    measured = measure_all_reduce(sizes, group=groups[node], budget_s=budget_s, progress=False)
    fit = torch.tensor(fit_ring_all_reduce(measured), dtype=torch.float64)
    fits = [torch.zeros_like(fit) for _ in range(dist.get_world_size())]
    dist.all_gather(fits, fit)
    # The slowest node's figures: a step waits for it.
    return max(f[0].item() for f in fits), min(f[1].item() for f in fits)
