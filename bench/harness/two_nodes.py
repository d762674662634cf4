"""Two emulated nodes on this machine: network namespaces joined by a rate-limited veth pair.

    with TwoNodes(rate="4gbit") as nodes:
        outputs = nodes.torchrun(["-m", "bench.placement", "--worker"], nproc_per_node=2)

Each node is a network namespace holding its loopback and one end of a veth pair
(10.231.0.1/30 and 10.231.0.2/30); ``tc tbf`` limits each end to ``rate``. Ranks of one node talk
through loopback at memory speed, ranks of different nodes cross the veth (see
docs/emulation.md). torchrun's c10d rendezvous is hosted on node 0; gloo is pinned to each
namespace's veth address (``GLOO_SOCKET_IFNAME``), and a local peer's address still routes
through ``lo``.

Namespace and link names carry this process's id, so parallel or leftover runs never collide.
Everything is removed on exit: on success, on exceptions, and on SIGTERM/SIGHUP (turned into
SystemExit so that ``finally`` runs). A run killed outright (SIGKILL) cannot clean up; the next
one removes the namespaces whose process id is no longer alive, and what still runs in them
(``remove_stale_namespaces``, with the Slurm test cluster's helper: ``bench.harness.netns``).
The torchrun processes are killed by their process group, which this module created.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness import netns

_SUBNET = "10.231.0"
_OURS = re.compile(r"ovk(?P<pid>\d+)[ab]")
_RDZV_PORT = 29400


def unavailable_reason() -> str | None:
    """None when two namespaces with a tc-limited veth can be made here, else why not."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    probe = f"ovkprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
              "rate", "1gbit", "burst", "256kb", "latency", "100ms"])  # fmt: skip
    except subprocess.CalledProcessError as err:
        return f"ip netns / tc failed: {(err.stderr or '').strip() or err}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def remove_stale_namespaces() -> list[str]:
    """Delete the namespaces a killed ``TwoNodes`` left (``ovk<pid>a``/``b`` whose process is
    gone, and the processes still inside them: ``bench.harness.netns``). Returns their names."""
    return netns.remove_stale_namespaces(_OURS)


def _run(command: Sequence[str]) -> None:
    subprocess.run(list(command), check=True, capture_output=True, text=True, timeout=30)


def _ip(*args: str) -> None:
    _run(["ip", *args])


@dataclass(frozen=True, slots=True)
class Node:
    namespace: str
    interface: str
    address: str


class TwoNodes:
    """Context manager that creates the two namespaces and removes them on exit.

    Args:
        rate (str): tc rate of the link in each direction, e.g. ``"4gbit"``.
    """

    def __init__(self, rate: str = "4gbit"):
        self.rate = rate
        suffix = f"{os.getpid()}"
        self.nodes = tuple(
            Node(f"ovk{suffix}{tag}", f"ovk{suffix}{tag}", f"{_SUBNET}.{i + 1}")
            for i, tag in enumerate("ab")
        )
        self._created: list[str] = []
        self._previous_handlers: dict[int, object] = {}

    def __enter__(self) -> TwoNodes:
        self._trap_signals()
        remove_stale_namespaces()
        try:
            self._create()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _trap_signals(self) -> None:
        def leave(signum, frame):
            raise SystemExit(128 + signum)

        for signum in (signal.SIGTERM, signal.SIGHUP):
            self._previous_handlers[signum] = signal.signal(signum, leave)

    def _create(self) -> None:
        a, b = self.nodes
        for node in self.nodes:
            _ip("netns", "add", node.namespace)
            self._created.append(node.namespace)
        # The pair is created in the root namespace and moved; deleting a namespace deletes
        # its end and with it the whole pair.
        _ip("link", "add", a.interface, "type", "veth", "peer", "name", b.interface)
        for node in self.nodes:
            _ip("link", "set", node.interface, "netns", node.namespace)
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/30", "dev", node.interface)
            _ip("-n", node.namespace, "link", "set", node.interface, "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            _run(["ip", "netns", "exec", node.namespace, "tc", "qdisc", "add", "dev",
                  node.interface, "root", "tbf", "rate", self.rate, "burst", "256kb",
                  "latency", "100ms"])  # fmt: skip

    def _remove(self) -> None:
        for namespace in reversed(self._created):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        self._created.clear()
        # A pair left in the root namespace (creation failed before the move) goes too.
        subprocess.run(
            ["ip", "link", "del", self.nodes[0].interface], capture_output=True, check=False
        )
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def torchrun(
        self,
        script_and_args: Sequence[str],
        *,
        nproc_per_node: int = 2,
        timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
        autogroup_nice: int | None = None,
        cwd: Path | None = None,
    ) -> list[str]:
        """Run ``python -m torch.distributed.run ... script_and_args`` on both nodes.

        Args:
            script_and_args (Sequence[str]): what torchrun starts per rank: a script and its
                arguments, or ``-m`` and a module (found from ``cwd``, e.g. ``bench.placement``
                from the repository root).
            autogroup_nice (int): scheduling priority of each node's session (-19 gives the
                ranks the CPU ahead of other work on a shared machine; root only, best effort).
            cwd (Path): the nodes' working directory. Defaults to this process's.

        Returns:
            list[str]: each node's combined stdout and stderr.

        Raises:
            RuntimeError: a node exited non-zero or the run exceeded ``timeout_s`` (its output
                is in the message).
        """
        run_id = uuid.uuid4().hex[:12]
        host = self.nodes[0].address
        procs = []
        with tempfile.TemporaryDirectory(prefix="ovk-two-nodes-") as scratch:
            logs = [Path(scratch) / f"node{i}.log" for i in range(len(self.nodes))]
            try:
                for i, node in enumerate(self.nodes):
                    command = [
                        "ip", "netns", "exec", node.namespace,
                        "env", f"GLOO_SOCKET_IFNAME={node.interface}",
                        sys.executable, "-m", "torch.distributed.run",
                        "--nnodes", str(len(self.nodes)),
                        "--nproc-per-node", str(nproc_per_node),
                        "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"{host}:{_RDZV_PORT}",
                        "--rdzv-id", run_id,
                        # The endpoint's host is an address of node 0's namespace, which torch
                        # cannot recognise as local by hostname: say which node hosts it.
                        "--rdzv-conf", f"is_host={int(i == 0)}",
                        "--local-addr", node.address,
                        *script_and_args,
                    ]  # fmt: skip
                    with open(logs[i], "w") as log:
                        procs.append(
                            subprocess.Popen(
                                command,
                                stdout=log,
                                stderr=subprocess.STDOUT,
                                # torchrun's log directories go to TMPDIR: keep them in
                                # the scratch directory, which is removed with the run.
                                env={**os.environ, "TMPDIR": scratch, **(env or {})},
                                cwd=cwd,
                                start_new_session=True,
                            )
                        )
                    if autogroup_nice is not None:
                        _set_autogroup_nice(procs[-1].pid, autogroup_nice)
                deadline = time.monotonic() + timeout_s
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                    time.sleep(0.2)
                timed_out = any(p.poll() is None for p in procs)
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            outputs = [log.read_text() for log in logs]
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        if timed_out or failed:
            why = f"timed out after {timeout_s:g} s" if timed_out else f"nodes {failed} failed"
            tails = "\n".join(f"--- node {i} ---\n{o[-4000:]}" for i, o in enumerate(outputs))
            raise RuntimeError(f"two-node torchrun {why}:\n{tails}")
        return outputs


def _set_autogroup_nice(pid: int, nice: int) -> None:
    # The session's scheduling group: every rank torchrun starts shares it.
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
