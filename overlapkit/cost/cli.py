"""``overlapkit calibrate``: measure all-reduce here and fit the cost model (writes a topology)."""

from __future__ import annotations

import argparse
import json

from overlapkit.cost.calibrate import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MIN_BYTES,
    DEFAULT_OUTPUT,
    calibrate,
    render_calibration,
)
from overlapkit.topology.units import parse_size


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``calibrate`` to the ``overlapkit`` command."""
    add_calibrate_parser(subparsers)


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``calibrate`` parser with its options (``run_calibrate`` as its ``func``)."""
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
        "--quantile",
        type=float,
        default=0.5,
        help="quantile of each size's iterations to fit (default 0.5, the median; 0.25 on a "
        "shared machine, where other work only adds time)",
    )
    parser.add_argument(
        "--fit-min-bytes",
        default="0",
        metavar="SIZE",
        help="fit only sizes >= SIZE, e.g. 1MiB for the bucket sizes the planner asks about "
        "(default 0: every size)",
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
    return parser


def run_calibrate(args: argparse.Namespace) -> int:
    result = calibrate(
        ranks=args.ranks,
        min_bytes=int(parse_size(args.min_bytes, what="--min-bytes")),
        max_bytes=int(parse_size(args.max_bytes, what="--max-bytes")),
        budget_s=args.budget_s,
        output=args.output,
        progress=not args.no_progress,
        quantile=args.quantile,
        fit_min_bytes=int(parse_size(args.fit_min_bytes, what="--fit-min-bytes")),
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
