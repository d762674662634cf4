"""The ``overlapkit`` command: one sub-command per concern, each defined beside its module.

Every sub-command module exposes ``register(subparsers)``, which adds its parser and sets
``func(args) -> int`` (the exit code). Each takes ``--json`` for machines and prints a readable
table for people.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Imported lazily so that ``overlapkit topo`` does not pay for matplotlib or the profiler.
COMMAND_MODULES = (
    "overlapkit.topology.cli",
    "overlapkit.planner.cli",
    "overlapkit.profiling.cli",
    "overlapkit.doctor.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="overlapkit",
        description="Topology, placement, cost model and overlap reports for distributed training.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        # Bad input is reported as one line naming the offending value, not a traceback.
        print(f"overlapkit {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # ``overlapkit topo ... | head`` closed the pipe: not an error of ours.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
