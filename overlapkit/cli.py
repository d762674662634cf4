"""The ``overlapkit`` command: one sub-command per concern, each defined beside its module.

Every sub-command module exposes ``register(subparsers)``, which adds its parser and sets
``func(args) -> int`` (the exit code). Each takes ``--json`` for machines and prints a readable
table for people.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Sub-command -> the module that defines it (``register``). Only the module of the command
# given is imported, so ``overlapkit --help`` imports no torch and ``overlapkit topo`` does
# not pay for matplotlib, DTensor or the profiler.
COMMANDS = {
    "topo": "overlapkit.topology.cli",
    "plan": "overlapkit.planner.cli",
    "estimate": "overlapkit.planner.cli",
    "calibrate": "overlapkit.planner.cli",
    "report": "overlapkit.profiling.cli",
    "doctor": "overlapkit.doctor.cli",
}
COMMAND_MODULES = tuple(dict.fromkeys(COMMANDS.values()))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``overlapkit`` parser; with a known ``command``, only that command's module is loaded.

    Without one, every command is listed by name (``overlapkit COMMAND --help`` shows its
    options) and no command module is imported.
    """
    parser = argparse.ArgumentParser(
        prog="overlapkit",
        description="Topology, placement, cost model and overlap reports for distributed training.",
        epilog="Run 'overlapkit COMMAND --help' for a command's options.",
    )
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help=", ".join(COMMANDS)
    )
    if command in COMMANDS:
        importlib.import_module(COMMANDS[command]).register(subparsers)
    else:
        for name in COMMANDS:
            subparsers.add_parser(name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
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
