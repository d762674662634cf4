"""``overlapkit doctor``: the practical checklist, checked on this setup.

Without torchrun it starts ``--nproc`` local ranks itself; under torchrun every rank runs it
(``torchrun --nproc-per-node 8 --no-python overlapkit doctor``) and rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import logging

from overlapkit.doctor.check import CHECK_NAMES, exit_code, parse_only
from overlapkit.doctor.render import render, to_json
from overlapkit.doctor.runner import DoctorOptions, run_doctor
from overlapkit.layout import PartialLayout

PLACED = ("tp", "ep", "cp", "pp")
"""The sizes the placement check takes (dp: the rest of the world)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``doctor`` to the ``overlapkit`` command."""
    parser = subparsers.add_parser(
        "doctor",
        help="check this distributed-training setup: pass / warn / fail per item",
        description="Checks, each measured here: " + ", ".join(CHECK_NAMES) + ". Exit code 1 "
        "when any check fails. Under torchrun every rank runs it; otherwise it starts --nproc "
        "local ranks.",
    )
    parser.add_argument("--nproc", type=int, default=2, help="local ranks to start (default 2)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and steps (seconds)")
    parser.add_argument(
        "--only", metavar="A,B", help=f"run only these checks ({','.join(CHECK_NAMES)})"
    )
    parser.add_argument(
        "--topology",
        metavar="NAME|FILE",
        help="the topology you expect (preset or file, e.g. from `overlapkit calibrate`); "
        "a mismatch fails, and predictions use it",
    )
    sizes = parser.add_argument_group("layout for the placement check")
    for axis in PLACED:
        sizes.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} size (1)")
    parser.add_argument(
        "--bucket-mb", type=float, metavar="MB", help="your bucket size to judge (default: ours)"
    )
    parser.add_argument(
        "--prefetch",
        type=int,
        metavar="DEPTH",
        help="your ok.fsdp prefetch depth to judge, 0-2 (default: 1, ok.fsdp's)",
    )
    parser.add_argument(
        "--model", choices=("mlp", "gpt_tiny"), default="mlp", help="the small model measured"
    )
    parser.add_argument("--logdir", metavar="DIR", help="keep the profiled run's traces here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def options_from_args(args: argparse.Namespace) -> DoctorOptions:
    """The options the flags give.

    Raises:
        TypeError / ValueError: a bad value, naming its flag.
    """
    sizes = {axis: getattr(args, axis) for axis in PLACED}
    return DoctorOptions(
        only=parse_only(args.only),
        quick=args.quick,
        topology=args.topology,
        sizes=PartialLayout.from_mapping(sizes, spell=lambda key: f"--{key}"),
        bucket_mb=args.bucket_mb,
        prefetch=args.prefetch,
        model=args.model,
        logdir=args.logdir,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    checks, facts = run_doctor(options_from_args(args), nproc=args.nproc)
    if facts["rank"] == 0:
        print(json.dumps(to_json(checks, facts), indent=2) if args.json else render(checks, facts))
    return exit_code(checks)
