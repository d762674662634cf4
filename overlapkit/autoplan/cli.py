"""``overlapkit plan``: place the sizes given on a topology, or (``--auto``) choose them.

A manual plan is the placement layer's (``planner/cli.py``: its flags, its table); ``--auto``
and ``--validate`` are the auto-planner's (``autoplan/auto_cli.py``).
"""

from __future__ import annotations

import argparse

from overlapkit.autoplan.auto_cli import (
    add_auto_arguments,
    choices_from_args,
    run_auto,
    run_validation,
    settings_from_args,
)
from overlapkit.autoplan.layout_warnings import manual_warnings
from overlapkit.autoplan.models import load_model
from overlapkit.planner.cli import (
    add_placement_arguments,
    add_plan_arguments,
    add_topology_arguments,
    placement_from_args,
    show_placement,
    topology_from_args,
    workload_from_args,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plan`` to the ``overlapkit`` command."""
    parser = subparsers.add_parser(
        "plan",
        help="place tp/ep/cp/pp/dp on a topology: rank grid, groups, predicted comm",
        description="Lay the parallel dimensions onto the topology (heaviest traffic "
        "innermost, groups inside scale-up domains, dp/pp peers on one rail), and predict each "
        "dimension's communication per step for a model of --params parameters.",
    )
    source = add_topology_arguments(parser, allow_link=False)
    add_plan_arguments(parser)
    add_placement_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_auto_arguments(parser, source)
    parser.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    if args.validate:
        if not args.auto:
            raise ValueError("--validate goes with --auto (overlapkit plan --auto --validate)")
        return run_validation(args)
    topology = topology_from_args(args, group_size=None)
    if args.auto:
        return run_auto(args, topology)
    shape = model = None
    if args.model is not None:
        model = load_model(args.model, seq_len=args.seq_len)
        shape = {
            "params": float(model.params),
            "layers": model.layers,
            "hidden": model.hidden,
            "topk": max(1, model.topk),
            "expert_fraction": model.expert_params / model.params if model.is_moe else 0.0,
        }
    placement = placement_from_args(args, topology, workload_from_args(args, shape))
    warnings = manual_warnings(
        placement,
        model=model,
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        gpu_memory_gb=args.gpu_memory_gb,
        pins=choices_from_args(args),
        settings=settings_from_args(args),
    )
    show_placement(args, placement, warnings)
    return 0
