"""``overlapkit calibrate``: the cost model's all-reduce fit (``cost.cli``); with ``--host``, also
what the planner needs to price ranks that compute on this host
(``train.planning.host_calibration``).

::

    overlapkit calibrate --host --ranks 4 --max-bytes 16MiB --output host.yaml
    overlapkit calibrate --host --ranks 4 --output host.yaml model=moe_tiny train.batch_size=4
    overlapkit-train parallel=auto topology=preset topology.name_or_path=host.yaml \\
        launcher.nproc_per_node=4

The trailing arguments are overlapkit-train's overrides for the model and micro-batch to
measure (its own spelling); without them gpt_tiny at ``train.batch_size`` 8.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from overlapkit.cost.calibrate import sizes_between
from overlapkit.cost.cli import add_calibrate_parser, run_calibrate
from overlapkit.topology.units import parse_size
from overlapkit.train.planning.host_calibration import calibrate_host


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``calibrate`` (with ``--host``) to the ``overlapkit`` command."""
    parser = add_calibrate_parser(subparsers)
    parser.add_argument(
        "--host",
        action="store_true",
        help="also measure the host terms the auto-planner needs to price CPU ranks (compute "
        "rate, per-collective, tensor-parallel and optimizer costs, overlap) and write them as "
        "the topology's accelerator section",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="OVERRIDE",
        help="with --host: overlapkit-train overrides of the model and micro-batch to measure "
        "(model=moe_tiny model.config.n_embd=256 train.batch_size=4)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``overlapkit calibrate [--host]``; the exit code."""
    if not args.host:
        if args.overrides:
            raise SystemExit(
                f"overlapkit calibrate: {args.overrides[0]!r}: overrides go with --host"
            )
        return run_calibrate(args)
    sizes = sizes_between(
        int(parse_size(args.min_bytes, what="--min-bytes")),
        int(parse_size(args.max_bytes, what="--max-bytes")),
    )
    options = {
        "budget_s": args.budget_s,
        "progress": not args.no_progress,
        "quantile": args.quantile,
        "fit_min_bytes": int(parse_size(args.fit_min_bytes, what="--fit-min-bytes")),
    }
    text, terms = calibrate_host(args.overrides, ranks=args.ranks, sizes=sizes, options=options)
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if args.json:
        print(json.dumps({"topology_file": str(path), "host": terms}, indent=2))
        return 0
    print(
        f"host: {terms['flops_per_s'] / 1e9:.3g} GFLOP/s per rank (forward and backward, every "
        f"rank at once); a collective call {terms['collective_overhead_s'] * 1e3:.3g} ms; tp "
        f"dispatch {terms['tp_layer_dispatch_s'] * 1e3:.3g} ms per layer pass; AdamW "
        f"{terms['optimizer_tensor_s'] * 1e6:.3g} us per tensor, "
        f"{terms['optimizer_dtensor_s'] * 1e6:.3g} us per DTensor, "
        f"{terms['optimizer_param_s'] * 1e9:.3g} ns per parameter; overlap efficiency "
        f"{terms['overlap_efficiency']:.2f}"
    )
    print(
        f"wrote {path}; plan and run with it: overlapkit-train parallel=auto topology=preset "
        f"topology.name_or_path={path} launcher.nproc_per_node={args.ranks}"
    )
    return 0
