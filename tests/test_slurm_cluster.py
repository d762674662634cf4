"""``sbatch recipes/slurm/train.sbatch`` on a real Slurm: two emulated nodes on this machine.

The cluster (``tests/slurm_cluster.py``: munged, slurmctld, one slurmd per network namespace)
is started once for this module and stopped afterwards; the module checks that nothing of it is
left. Without root or Debian's Slurm packages the tests are skipped, saying why, unless
``OVERLAPKIT_REQUIRE_SLURM=1`` (set by ``.ci/run``, which installs them) makes that a failure.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import netns, two_nodes
from overlapkit.train.launch.slurm import expand_hostlist
from tests.faults import KILL_ENV, WORKER_INIT
from tests.slurm_cluster import SlurmCluster, unavailable_reason

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "slurm" / "train.sbatch"
REQUIRE_ENV = "OVERLAPKIT_REQUIRE_SLURM"
# The recipe asks for GPU nodes; these overrides fit the emulated CPU nodes and a tiny model.
NO_GPUS = ["--gpus-per-node=0", "--cpus-per-task=1"]
SMALL = [
    "model.config.n_layer=2",
    "model.config.n_embd=32",
    "model.config.n_head=2",
    "model.config.block_size=32",
    "train.batch_size=4",
    "train.progress=false",
    "train.device=cpu",
    "launcher.threads_per_rank=1",
    "launcher.collective_timeout_s=60",
    "launcher.rdzv_timeout_s=60",
]
JOB_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1, but a Slurm cluster cannot run here: {reason}")
        pytest.skip(f"no real Slurm here: {reason}")
    slurm = SlurmCluster()
    with slurm:
        yield slurm
    assert slurm.left_behind() == []


@pytest.fixture
def job_env(tmp_path) -> dict[str, str]:
    """What the jobs inherit from sbatch: this venv's ``overlapkit-train``, a private TMPDIR."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    return {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "TMPDIR": str(scratch)}


def _run_job(
    cluster: SlurmCluster, args: list[str], cwd: Path, env: dict[str, str]
) -> tuple[int, str]:
    """Submit from ``cwd`` and wait; returns the job id and its final state."""
    job = cluster.sbatch(args, cwd=cwd, env=env)
    state = cluster.wait(job, timeout_s=JOB_TIMEOUT_S)
    return job, state


def _output(cwd: Path, job: int) -> str:
    return (cwd / f"slurm-{job}.out").read_text()


