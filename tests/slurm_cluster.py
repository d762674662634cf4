"""A real Slurm cluster of two emulated nodes on this machine, for the ``launcher=slurm`` tests.

    with SlurmCluster() as cluster:
        job = cluster.sbatch(["recipes/slurm/train.sbatch", ...], cwd=run_root)
        assert cluster.wait(job) == "COMPLETED"

Debian's ``munge``, ``slurmctld``, ``slurmd`` and ``slurm-client`` (``.ci/slurm-setup`` installs
them). Each node is a network namespace with its own address (a veth pair joins the two, see
docs/emulation.md), its own host name (a UTS namespace: ``n1``, ``n2``) and an ``/etc/hosts``
naming both (``ip netns exec`` mounts ``/etc/netns/<namespace>/hosts`` over it), so that Slurm,
torch's rendezvous and gloo find the nodes by name, as on a cluster. ``slurmd -N <node>`` runs
in each; ``slurmctld`` and the client commands run on node 1. munged listens on a socket in the
cluster's temporary directory with a key of its own; the daemons run in the foreground as
children of this process, and the configuration says ``proctrack/linuxproc`` and
``task/none``: no cgroups, no systemd. Job credentials live 5 s (``cred_expire``, 120 s by
default), which is also how long Slurm holds a requeued job back.

Everything is removed on exit, also after a failure: jobs, daemons (by their process ids),
every process left in the namespaces, the namespaces, ``/etc/netns/<namespace>`` and the
temporary directory. Slurm's ports are inside the namespaces, so none is bound on the machine
itself; ``__exit__`` checks that no process is left in them. A run killed outright (SIGKILL)
cannot clean up: the next cluster first removes the namespaces named after a process that is
gone, with the daemons still running in them (``remove_stale_namespaces``; the sweep is
``bench.harness.netns``'s, shared with the benchmarks' ``TwoNodes``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.harness import netns

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "ip", "nsenter", "unshare")
_SUBNET = "10.232.0"
NAMESPACES = re.compile(r"ovkslurm(?P<pid>\d+)n\d+")
"""The cluster's namespace names, ``ovkslurm<pid of the process that made them><node>``."""
_FINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE", "PREEMPTED",
}  # fmt: skip


def unavailable_reason() -> str | None:
    """None when a cluster can be started here, else why not."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root (network namespaces, Slurm daemons)"
    missing = [tool for tool in _BINARIES if shutil.which(tool) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed; run .ci/slurm-setup (apt-get install "
            f"{' '.join(PACKAGES)})"
        )
    return None


def remove_stale_namespaces() -> list[str]:
    """Remove the namespaces (and what runs in them) of clusters whose process was killed."""
    return netns.remove_stale_namespaces(NAMESPACES)


def _run(command: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(command), check=True, capture_output=True, text=True, timeout=60, **kwargs
    )


class SlurmCluster:
    """Context manager: start munged, slurmctld and one slurmd per node; stop them on exit.

    The nodes are ``n1`` (10.232.0.1, also the controller) and ``n2`` (10.232.0.2).
    """

    def __init__(self) -> None:
        suffix = os.getpid()
        self.names = ["n1", "n2"]
        self.namespaces = [f"ovkslurm{suffix}{name}" for name in self.names]
        assert all(NAMESPACES.fullmatch(namespace) for namespace in self.namespaces)
        self.addresses = [f"{_SUBNET}.{i + 1}" for i in range(len(self.names))]
        self.root = Path(tempfile.mkdtemp(prefix="ovk-slurm-"))
        self.conf = self.root / "slurm.conf"
        self._daemons: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._previous_handlers: dict[int, object] = {}
        self.leftover_pids: list[str] = []

    def __enter__(self) -> SlurmCluster:
        # A SIGTERM (``timeout``, a CI runner) becomes SystemExit, so that __exit__ still runs:
        # the daemons live in sessions of their own and would outlive this process.
        def leave(signum, frame):
            raise SystemExit(128 + signum)

        self._previous_handlers = {
            signum: signal.signal(signum, leave) for signum in (signal.SIGTERM, signal.SIGHUP)
        }
        remove_stale_namespaces()
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    # --- start ---------------------------------------------------------------------------

    def _start(self) -> None:
        self.root.chmod(0o755)  # munged and slurmstepd check the directories above their files
        for sub in ("munge", "state", "log", *(f"spool/{n}" for n in self.names)):
            (self.root / sub).mkdir(parents=True)
        self._network()
        self._munge()
        self.conf.write_text(self._slurm_conf())
        self._spawn(self._on_node(0, "slurmctld -D -i"))
        for i, name in enumerate(self.names):
            self._spawn(self._on_node(i, f"slurmd -D -N {name}"))
        self._wait_idle(timeout_s=60)

    def _on_node(self, node: int, command: str) -> list[str]:
        """``command`` (a daemon of ``node``) in the node's network, host name and hosts file.

        ``nsenter --net`` rather than ``ip netns exec``: the latter mounts a fresh ``/sys``
        without the cgroup file systems, and slurmd 22.05 refuses to start without them. The
        mount namespace of ``unshare`` keeps the bind mount of ``/etc/hosts`` private.
        """
        return [
            "nsenter", f"--net=/run/netns/{self.namespaces[node]}",
            "unshare", "--mount", "--uts", "sh", "-c",
            f"mount --bind {self.root / 'hosts'} /etc/hosts && hostname {self.names[node]} && "
            f"exec {command} -f {self.conf}",
        ]  # fmt: skip

    def _network(self) -> None:
        (self.root / "hosts").write_text(
            "127.0.0.1 localhost\n"
            + "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.names, strict=True))
        )
        for namespace in self.namespaces:
            _run(["ip", "netns", "add", namespace])
            self._created.append(namespace)
        # The pair is created here and moved; deleting a namespace deletes the whole pair.
        links = [f"{namespace[-12:]}v" for namespace in self.namespaces]
        _run(["ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1]])
        for namespace, link, address in zip(self.namespaces, links, self.addresses, strict=True):
            _run(["ip", "link", "set", link, "netns", namespace])
            _run(["ip", "-n", namespace, "addr", "add", f"{address}/30", "dev", link])
            _run(["ip", "-n", namespace, "link", "set", link, "up"])
            _run(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def _munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "munge").chmod(0o700)
        (self.root / "munge-socket").mkdir(mode=0o755)
        self.munge_socket = self.root / "munge-socket" / "munge.socket"
        # --force: run as root with a key this test owns.
        files = self.root / "munge"
        self._spawn(
            ["munged", "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--pid-file={files / 'pid'}", f"--seed-file={files / 'seed'}",
             f"--log-file={self.root / 'log' / 'munged.log'}"],
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while not self.munge_socket.exists():
            if time.monotonic() > deadline or self._daemons[-1].poll() is not None:
                raise RuntimeError(f"munged did not start:\n{self.logs()}")
            time.sleep(0.1)

    def _slurm_conf(self) -> str:
        node = _run(["slurmd", "-C"]).stdout.splitlines()[0]
        # "NodeName=vm CPUs=2 ... RealMemory=24105": this machine's shape, for every node.
        shape = re.sub(r"^NodeName=\S+\s*", "", node)
        nodes = "".join(
            f"NodeName={name} NodeAddr={address} {shape} State=UNKNOWN\n"
            for name, address in zip(self.names, self.addresses, strict=True)
        )
        r = self.root
        return f"""\
