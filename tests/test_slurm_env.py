"""``launcher=slurm`` without a cluster: host lists, task counts, and the SLURM_* checks.

The environments below are what ``srun`` set in the tests' real Slurm 22.05 (copied from
``env`` inside a task); ``tests/test_slurm_cluster.py`` runs the same code under Slurm itself.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from overlapkit.train.launch.cli import process_index
from overlapkit.train.launch.elastic import LauncherConfig
from overlapkit.train.launch.slurm import (
    SlurmStep,
    expand_hostlist,
    expand_tasks_per_node,
    rendezvous_port,
    slurm_launcher,
    task_index,
)

# `sbatch -N1 --ntasks-per-node=2`, then `srun`: task 1 of the step.
ONE_NODE_TWO_TASKS = {
    "SLURM_JOB_ID": "17",
    "SLURM_JOB_NODELIST": "n1",
    "SLURM_NNODES": "1",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "n1",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
}
# `sbatch -N2 --ntasks-per-node=1 --gpus-per-node=4`, then `srun`: the task on the second node.
TWO_NODES_ONE_TASK_EACH = {
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_GPUS_ON_NODE": "4",
}


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("n1", ["n1"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a-[1-2]b", ["a-1b", "a-2b"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("x[001-003,10]", ["x001", "x002", "x003", "x10"]),  # each range keeps its own width
        ("n[01-2]", ["n01", "n02"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),  # the first bracket varies slowest
        ("n[1-3]-[5-6]", ["n1-5", "n1-6", "n2-5", "n2-6", "n3-5", "n3-6"]),
        ("login,gpu[1,3],cpu[2-3]", ["login", "gpu1", "gpu3", "cpu2", "cpu3"]),
        ("[1-2]", ["1", "2"]),
    ],
)
def test_hostlist_expands_as_slurm_does(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "message"),
    [
        ("", r"empty host name"),
        ("a,,b", r"empty host name"),
        ("n[1-2", r"'\[' is never closed"),
        ("n1-2]", r"'\]' without '\['"),
        ("n[1-[2]]", r"nested '\['"),
        ("n[3-1]", r"range '3-1' ends below its start"),
        ("n[a-b]", r"holds 'a-b', which is not N or N-M"),
        ("n[]", r"holds '', which is not N or N-M"),
        ("n[1-2000000]", r"expands to over 1000000 hosts"),
        ("n[1-1000]m[1-1001]", r"expands to over 1000000 hosts"),
        ("a b", r"whitespace in host name"),
    ],
)
def test_malformed_hostlist_is_refused_naming_the_variable(hostlist, message):
    with pytest.raises(ValueError, match=r"SLURM_STEP_NODELIST=.*" + message):
        expand_hostlist(hostlist, variable="SLURM_STEP_NODELIST")


_prefix = st.text(alphabet="abcxyz-_.", min_size=1, max_size=4)
_numbers = st.lists(st.integers(0, 120), min_size=1, max_size=6, unique=True)


@given(st.lists(st.tuples(_prefix, _numbers, st.integers(1, 4)), min_size=1, max_size=4))
@example([("node", [1, 2, 3, 4, 7], 2)])
def test_compressed_hostlist_expands_to_the_hosts_it_was_made_from(groups):
    # Compress each group the way Slurm prints lists: runs of consecutive numbers as ranges.
    names, expected = [], []
    for prefix, numbers, width in groups:
        runs: list[list[int]] = []
        for n in sorted(numbers):
            if runs and runs[-1][1] == n - 1:
                runs[-1][1] = n
            else:
                runs.append([n, n])
        ranges = ",".join(
            f"{lo:0{width}d}" if lo == hi else f"{lo:0{width}d}-{hi:0{width}d}" for lo, hi in runs
        )
        names.append(f"{prefix}[{ranges}]")
        expected += [f"{prefix}{n:0{width}d}" for n in sorted(numbers)]
    assert expand_hostlist(",".join(names)) == expected


@pytest.mark.parametrize(
    ("text", "counts"),
    [("2", [2]), ("1(x2)", [1, 1]), ("2(x3),1", [2, 2, 2, 1]), ("4,8(x2)", [4, 8, 8])],
)
def test_tasks_per_node_expand(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "0", "2(x0)", "2(3)", "x", "2,,1", "-1"])
def test_malformed_tasks_per_node_is_refused(text):
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE=.* is not a task count"):
        expand_tasks_per_node(text)


def test_one_task_per_rank_makes_this_process_the_worker():
    launcher = slurm_launcher(env=ONE_NODE_TWO_TASKS, threads_per_rank=1)
    assert isinstance(launcher, LauncherConfig)
    assert (launcher.nnodes, launcher.nproc_per_node, launcher.node_rank) == (1, 2, 0)
    assert launcher.local_rank == 1  # SLURM_LOCALID: torch elastic is not used
    assert launcher.rdzv_endpoint == f"n1:{rendezvous_port(17)}"
    assert launcher.rdzv_id == "slurm-17"
    assert launcher.threads_per_rank == 1


def test_one_task_per_node_lets_torch_elastic_start_a_worker_per_gpu():
    launcher = slurm_launcher(env=TWO_NODES_ONE_TASK_EACH)
    assert (launcher.nnodes, launcher.nproc_per_node, launcher.node_rank) == (2, 4, 1)
    assert launcher.local_rank is None
    assert launcher.rdzv_endpoint == "gpu07:23456"  # 20000 + 123456 % 12000
    assert not launcher.standalone  # the static rendezvous: rank 0 on the first node
    # launcher.nproc_per_node wins over the GPU count; without GPUs one worker per task.
    assert slurm_launcher(env=TWO_NODES_ONE_TASK_EACH, nproc_per_node=2).nproc_per_node == 2
    no_gpus = {k: v for k, v in TWO_NODES_ONE_TASK_EACH.items() if k != "SLURM_GPUS_ON_NODE"}
    assert slurm_launcher(env=no_gpus).nproc_per_node == 1
    assert slurm_launcher(env=no_gpus, port=29500).rdzv_endpoint == "gpu07:29500"


def test_launcher_host_replaces_the_first_nodes_name_in_the_rendezvous():
    env = TWO_NODES_ONE_TASK_EACH
    assert slurm_launcher(env=env, host="10.0.0.7").rdzv_endpoint == "10.0.0.7:23456"
    assert slurm_launcher(env=env, host="{node}-ib0").rdzv_endpoint == "gpu07-ib0:23456"
    assert slurm_launcher(env=ONE_NODE_TWO_TASKS, host="{node}.cluster").rdzv_endpoint == (
        f"n1.cluster:{rendezvous_port(17)}"
    )


@pytest.mark.parametrize(
    ("host", "message"),
    [
        ("", r"launcher.host='' gives '': expected an address or a host name"),
        ("head:29500", r"gives 'head:29500': .* \(set the port with launcher.port\)"),
        ("{host}-ib0", r"launcher.host='{host}-ib0': only {node} \(the first node's Slurm name, "),
        ("{node", r"launcher.host='{node': only {node}"),
        ("my node", r"gives 'my node': expected an address"),
    ],
)
def test_bad_launcher_host_is_refused_naming_it(host, message):
    with pytest.raises(ValueError, match=message):
        slurm_launcher(env=TWO_NODES_ONE_TASK_EACH, host=host)


def test_rendezvous_port_stays_below_the_ephemeral_range():
    ports = {rendezvous_port(job) for job in range(0, 50_000, 7)}
    assert min(ports) >= 20000 and max(ports) < 32768
    assert rendezvous_port(1) != rendezvous_port(2)


def _without(env: dict[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in names}


STEP_VARIABLES = [k for k in ONE_NODE_TWO_TASKS if k.startswith("SLURM_STEP_")]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, r"SLURM_JOB_ID is unset: this is not a Slurm job"),
        (_without(ONE_NODE_TWO_TASKS, "SLURM_STEP_ID"), r"SLURM_STEP_ID is unset: .* srun"),
        (
            ONE_NODE_TWO_TASKS | {"SLURM_STEP_NODELIST": "n[1-2"},
            r"SLURM_STEP_NODELIST='n\[1-2': '\[' is never closed",
        ),
        (
            ONE_NODE_TWO_TASKS | {"SLURM_STEP_NODELIST": "n[1-2]"},
            r"SLURM_STEP_NODELIST='n\[1-2\]' names 2 node\(s\), but SLURM_STEP_NUM_NODES=1",
        ),
        (
            # --ntasks=3 on two nodes, without a per-node count
            _without(ONE_NODE_TWO_TASKS, *STEP_VARIABLES, "SLURM_NTASKS_PER_NODE")
            | {"SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2"}
            | {"SLURM_NTASKS": "3", "SLURM_TASKS_PER_NODE": "2,1"},
            r"SLURM_TASKS_PER_NODE='2,1': the nodes run different numbers of tasks .* "
            r"--ntasks-per-node",
        ),
        (
            ONE_NODE_TWO_TASKS | {"SLURM_STEP_NUM_TASKS": "3"},
            r"SLURM_STEP_NUM_TASKS=3 but SLURM_STEP_TASKS_PER_NODE='2' adds up to 2",
        ),
        (
            ONE_NODE_TWO_TASKS | {"SLURM_NTASKS_PER_NODE": "4"},
            r"SLURM_NTASKS_PER_NODE=4 but SLURM_STEP_TASKS_PER_NODE='2'",
        ),
        (_without(ONE_NODE_TWO_TASKS, "SLURM_PROCID"), r"SLURM_PROCID is unset"),
        (ONE_NODE_TWO_TASKS | {"SLURM_LOCALID": "x"}, r"SLURM_LOCALID='x' must be an integer"),
        (ONE_NODE_TWO_TASKS | {"SLURM_LOCALID": "2"}, r"SLURM_LOCALID=2 must be < the 2 task"),
        (ONE_NODE_TWO_TASKS | {"SLURM_NODEID": "1"}, r"SLURM_NODEID=1 must be < SLURM_STEP_NUM"),
        (
            ONE_NODE_TWO_TASKS | {"SLURM_PROCID": "0"},  # local 1 of node 0 must be rank 1
            r"SLURM_PROCID=0 is not node 0's task 1 in block order .* --distribution=block",
        ),
        (
            TWO_NODES_ONE_TASK_EACH | {"SLURM_STEP_NODELIST": "gpu[07,07]"},
            r"names a node twice",
        ),
        (
            _without(TWO_NODES_ONE_TASK_EACH, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
            r"SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE unset",
        ),
    ],
)
def test_bad_or_partial_slurm_environment_is_refused_naming_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        SlurmStep.from_env(env)


def test_job_variables_are_used_when_the_step_has_none():
    job_only = _without(
        TWO_NODES_ONE_TASK_EACH, *[k for k in STEP_VARIABLES if k != "SLURM_STEP_ID"]
    )
    step = SlurmStep.from_env(job_only)
    assert step.nodes == ("gpu07", "gpu08") and step.tasks_per_node == (1, 1)
    # A step on part of the allocation: its own variables win.
    part = TWO_NODES_ONE_TASK_EACH | {
        "SLURM_STEP_NODELIST": "gpu08",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NUM_TASKS": "1",
        "SLURM_STEP_TASKS_PER_NODE": "1",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
    }
    assert slurm_launcher(env=part).rdzv_endpoint == "gpu08:23456"


def test_nproc_per_node_that_contradicts_the_tasks_per_node_is_refused():
    with pytest.raises(ValueError, match=r"launcher.nproc_per_node=4, but srun started 2 tasks"):
        slurm_launcher(env=ONE_NODE_TWO_TASKS, nproc_per_node=4)
    assert slurm_launcher(env=ONE_NODE_TWO_TASKS, nproc_per_node=2).local_rank == 1


def test_one_task_per_rank_takes_its_threads_from_cpus_per_task():
    with_cpus = ONE_NODE_TWO_TASKS | {"SLURM_CPUS_PER_TASK": "6"}
    assert slurm_launcher(env=with_cpus).threads_per_rank == 6
    assert slurm_launcher(env=with_cpus, threads_per_rank=2).threads_per_rank == 2
    assert slurm_launcher(env=ONE_NODE_TWO_TASKS).threads_per_rank is None


def test_gpus_bound_per_task_are_refused_with_one_task_per_rank():
    with pytest.raises(ValueError, match=r"SLURM_GPUS_PER_TASK=1: .* --gpus-per-node"):
        slurm_launcher(env=ONE_NODE_TWO_TASKS | {"SLURM_GPUS_PER_TASK": "1"})


def test_restarts_need_torch_elastic_so_one_task_per_rank_refuses_them():
    with pytest.raises(ValueError, match=r"launcher.max_restarts=1 needs torch elastic"):
        slurm_launcher(env=ONE_NODE_TWO_TASKS, max_restarts=1)
    assert slurm_launcher(env=TWO_NODES_ONE_TASK_EACH, max_restarts=1).max_restarts == 1


def test_only_the_task_hosting_rank_0_keeps_hydra_outputs(monkeypatch):
    for name, value in ONE_NODE_TWO_TASKS.items():
        monkeypatch.setenv(name, value)
    assert task_index() == 1
    assert process_index(["launcher=slurm", "train.steps=3"]) == 1
    # Without launcher=slurm the node rank on the command line decides, as before.
    assert process_index(["train.steps=3"]) == 0
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert process_index(["launcher=slurm"]) == 0


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"local_rank": 2},
            r"launcher.local_rank \(2\) .* must be < launcher.nproc_per_node \(2\)",
        ),
        ({"rdzv_endpoint": None}, r"launcher.local_rank \(0\) needs launcher.rdzv_endpoint"),
        ({"max_restarts": 1}, r"launcher.max_restarts=1 needs torch elastic"),
    ],
)
def test_a_worker_started_per_rank_is_checked(values, message):
    good = {"nproc_per_node": 2, "local_rank": 0, "rdzv_endpoint": "n1:20017"}
    assert LauncherConfig(**good).local_rank == 0
    with pytest.raises(ValueError, match=message):
        LauncherConfig(**(good | values))
