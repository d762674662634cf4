"""The ``overlapkit`` command: one sub-command per concern, each defined beside its module.

Every sub-command module exposes ``register(subparsers)``, which adds its parser and sets
``func(args) -> int`` (the exit code). Each takes ``--json`` for machines and prints a readable
table for people.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Iterator

# Sub-command -> the module that defines it (``register``). Only the module of the command
# given is imported, so ``overlapkit --help`` imports no torch and ``overlapkit topo`` does
# not pay for matplotlib, DTensor or the profiler.
COMMANDS = {
    "topo": "overlapkit.topology.cli",
    "plan": "overlapkit.autoplan.cli",
    "estimate": "overlapkit.planner.cli",
    "calibrate": "overlapkit.train.planning.calibrate_cli",
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


@contextlib.contextmanager
def json_only_stdout() -> Iterator[None]:
    """Keep stdout for the JSON meanwhile: other writes to file descriptor 1 go to stderr.

    C++ code writes to file descriptor 1 directly: torch 2.9's gloo prints "[Gloo] Rank 0 is
    connected to 1 peer ranks" there when a process group connects, in this process (under
    torchrun) and in the ranks it starts, which inherit the descriptor. Meanwhile descriptor 1
    points at stderr, and ``sys.stdout``, when it writes to descriptor 1, writes to a duplicate
    of the real stdout instead, so ``print`` still reaches it.
    """
    try:
        python_on_fd1 = sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):  # replaced (a test's capture) or closed
        python_on_fd1 = False
    sys.stdout.flush()
    stdout_fd = os.dup(1)
    os.dup2(2, 1)
    saved = sys.stdout
    try:
        with contextlib.ExitStack() as stack:
            if python_on_fd1:
                # Closed (flushed into stdout_fd, which stays open) when the command is done.
                sys.stdout = stack.enter_context(
                    open(
                        stdout_fd, "w", encoding=saved.encoding, errors=saved.errors, closefd=False
                    )
                )
            yield
    finally:
        sys.stdout = saved
        os.dup2(stdout_fd, 1)
        os.close(stdout_fd)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        # Every command's --json output is parsed by machines: nothing else may reach stdout.
        with json_only_stdout() if getattr(args, "json", False) else contextlib.nullcontext():
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