ClusterName=overlapkit
SlurmctldHost={self.names[0]}({self.addresses[0]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=5
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=10
MinJobAge=3600
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, command: Sequence[str]) -> None:
        with open(self.root / "log" / "daemons.out", "a") as log:
            self._daemons.append(
                subprocess.Popen(
                    list(command),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=self.env(),
                )
            )

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states = ""
        while time.monotonic() < deadline:
            dead = [d.args for d in self._daemons if d.poll() is not None]
            if dead:
                raise RuntimeError(f"a Slurm daemon exited: {dead}\n{self.logs()}")
            result = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = result.stdout.strip()
            lines = states.splitlines()
            if len(lines) == len(self.names) and all(line.endswith(" idle") for line in lines):
                return
            time.sleep(0.5)
        raise RuntimeError(f"nodes not idle after {timeout_s:g} s: {states!r}\n{self.logs()}")

    # --- use ---------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The environment of client commands (and of the jobs they submit)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(
        self,
        command: Sequence[str],
        *,
        check: bool = True,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 60,
    ) -> subprocess.CompletedProcess:
        """Run a client command (``sbatch``, ``scontrol``, ``srun``...) in node 1's network."""
        return subprocess.run(
            ["nsenter", f"--net=/run/netns/{self.namespaces[0]}", *command],
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout_s,
            cwd=cwd,
            env={**self.env(), **(env or {})},
        )

    def sbatch(self, args: Sequence[str], *, cwd: Path, env: dict[str, str] | None = None) -> int:
        """Submit a batch job from ``cwd``; returns its job id."""
        result = self.run(["sbatch", "--parsable", *args], cwd=cwd, env=env)
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields of the job."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(
            field.split("=", 1) for field in out.split() if "=" in field and field[0].isupper()
        )

    def wait(self, job_id: int, *, timeout_s: float, states: set[str] = _FINAL_STATES) -> str:
        """Wait until the job reaches one of ``states``; returns it.

        Raises:
            TimeoutError: it did not within ``timeout_s`` (it is cancelled).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.job(job_id).get("JobState", "")
            if state in states:
                return state
            time.sleep(0.5)
        self.run(["scancel", str(job_id)], check=False)
        raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout_s:g} s")

    def logs(self) -> str:
        """The daemons' log files, for failure messages."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            with contextlib.suppress(OSError):
                parts.append(f"--- {path.name} ---\n{path.read_text()[-3000:]}")
        return "\n".join(parts)

    # --- stop ----------------------------------------------------------------------------

    def __exit__(self, *exc: object) -> None:
        if self._daemons and self.conf.exists():
            with contextlib.suppress(Exception):
                self.run(["scancel", "--user=root"], check=False)
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in reversed(self._daemons):
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()
        leftovers = []
        for namespace in self._created:
            # Job processes that outlived their slurmd (slurmstepd, tasks) are ours: kill them.
            pids = netns.processes_in(namespace)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            leftovers += [str(pid) for pid in pids]
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        self._created.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        self.leftover_pids = leftovers
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def left_behind(self) -> list[str]:
        """What ``__exit__`` found still running or existing: must be empty."""
        found = [f"process {pid} in a namespace" for pid in self.leftover_pids]
        found += [f"daemon {d.args} pid {d.pid}" for d in self._daemons if d.poll() is None]
        listed = netns.namespaces()
        found += [f"namespace {ns}" for ns in self.namespaces if ns in listed]
        if self.root.exists():
            found.append(str(self.root))
        return found
