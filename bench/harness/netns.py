"""The network namespaces of emulated nodes, and the sweep of those a killed run left behind.

Two things build emulated nodes from namespaces: the placement benchmarks' ``TwoNodes``
(``bench.harness.two_nodes``, ``ovk<pid>a``/``b``) and the real-Slurm tests' cluster
(``tests/slurm_cluster.py``, ``ovkslurm<pid>n1``/``n2``). Each puts the id of the process that
creates the namespaces in their names and removes them on exit, on exceptions and on
SIGTERM/SIGHUP. A run killed outright (SIGKILL, an OOM kill, a CI runner's hard timeout) cannot:
its namespaces, the veth pair between them and any process still inside (Slurm's daemons and
job steps, or torchrun's ranks, which run in sessions of their own) stay. The next run sweeps
them: ``remove_stale_namespaces`` deletes each namespace whose name matches the caller's pattern
and whose creating process is gone, after killing the processes inside it (they were started
into it by that run; deleting the namespace would leave them running, unreachable).

It lives here, in the benchmark harness, because both the benchmarks and the tests use it and
the tests already import the harness (``tests/test_placement_two_nodes.py``), never the other
way; it is no part of the library: only emulation on one machine needs it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    return True


def namespaces() -> list[str]:
    """The named network namespaces (``ip netns list``)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in listing.stdout.splitlines() if line.strip()]


def processes_in(namespace: str) -> list[int]:
    """Ids of the processes whose network namespace is ``namespace`` (``ip netns pids``)."""
    listing = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False
    )
    return [int(pid) for pid in listing.stdout.split()]


def remove_stale_namespaces(pattern: re.Pattern[str]) -> list[str]:
    """Delete the namespaces a killed run left: names matching ``pattern`` whose process is gone.

    Args:
        pattern (re.Pattern): matches the caller's own namespace names in full; its group
            ``pid`` is the id of the process that created the namespace.

    Returns:
        list[str]: the namespaces removed. Deleting a namespace deletes its veth end, and with
        it the pair; the processes inside are SIGKILLed first, by id.
    """
    stale = [
        name
        for name in namespaces()
        if (match := pattern.fullmatch(name)) and not pid_alive(int(match["pid"]))
    ]
    for name in stale:
        for pid in processes_in(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    return stale