@pytest.mark.slow  # not the test itself: starting and stopping the cluster takes ~7 s
def test_expand_hostlist_agrees_with_scontrol_show_hostnames(cluster):
    rng = random.Random(0)
    names = []
    for _ in range(200):
        parts = []
        for _ in range(rng.randint(1, 2)):
            width = rng.randint(1, 3)
            low = [rng.randint(0, 40) for _ in range(rng.randint(1, 3))]
            items = [
                f"{lo:0{width}d}-{lo + rng.randint(1, 12):0{width}d}"
                if rng.random() < 0.6
                else f"{lo:0{width}d}"
                for lo in low
            ]
            parts.append(f"{rng.choice(['n', 'gpu', 'r-', 'a.b'])}[{','.join(items)}]")
        # Slurm 22.05 refuses text after the last bracket (a-[1-2]b); the parser accepts it.
        names.append("".join(parts))
    names += ["login", "node[01-04,07]", "n[8-10]", "x[001-003,10]", "n[01-2]", "[1-2]"]
    hostlist = ",".join(names)
    slurm = cluster.run(["scontrol", "show", "hostnames", hostlist]).stdout.split()
    assert expand_hostlist(hostlist) == slurm
    assert len(slurm) > 1000


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_two_node_job_rendezvous_across_the_nodes(cluster, tmp_path, job_env):
    # One task per node: on each, torch elastic starts launcher.nproc_per_node workers. The job
    # name holds what Hydra's override grammar reads (=, parentheses, a comma: a sweep) and a
    # path separator, and the rendezvous is given by address (launcher.host), as where node
    # names do not resolve.
    name = "team/two=(a,b)"
    args = ["--nodes=2", "--ntasks-per-node=1", f"--job-name={name}", *NO_GPUS, str(RECIPE)]
    overrides = [*SMALL, "train.steps=3", "train.checkpoint_every=3", "launcher.nproc_per_node=1"]
    overrides.append(f"launcher.host={cluster.addresses[0]}")
    job, state = _run_job(cluster, [*args, *overrides], tmp_path, job_env)
    output = _output(tmp_path, job)  # before: the job FAILED, Slurm could not open team/...out
    assert state == "COMPLETED", f"{output[-5000:]}\n{cluster.logs()}"
    assert f"job {job} ({name}) on n[1-2], restart 0" in output
    assert f"(static rendezvous at {cluster.addresses[0]}:" in output
    # One directory, the job's name with its / percent-encoded; before: runs/team/two=(a,b).
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["team%2Ftwo=(a,b)"]
    run_dir = tmp_path / "runs" / "team%2Ftwo=(a,b)"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["nodes"], summary["final_step"]) == (2, 2, 3)
    assert summary["name"] == name
    topology = json.loads((run_dir / "topology.json").read_text())
    assert topology["nodes"] == [{"node": 0, "ranks": [0]}, {"node": 1, "ranks": [1]}]
    shards = sorted(p.name for p in (run_dir / "checkpoints" / "step_00000003").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # The second node ran Hydra in a scratch directory and removed it; only n1 kept outputs.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", f"slurm-{job}.out", "tmp"]
    assert list(Path(job_env["TMPDIR"]).glob("overlapkit-node*")) == []
    assert "Failed to recv" not in output


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
def test_failed_job_requeued_resumes_from_its_newest_checkpoint(cluster, tmp_path, job_env):
    # Two tasks on one node, each one rank. Rank 1 dies in step 5 (SIGKILL, like a lost host),
    # after the step-3 checkpoint; srun ends the step, the job fails. Requeued, it runs again
    # in the same run directory (runs/<job name>) and the killer, counting steps in its own
    # process, does not strike again.
    args = ["--nodes=1", "--ntasks-per-node=2", "--job-name=requeue", *NO_GPUS, str(RECIPE)]
    overrides = [*SMALL, "train.steps=6", "train.checkpoint_every=3"]
    overrides.append(f"launcher.worker_init=[{WORKER_INIT}]")
    env = {**job_env, KILL_ENV: "1:5", "PYTHONPATH": str(REPO)}
    job, state = _run_job(cluster, [*args, *overrides], tmp_path, env)
    output = _output(tmp_path, job)
    assert state == "FAILED", f"{output[-5000:]}\n{cluster.logs()}"
    run_dir = tmp_path / "runs" / "requeue"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000003"]
    assert not (run_dir / "summary.json").exists()

    cluster.run(["scontrol", "requeue", str(job)])
    # The job can show its old state for a moment; then it is pending again.
    cluster.wait(job, timeout_s=60, states={"PENDING", "RUNNING", "COMPLETED"})
    assert cluster.job(job)["Restarts"] == "1"
    # Slurm holds it back for the credential lifetime (cred_expire, 5 s here), until the node
    # forgets the revoked credential of the last run; starting earlier, the launch fails.
    state = cluster.wait(job, timeout_s=JOB_TIMEOUT_S)
    output = _output(tmp_path, job)  # --open-mode=append: both runs
    assert state == "COMPLETED", f"{output[-5000:]}\n{cluster.logs()}"
    assert f"job {job} (requeue) on n1, restart 1" in output
    assert "resumed from step 3" in output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["start_step"], summary["steps_run"], summary["final_step"]) == (3, 3, 6)
    assert (summary["world_size"], summary["nodes"]) == (2, 1)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_00000003", "step_00000006"]
    shards = sorted(p.name for p in (run_dir / "checkpoints" / "step_00000006").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # Task 1 ran Hydra in a scratch directory (under TMPDIR; the killed run's stays there).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", f"slurm-{job}.out", "tmp"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_uneven_tasks_per_node_fail_before_any_worker_starts(cluster, tmp_path, job_env):
    # --ntasks=3 on two nodes: 2 tasks on one, 1 on the other.
    result = cluster.run(
        ["srun", "--nodes=2", "--ntasks=3", "--kill-on-bad-exit=1", "overlapkit-train",
         "launcher=slurm", "name=uneven", *SMALL],
        check=False, cwd=tmp_path, env=job_env, timeout_s=100,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "SLURM_STEP_TASKS_PER_NODE='2,1': the nodes run different numbers of tasks" in output
    assert "worker" not in output and "launching" not in output
    assert not (tmp_path / "runs" / "uneven" / "checkpoints").exists()


# -- the sweep of namespaces a killed run left (root and iproute2 only, no Slurm) -------------
def _exited_pid() -> int:
    """The id of a process that has exited, as a SIGKILLed test run's id is."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _namespace_pair(first: str, second: str, link: str) -> subprocess.Popen:
    """Two namespaces joined by a veth pair, as a cluster or ``TwoNodes`` makes them, and a
    process inside the first (a daemon that outlived its run); returns that process."""
    for namespace in (first, second):
        subprocess.run(["ip", "netns", "add", namespace], check=True)
    subprocess.run(
        ["ip", "link", "add", f"{link}a", "type", "veth", "peer", "name", f"{link}b"], check=True
    )
    for namespace, end in ((first, f"{link}a"), (second, f"{link}b")):
        subprocess.run(["ip", "link", "set", end, "netns", namespace], check=True)
    return subprocess.Popen(["ip", "netns", "exec", first, "sleep", "600"])


class _StopAfterTheSweep(Exception):
    pass


def _stop_after_the_sweep(cluster: SlurmCluster) -> None:
    raise _StopAfterTheSweep


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (ip netns)"
)
def test_a_new_cluster_removes_what_a_killed_one_left_and_only_that(monkeypatch):
    dead, alive = _exited_pid(), subprocess.Popen(["sleep", "600"])
    tag = f"{os.getpid() % 10000}"  # veth names hold at most 15 characters
    stale = [f"ovkslurm{dead}n1", f"ovkslurm{dead}n2"]
    live = [f"ovkslurm{alive.pid}n1", f"ovkslurm{alive.pid}n2"]
    benchmark = [f"ovk{dead}a", f"ovk{dead}b"]  # TwoNodes' names: the cluster leaves them be
    made = [*stale, *live, *benchmark]
    inside = []
    try:
        for pair, link in ((stale, f"ovks{tag}"), (live, f"ovkl{tag}"), (benchmark, f"ovkb{tag}")):
            inside.append(_namespace_pair(*pair, link))
        # The sweep is the first thing a cluster does; stop it there, before any daemon starts.
        monkeypatch.setattr(SlurmCluster, "_start", _stop_after_the_sweep)
        with pytest.raises(_StopAfterTheSweep):
            SlurmCluster().__enter__()
        listed = netns.namespaces()
        assert not set(stale) & set(listed), listed  # before: both still listed
        assert set(live) | set(benchmark) <= set(listed), listed
        assert inside[0].wait(timeout=10) == -9  # the leftover process inside was SIGKILLed
        assert inside[1].poll() is None and inside[2].poll() is None
        # The benchmarks sweep their own names with the same helper.
        assert sorted(two_nodes.remove_stale_namespaces()) == benchmark
        assert inside[2].wait(timeout=10) == -9
        assert set(live) <= set(netns.namespaces())
    finally:
        for proc in (alive, *inside):
            proc.kill()
            proc.wait()
        for namespace in made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
    assert not set(made) & set(netns.namespaces())
