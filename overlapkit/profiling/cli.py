"""``overlapkit report RUN_DIR [--iteration N] [--json] [--png FILE] [--step N] [--jobs N]
[--stragglers] ...``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from overlapkit.profiling.analysis import analyze_files, analyze_run
from overlapkit.profiling.file_pool import check_jobs
from overlapkit.profiling.report import format_report


def _count(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise argparse.ArgumentTypeError(f"{flag} must be a whole number >= 0, got {text!r}")
        return value

    return parse


def _jobs(text: str) -> int:
    try:
        return check_jobs(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--jobs must be a whole number of worker processes >= 1, got {text!r}"
        ) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``report`` sub-command."""
    parser = subparsers.add_parser(
        "report",
        help="exposed communication per step from profiler traces; stragglers",
        description=(
            "Read the profiler traces in RUN_DIR (all ranks, all cycles) and print per step, "
            "per rank compute, comm, exposed comm and tail times (ms). With --stragglers, match "
            "every collective across ranks and say which rank delays the others, where, why "
            "and at what cost."
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
    parser.add_argument(
        "--jobs",
        type=_jobs,
        default=None,
        metavar="N",
        help="worker processes reading the files (default: the cores available)",
    )
    parser.add_argument(
        "--step-rows",
        type=_count("--step-rows"),
        default=None,
        metavar="N",
        help="print only the first N per rank, per step rows (0: none; default: all)",
    )
    parser.add_argument(
        "--stragglers",
        action="store_true",
        help="match collectives across ranks, align clocks, name stragglers with cause and cost",
    )
    parser.add_argument(
        "--collective-rows",
        type=_count("--collective-rows"),
        default=None,
        metavar="N",
        help="with --stragglers --json: keep only the first N collectives (default: all)",
    )
    parser.add_argument(
        "--heatmap", metavar="FILE", help="with --stragglers: draw rank x step wait (ms) to FILE"
    )
    parser.add_argument(
        "--tensorboard",
        metavar="DIR",
        nargs="?",
        const="",
        default=None,
        help="with --stragglers: write per-rank wait scalars under DIR/overlap (default RUN_DIR)",
    )
    parser.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    """Analyse ``args.run_dir``, print the report, optionally draw and write the extras."""
    stragglers = args.stragglers or args.heatmap or args.tensorboard is not None
    report = analyze_run(args.run_dir, args.iteration, jobs=args.jobs, programs=bool(stragglers))
    extra: dict[str, str] = {}
    found = None
    if stragglers:
        from overlapkit.profiling.stragglers import find_stragglers

        found = find_stragglers(report.programs)
        if args.heatmap:
            from overlapkit.profiling.heatmap import draw_wait_heatmap  # matplotlib when asked

            extra["heatmap"] = str(draw_wait_heatmap(found, args.heatmap, title=report.run_dir))
        if args.tensorboard is not None:
            from overlapkit.profiling.tensorboard import write_wait_scalars

            logdir = Path(args.tensorboard or report.run_dir)
            extra["tensorboard"] = str(write_wait_scalars(logdir, found.waits)[0].parent)
    if args.png:
        from overlapkit.profiling.timeline import default_step, draw_timeline

        step = default_step(report) if args.step is None else args.step
        holding = [t["file"] for t in report.traces if step in t["steps"]]
        drawn = analyze_files(
            [Path(f) for f in holding], report.run_dir, jobs=args.jobs, lanes={step}
        )
        drawn.table = report.table  # the steps there are, for the message when step is not one
        extra["png"] = str(draw_timeline(drawn, args.png, step=step))
    if args.json:
        payload = report.to_json(step_rows=args.step_rows)
        if found is not None:
            payload |= found.to_json(collective_rows=args.collective_rows)
        print(json.dumps(payload | extra, indent=2))
    else:
        print(format_report(report, step_rows=args.step_rows, stragglers=found))
        for name, path in extra.items():
            print(f"\n{'timeline' if name == 'png' else name}: {path}")
    return 0
