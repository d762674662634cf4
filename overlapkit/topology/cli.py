"""``overlapkit topo``: show and validate a topology (preset, file or detected)."""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch.distributed as dist

from overlapkit.topology.detect import detect_topology
from overlapkit.topology.loading import load_topology, preset_names
from overlapkit.topology.model import FabricKind, Topology
from overlapkit.topology.units import rank_ranges, text_table

FABRIC_CHOICES = [k.value for k in FabricKind if k is not FabricKind.NONE]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``topo`` to the ``overlapkit`` command."""
    parser = subparsers.add_parser(
        "topo",
        help="show or validate a topology: domains, nodes, rails, bandwidths",
        description="Print a topology as a table (or JSON). Presets: "
        + ", ".join(preset_names())
        + "; append x<N> for N nodes (dgx-h100x4).",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", metavar="NAME", help="a shipped preset, e.g. dgx-h100x4")
    source.add_argument("--file", metavar="F", help="a topology YAML file")
    source.add_argument(
        "--detect",
        action="store_true",
        help="detect this machine (the default; under torchrun, every rank)",
    )
    parser.add_argument(
        "--fabric",
        choices=FABRIC_CHOICES,
        help="switch the scale-out fabric (default: what the topology says)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def topology_from_args(args: argparse.Namespace) -> Topology:
    """The topology ``--preset`` / ``--file`` / ``--detect`` name, with ``--fabric`` applied."""
    if args.preset or args.file:
        return load_topology(args.preset or args.file, fabric=args.fabric)
    return _detect_job(args.fabric)


def _detect_job(fabric: str | None) -> Topology:
    """Detect; launched by torchrun (``torchrun --no-python overlapkit topo``), over all ranks."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return detect_topology(fabric=fabric)
    # gloo carries the rank views on any machine; only their all-gather runs on it.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        return detect_topology(fabric=fabric)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    topology = topology_from_args(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(topology.to_dict(), indent=2) if args.json else render(topology))
    return 0


def render(topology: Topology) -> str:
    """The readable table ``overlapkit topo`` prints."""
    fabric = topology.fabric
    lines = [
        f"topology {topology.name}: {topology.world_size} device(s) on "
        f"{topology.num_nodes} node(s), collective library {topology.library}",
        "",
        "scale-up domains (bandwidth per device and direction)",
    ]
    lines += text_table(
        ["#", "kind", "ranks", "spec GB/s", "achieved GB/s", "links", "latency", "in-network"],
        [
            [
                str(i),
                str(d.kind) + (f" {'x'.join(map(str, d.torus))}" if d.torus else ""),
                rank_ranges(d.ranks),
                f"{d.bandwidth_GBps:g}",
                f"{d.achieved_GBps:.4g}",
                str(d.links),
                f"{d.latency_us:g} us",
                "yes" if d.in_network_reduction else "no",
            ]
            for i, d in enumerate(topology.domains)
        ],
    )
    lines += [
        "",
        f"scale-out fabric: {fabric.kind}, {fabric.transport}, "
        f"{fabric.nics_per_node} NIC(s) per node x {fabric.nic_GBps:g} GB/s "
        f"(achieved {fabric.achieved_GBps:.4g}), {fabric.latency_us:g} us per step, "
        f"oversubscription {fabric.oversubscription:g}"
        + (", in-network reduction" if fabric.in_network_reduction else ""),
    ]
    lines += ["", "nodes"]
    lines += text_table(
        ["node", "ranks"], [[str(i), rank_ranges(r)] for i, r in enumerate(topology.nodes())]
    )
    lines += ["", "rails (ranks sending through NIC i of their node)"]
    lines += text_table(
        ["rail", "ranks"], [[str(i), rank_ranges(r)] for i, r in enumerate(topology.rails())]
    )
    return "\n".join(lines)
