"""``overlapkit estimate``, and what ``overlapkit plan`` shares with it: the topology and the
parallel sizes a command takes, the placement they make, and how a placement is shown.

``estimate`` is defined here rather than beside the cost model (``overlapkit/cost``) because
``--group AXIS`` estimates a group of a placement. ``plan`` is defined by the auto-planner
(``overlapkit/autoplan/cli.py``), which places the sizes given or searches them (``--auto``).
"""

from __future__ import annotations

import argparse
import json

from overlapkit.cost.estimate import ALGORITHMS, COLLECTIVES, Estimate, estimate
from overlapkit.cost.published import render_checks, validate
from overlapkit.planner.explain import (
    PICTURE_MAX_RANKS,
    compare_table,
    rank_grid_picture,
    same_layout,
)
from overlapkit.planner.placement import Placement, naive_placement, plan
from overlapkit.planner.traffic import MIXTRAL_EXPERT_FRACTION, Workload
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
    """Add ``estimate`` to the ``overlapkit`` command."""
    _add_estimate(subparsers)


def add_topology_arguments(
    parser: argparse.ArgumentParser, *, allow_link: bool
) -> argparse._MutuallyExclusiveGroup:
    """Add ``--topology``, ``--fabric`` and (``allow_link``) ``--bandwidth``, ``--latency``.

    Returns the (required) group of topology sources, for a command with another source.
    """
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
    return source


def topology_from_args(args: argparse.Namespace, *, group_size: int | None) -> Topology:
    latency = getattr(args, "latency", None)
    if getattr(args, "bandwidth", None) is not None:  # "--bandwidth=" too: refused by name
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


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the parallel sizes ``--tp --ep --cp --pp --dp --dp-shard``."""
    sizes = parser.add_argument_group("parallel sizes")
    for name, what in (
        ("tp", "tensor"),
        ("ep", "expert"),
        ("cp", "context"),
        ("pp", "pipeline"),
    ):
        sizes.add_argument(
            f"--{name}", type=int, help=f"{what}-parallel size (1; free under --auto)"
        )
    sizes.add_argument(
        "--dp",
        type=int,
        help="data-parallel size (-1, the default: whatever is left; free under --auto)",
    )
    sizes.add_argument(
        "--dp-shard",
        type=int,
        metavar="N",
        help="split dp into dp_replicate x dp_shard (HSDP) with N ranks per shard group",
    )


def placement_from_args(
    args: argparse.Namespace, topology: Topology, workload: Workload | None = None
) -> Placement:
    return plan(
        topology,
        tp=_size(args.tp),
        ep=_size(args.ep),
        cp=_size(args.cp),
        pp=_size(args.pp),
        dp=-1 if args.dp is None else args.dp,
        dp_shard=args.dp_shard,
        order=getattr(args, "order", None),
        allow_split=getattr(args, "allow_split", False),
        workload=workload,
    )


def _size(value: int | None) -> int:
    """A size flag left unset means 1 (outside --auto, where it would be free)."""
    return 1 if value is None else value


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """Add what a manual ``plan`` takes beyond the sizes: ``--order``, ``--allow-split``, the
    model's shape for the predicted communication, ``--algorithm`` and ``--compare``."""
    parser.add_argument(
        "--order",
        type=lambda text: tuple(a.strip() for a in text.split(",")),
        metavar="AXES",
        help="override the traffic order: mesh axes outermost first, e.g. pp,dp,ep,cp,tp",
    )
    parser.add_argument(
        "--allow-split",
        action="store_true",
        help="place it even when a group straddles scale-up domains (shows the penalty)",
    )
    model = parser.add_argument_group("model (for the predicted communication)")
    model.add_argument("--params", default="7e9", help="parameters, e.g. 70e9 (default 7e9)")
    model.add_argument("--dtype", default="bf16", help="bf16 | fp16 | fp32 | fp8 (bf16)")
    model.add_argument("--layers", type=int, help="layers (default: from --params)")
    model.add_argument("--hidden", type=int, help="hidden size (default: from --params)")
    model.add_argument("--seq-len", type=int, help="tokens per sequence (4096)")
    model.add_argument(
        "--micro-batch", type=int, help="sequences per micro-batch (1; free under --auto)"
    )
    model.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (8)")
    model.add_argument("--topk", type=int, default=2, help="experts per token, ep > 1 (2)")
    model.add_argument(
        "--expert-fraction",
        type=float,
        default=MIXTRAL_EXPERT_FRACTION,
        help=f"share of parameters in experts, ep > 1 ({MIXTRAL_EXPERT_FRACTION})",
    )
    parser.add_argument(
        "--algorithm",
        choices=ALGORITHMS,
        help="force an algorithm where it can run (like NCCL_ALGO); default: the fastest",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="show the naive arange layout (init_device_mesh) beside the plan",
    )


