"""``overlapkit estimate`` and ``overlapkit calibrate`` (placement's ``plan`` joins them here).

Each command has its own ``_add_<command>`` function; ``add_topology_arguments`` is shared by
every command that takes a topology.
"""

from __future__ import annotations

import argparse
import json

from overlapkit.planner.calibrate import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MIN_BYTES,
    DEFAULT_OUTPUT,
    calibrate,
    render_calibration,
)
from overlapkit.planner.cost import ALGORITHMS, COLLECTIVES, Estimate, estimate
from overlapkit.topology.cli import FABRIC_CHOICES
from overlapkit.topology.loading import load_topology
from overlapkit.topology.model import Topology, bare_link
from overlapkit.topology.units import (
    format_bytes,
    format_seconds,
    parse_bandwidth,
    parse_duration,
    parse_size,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``estimate`` and ``calibrate`` to the ``overlapkit`` command."""
    _add_estimate(subparsers)
    _add_calibrate(subparsers)


def add_topology_arguments(parser: argparse.ArgumentParser, *, allow_link: bool) -> None:
    """Add ``--topology``, ``--fabric`` and (``allow_link``) ``--bandwidth``, ``--latency``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--topology",
        metavar="NAME|FILE",
        help="preset (dgx-h100x4, gb200-nvl72x2, ...) or topology YAML file",
    )
    if allow_link:
        source.add_argument(
            "--bandwidth",
            metavar="B",
            help="one bare link per rank instead of a topology: 1.8TB/s, "
            "50GB/s, 400Gbit/s (per direction)",
        )
        parser.add_argument(
            "--latency",
            metavar="L",
            help="with --bandwidth: latency per step, 5us or seconds (default 0)",
        )
    parser.add_argument(
        "--fabric", choices=FABRIC_CHOICES, help="switch the topology's scale-out fabric"
    )


def topology_from_args(args: argparse.Namespace, *, group_size: int | None) -> Topology:
    latency = getattr(args, "latency", None)
    if getattr(args, "bandwidth", None):
        if group_size is None:
            raise ValueError("--bandwidth needs --group-size (how many ranks share the link)")
        return bare_link(
            parse_bandwidth(args.bandwidth, what="--bandwidth"),
            parse_duration(latency or 0, what="--latency") * 1e6,
            group_size,
        )
    if latency is not None:
        raise ValueError("--latency goes with --bandwidth; a topology has its own latencies")
    return load_topology(args.topology, fabric=args.fabric)


def _add_estimate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate",
        help="predict one collective's time, algbw and busbw on a topology",
        description="Predict a collective's time with the alpha-beta model and NCCL-like "
        "algorithm choice. Sizes: 140e9, 140GB, 1.5GiB.",
    )
    parser.add_argument(
        "--collective", required=True, metavar="NAME", help=f"one of {', '.join(COLLECTIVES)}"
    )
    parser.add_argument(
        "--bytes",
        required=True,
        metavar="SIZE",
        help="size as nccl-tests counts it: 140e9, 140GB, 1.5GiB",
    )
    add_topology_arguments(parser, allow_link=True)
    parser.add_argument(
        "--group-size",
        type=int,
        metavar="N",
        help="the group is the topology's first N devices (default: all)",
    )
    parser.add_argument(
        "--algorithm",
        choices=ALGORITHMS,
        help="force an algorithm (like NCCL_ALGO); default: the fastest",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run_estimate)


def run_estimate(args: argparse.Namespace) -> int:
    nbytes = parse_size(args.bytes, what="--bytes")
    topology = topology_from_args(args, group_size=args.group_size)
    result = estimate(
        args.collective,
        nbytes=nbytes,
        topology=topology,
        group_size=args.group_size,
        algorithm=args.algorithm,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else render_estimate(result))
    return 0


def render_estimate(result: Estimate) -> str:
    """The readable table ``overlapkit estimate`` prints."""
    lines = [
        f"{result.collective} of {format_bytes(result.nbytes)} on {result.group_size} rank(s) "
        f"of {result.topology} (library {result.library})",
        f"  algorithm  {result.algorithm} ({result.protocol})",
        f"  time       {format_seconds(result.time_s)}",
        f"  algbw      {result.algbw_GBps:.4g} GB/s",
        f"  busbw      {result.busbw_GBps:.4g} GB/s",
    ]
    if len(result.candidates) > 1:
        lines.append("  candidates (fastest first)")
        lines += [f"    {a:<12} {p:<7} {format_seconds(t)}" for a, p, t in result.candidates]
    return "\n".join(lines)


def _add_calibrate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure all-reduce here and fit the cost model (writes a topology)",
        description="Time all_reduce from --min-bytes to --max-bytes (doubling) like "
        "nccl-tests, per tier, fit latency and bandwidth, write a topology YAML. Under torchrun "
        "the job's ranks are measured; otherwise --ranks local gloo workers.",
    )
    parser.add_argument("--ranks", type=int, default=2, help="local workers (default 2)")
    parser.add_argument(
        "--min-bytes",
        default=str(DEFAULT_MIN_BYTES),
        metavar="SIZE",
        help="smallest size (default 4KiB)",
    )
    parser.add_argument(
        "--max-bytes",
        default=str(DEFAULT_MAX_BYTES),
        metavar="SIZE",
        help="largest size (default 256MiB)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0.25,
        help="seconds to spend per size, about (default 0.25)",
    )
    parser.add_argument(
        "--output",
        default=str(DEFAULT_OUTPUT),
        metavar="FILE",
        help=f"topology YAML to write (default {DEFAULT_OUTPUT})",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    result = calibrate(
        ranks=args.ranks,
        min_bytes=int(parse_size(args.min_bytes, what="--min-bytes")),
        max_bytes=int(parse_size(args.max_bytes, what="--max-bytes")),
        budget_s=args.budget_s,
        output=args.output,
        progress=not args.no_progress,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "backend": result.backend,
                    "topology_file": args.output,
                    "tiers": [
                        {
                            "tier": fit.tier,
                            "ranks": list(fit.ranks),
                            "latency_us": fit.latency_us,
                            "bandwidth_GBps": fit.bandwidth_GBps,
                            "sizes": [
                                {
                                    "bytes": m.nbytes,
                                    "time_s": m.time_s,
                                    "algbw_GBps": m.algbw_GBps,
                                    "busbw_GBps": m.busbw_GBps,
                                    "iterations": m.iterations,
                                    "fit_time_s": fit.predict_s(m.nbytes),
                                }
                                for m in fit.measurements
                            ],
                        }
                        for fit in result.fits
                    ],
                },
                indent=2,
            )
        )
    else:
        print(render_calibration(result))
        print(
            f"wrote {args.output}; use it with: overlapkit estimate --topology {args.output} "
            "--collective all_reduce --bytes 64MiB"
        )
    return 0
