"""How overlapkit starts local worker processes: forked from a server that has imported torch.

A spawned worker starts a fresh interpreter and imports torch, torch.distributed and overlapkit
again: about 3 s of CPU per worker on a 2-core machine
(``time python -c 'import overlapkit.train.launch.elastic'``), more than a test or a small job
trains.
``multiprocessing``'s *forkserver* start method pays for that import once per parent process: one
server process imports ``PRELOAD``, then every worker is a ``fork()`` of that server. The server
has started no threads and touched no CUDA device (importing torch initialises neither), so
forking it is as safe as spawning; it is the start method torch elastic offers besides spawn,
and Python 3.14's default on Linux.

The price is that a worker inherits the server's environment, working directory and
``sys.path`` from when the server started, not the parent's at the time of the launch. A parent
therefore sends its current ones (``ParentState.capture()``) and the worker adopts them first
(``ParentState.adopt()``), which gives it what a spawned worker would have had.

The server starts with the first worker, or earlier through ``start_server()``: ``overlapkit-train``
starts it before it imports anything heavy itself, so that the server's imports run on another
core beside the launcher's own (Hydra, the training loop's modules) instead of after them.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
from dataclasses import dataclass
from multiprocessing.context import ForkServerContext

PRELOAD = ["overlapkit.workers.local_ranks", "overlapkit.train.launch.elastic"]
"""Imported by the server before it forks any worker: the entry points of both kinds of worker
(``run_on_ranks``'s and ``overlapkit-train``'s) and, through them, torch and overlapkit."""

# Imported in the server as part of PRELOAD, so in every worker this is the environment the
# server started with, which is what the worker has before its launcher adds per-rank keys.
_SERVER_ENVIRON = dict(os.environ)


def context() -> ForkServerContext:
    """The forkserver context, with ``PRELOAD`` set for a server not started yet.

    The server is one per parent process; once it runs, a new preload list has no effect, so
    every caller in overlapkit names the same one.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_server() -> None:
    """Start this process's server now, importing ``PRELOAD`` in the background; the workers
    started later (by ``context()`` or torch elastic's forkserver start method) fork from it.
    Returns at once; a no-op where the server runs already."""
    context()
    multiprocessing.forkserver.ensure_running()


@dataclass(frozen=True, slots=True)
class ParentState:
    """The parent's environment, working directory and ``sys.path`` at a launch."""

    environ: dict[str, str]
    cwd: str
    path: list[str]

    @classmethod
    def capture(cls) -> ParentState:
        return cls(environ=dict(os.environ), cwd=os.getcwd(), path=list(sys.path))

    def adopt(self) -> None:
        """Make this worker's environment, directory and path the parent's.

        Keys the worker's launcher set for this worker (torch elastic's ``RANK``,
        ``LOCAL_RANK``, ``TORCHELASTIC_*``, ...) differ from the server's and are kept; every
        other key takes the parent's value, or goes when the parent no longer has it.
        """
        for key in set(_SERVER_ENVIRON) | set(os.environ) | set(self.environ):
            if os.environ.get(key) != _SERVER_ENVIRON.get(key):
                continue  # set for this worker after the fork
            if key in self.environ:
                os.environ[key] = self.environ[key]
            else:
                os.environ.pop(key, None)
        os.chdir(self.cwd)
        sys.path[:] = self.path