def workload_from_args(args: argparse.Namespace, shape: dict | None = None) -> Workload:
    """The ``Workload`` a manual plan explains: ``shape`` (params, layers, hidden, topk,
    expert_fraction; from a model) or the ``--params ...`` flags, with the batch flags."""
    if shape is None:
        shape = {
            "params": parse_size(args.params, what="--params"),
            "layers": args.layers,
            "hidden": args.hidden,
            "topk": args.topk,
            "expert_fraction": args.expert_fraction,
        }
    return Workload(
        dtype=args.dtype,
        seq_len=4096 if args.seq_len is None else args.seq_len,
        micro_batch=_size(args.micro_batch),
        microbatches=args.microbatches,
        **shape,
    )


def show_placement(args: argparse.Namespace, placement: Placement, warnings: list[str]) -> None:
    """Print a manual plan: its JSON document (``--json``) or its explanation, the warnings
    and (``--compare``) the naive arange layout beside it."""
    naive = naive_placement(placement) if args.compare else None
    if args.json:
        doc = placement.to_dict(args.algorithm)
        doc["warnings"] = warnings
        if naive is not None:
            doc["naive"] = naive.to_dict(args.algorithm)
        print(json.dumps(doc, indent=2))
        return
    print(placement.explain(args.algorithm))
    for warning in warnings:
        print(f"warning: {warning}")
    if naive is not None:
        lines = ["", *compare_table(placement, naive, algorithm=args.algorithm)]
        if naive.world_size <= PICTURE_MAX_RANKS and not same_layout(naive, placement):
            lines += ["", "naive arange layout:", *rank_grid_picture(naive)]
        print("\n".join(lines))


def _add_estimate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate",
        help="predict one collective's time, algbw and busbw on a topology",
        description="Predict a collective's time with the alpha-beta model and NCCL-like "
        "algorithm choice. Sizes: 140e9, 140GB, 1.5GiB.",
    )
    parser.add_argument("--collective", metavar="NAME", help=f"one of {', '.join(COLLECTIVES)}")
    parser.add_argument(
        "--bytes", metavar="SIZE", help="size as nccl-tests counts it: 140e9, 140GB, 1.5GiB"
    )
    source = add_topology_arguments(parser, allow_link=True)
    parser.add_argument(
        "--group-size",
        type=int,
        metavar="N",
        help="the group is the topology's first N devices (default: all)",
    )
    parser.add_argument(
        "--group",
        metavar="AXIS",
        help="a placement axis (tp, dp, ...) of the plan the sizes below make; the slowest "
        "of its groups is estimated",
    )
    add_plan_arguments(parser)
    parser.add_argument(
        "--algorithm",
        choices=ALGORITHMS,
        help="force an algorithm (like NCCL_ALGO); default: the fastest",
    )
    source.add_argument(
        "--validate",
        action="store_true",
        help="instead of one estimate, predict every published nccl-tests busbw the model is "
        "checked against (system, published, predicted, error, source)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run_estimate)


def run_estimate(args: argparse.Namespace) -> int:
    if args.validate:
        checks = validate()
        if args.json:
            print(json.dumps({"checks": [c.to_dict() for c in checks]}, indent=2))
        else:
            print(render_checks(checks))
        return 0 if all(c.accepted for c in checks) else 1
    missing = [flag for flag in ("collective", "bytes") if getattr(args, flag) is None]
    if missing:
        raise ValueError(f"estimate needs {' and '.join('--' + m for m in missing)}")
    nbytes = parse_size(args.bytes, what="--bytes")
    if args.group is not None and args.group_size is not None:
        raise ValueError("pass either --group (a placement axis) or --group-size, not both")
    sizes = (args.tp, args.ep, args.cp, args.pp, args.dp, args.dp_shard)
    if args.group is None and any(s not in (None, 1, -1) for s in sizes):
        raise ValueError("--tp/--ep/--cp/--pp/--dp/--dp-shard make a placement for --group AXIS")
    if args.group is not None and args.bandwidth is not None:
        raise ValueError("--group needs --topology (a placement is made on a topology)")
    topology = topology_from_args(args, group_size=args.group_size)
    placement = placement_from_args(args, topology) if args.group is not None else None
    result = estimate(
        args.collective,
        nbytes=nbytes,
        topology=topology,
        group=args.group,
        group_size=args.group_size,
        algorithm=args.algorithm,
        placement=placement,
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
