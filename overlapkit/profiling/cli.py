"""``overlapkit report RUN_DIR [--iteration N] [--json] [--png FILE] [--step N]``."""

from __future__ import annotations

import argparse
import json

from overlapkit.profiling.analysis import analyze_run
from overlapkit.profiling.report import format_report


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``report`` sub-command."""
    parser = subparsers.add_parser(
        "report",
        help="exposed communication per step from profiler traces",
        description=(
            "Read the profiler traces in RUN_DIR (all ranks, all cycles) and print per step, "
            "per rank compute, comm, exposed comm and tail times (ms)."
        ),
    )
    parser.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="directory of *.pt.trace.json[.gz], or a torchtitan dump folder",
    )
    parser.add_argument(
        "--iteration",
        type=int,
        metavar="N",
        help="a torchtitan run's iteration_N traces only (default: every iteration)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--png", metavar="FILE", help="draw a timeline of one step to FILE")
    parser.add_argument(
        "--step",
        type=int,
        default=None,
        help="step for --png (default: the last step that most ranks recorded)",
    )
    parser.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    """Analyse ``args.run_dir``, print the report, optionally draw the timeline."""
    report = analyze_run(args.run_dir, args.iteration)
    png = None
    if args.png:
        from overlapkit.profiling.timeline import draw_timeline  # matplotlib only when asked

        png = draw_timeline(report, args.png, step=args.step)
    if args.json:
        payload = report.to_json()
        if png is not None:
            payload["png"] = str(png)
        print(json.dumps(payload, indent=2))
    else:
        print(format_report(report))
        if png is not None:
            print(f"\ntimeline: {png}")
    return 0
