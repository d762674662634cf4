"""``launcher=slurm``: read the job's shape from the ``SLURM_*`` variables ``srun`` sets.

Inside an allocation, ``srun overlapkit-train launcher=slurm ...`` starts one Hydra process per
Slurm task. Each reads its step's variables and becomes one of two shapes, whichever the
``sbatch``/``srun`` options asked for:

* **one task per node** (``--ntasks-per-node=1``): torch elastic starts
  ``launcher.nproc_per_node`` workers on each node (by default the node's allocated GPUs,
  ``SLURM_GPUS_ON_NODE``, else 1), as ``srun torchrun --nnodes $SLURM_NNODES ...`` does;
* **one task per rank** (several tasks per node): each task is one worker, rank
  ``SLURM_PROCID`` and local rank ``SLURM_LOCALID``, as Lightning runs under Slurm.

Both use the static rendezvous (ranks numbered node by node, ``SLURM_NODEID`` as the node rank)
on the first node of ``SLURM_STEP_NODELIST`` (``SLURM_JOB_NODELIST`` outside a step), at a
port derived from ``SLURM_JOB_ID``, so that rank 0, and with it the run's outputs, is always on
the first node (torch's c10d rendezvous numbers nodes by their join order, which would put rank
0 on any node). The variables are checked together before any worker starts; a partial or
inconsistent environment is refused naming the variable.

Node lists are expanded here (``node[01-04,07]``, ``a-[1-2]b``, ``r[1-2]n[1-2]``, comma lists)
rather than by ``scontrol show hostnames``: the launcher then needs no Slurm binaries on the
compute node and gives the same answer everywhere; the real-Slurm tests compare the two.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from overlapkit.train.launch.elastic import LauncherConfig

_MAX_HOSTS = 1_000_000
"""Bigger expansions are refused: no allocation has that many nodes, a typo might."""
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")
PORT_BASE = 20000
PORT_SPAN = 12000
"""Rendezvous ports are ``PORT_BASE + job_id % PORT_SPAN``: below Linux's ephemeral range
(32768 and up), so that no outgoing connection on the head node holds it already."""


def expand_hostlist(hostlist: str, *, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expand a Slurm host list, in Slurm's order.

    ``node[01-04,07]`` is node01 .. node04, node07 (a range keeps the width of its lower
    bound); ``a-[1-2]b`` is a-1b, a-2b (text after the last bracket, which Slurm 22.05's
    ``scontrol`` refuses, is kept); several brackets in one name multiply, the first varying
    slowest; top-level commas separate names.

    Args:
        hostlist (str): the compressed list, e.g. ``"gpu[001-003],login1"``.
        variable (str): the name the error messages give the value.

    Returns:
        list[str]: the host names.

    Raises:
        ValueError: an empty list or name, unbalanced or nested brackets, a range that is not
            ``N`` or ``N-M`` with ``N <= M``, or more than a million hosts.

    Example:
        >>> expand_hostlist("node[01-02,07],login")
        ['node01', 'node02', 'node07', 'login']
    """
    hosts: list[str] = []
    for name in _split_top_level(hostlist, variable):
        expanded = [""]
        for literal, ranges in _name_parts(name, hostlist, variable):
            values = [""] if ranges is None else _expand_ranges(ranges, hostlist, variable)
            if len(hosts) + len(expanded) * len(values) > _MAX_HOSTS:
                raise ValueError(f"{variable}={hostlist!r} expands to over {_MAX_HOSTS} hosts")
            expanded = [prefix + literal + value for prefix in expanded for value in values]
        hosts.extend(expanded)
    return hosts


def _split_top_level(hostlist: str, variable: str) -> list[str]:
    names, depth, start = [], 0, 0
    for i, char in enumerate(hostlist):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"{variable}={hostlist!r}: nested '[' at position {i}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{variable}={hostlist!r}: ']' without '[' at position {i}")
        elif char == "," and depth == 0:
            names.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"{variable}={hostlist!r}: '[' is never closed")
    names.append(hostlist[start:])
    if any(not name.strip() for name in names):
        raise ValueError(f"{variable}={hostlist!r}: empty host name (two commas, or none at all)")
    return names


def _name_parts(name: str, hostlist: str, variable: str) -> list[tuple[str, str | None]]:
    """``"a[1-2]b"`` -> ``[("a", "1-2"), ("b", None)]``: literal text, then its bracket."""
    parts = []
    for match in re.finditer(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", name):
        literal, ranges = match.group(1), match.group(2)
        if literal or ranges is not None:
            if any(c.isspace() for c in literal):
                raise ValueError(f"{variable}={hostlist!r}: whitespace in host name {name!r}")
            parts.append((literal, ranges))
    return parts


def _expand_ranges(ranges: str, hostlist: str, variable: str) -> list[str]:
    values = []
    for item in ranges.split(","):
        match = _RANGE.fullmatch(item.strip())
        if match is None:
            raise ValueError(
                f"{variable}={hostlist!r}: [{ranges}] holds {item!r}, which is not N or N-M"
            )
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"{variable}={hostlist!r}: range {item!r} ends below its start")
        if int(high) - int(low) >= _MAX_HOSTS:
            raise ValueError(f"{variable}={hostlist!r} expands to over {_MAX_HOSTS} hosts")
        width = len(low)
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def expand_tasks_per_node(text: str, *, variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand Slurm's per-node task counts: ``"2(x3),1"`` is ``[2, 2, 2, 1]``.

    Raises:
        ValueError: an item that is not ``N`` or ``N(xK)`` with ``N >= 1``, ``K >= 1``.
    """
    counts = []
    for item in text.split(","):
        match = _TASKS.fullmatch(item.strip())
        if match is None or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
            raise ValueError(
                f"{variable}={text!r}: {item!r} is not a task count N or N(xK) (N, K >= 1)"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def ranks_are_tasks(ntasks: int, nnodes: int) -> bool:
    """Whether each task of a step of ``ntasks`` tasks on ``nnodes`` nodes is one rank (several
    tasks per node: each joins the group itself); else one task per node starts its node's
    ranks through torch elastic."""
    return ntasks > nnodes


def rendezvous_port(job_id: int) -> int:
    """The TCP port the job's rendezvous store listens on, from its job id."""
    return PORT_BASE + job_id % PORT_SPAN


@dataclass(frozen=True, slots=True)
class SlurmStep:
    """What one ``srun`` task knows about its step, checked for consistency."""

    job_id: int
    nodes: tuple[str, ...]
    """The step's hosts in node-id order; ``nodes[0]`` hosts the rendezvous and rank 0."""
    tasks_per_node: tuple[int, ...]
    node_id: int
    """This task's node, ``SLURM_NODEID``."""
    proc_id: int
    """This task's index in the step, ``SLURM_PROCID``."""
    local_id: int
    """This task's index on its node, ``SLURM_LOCALID``."""
    gpus_on_node: int | None

    @property
    def ntasks(self) -> int:
        return sum(self.tasks_per_node)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SlurmStep:
        """Read and cross-check the step's variables.

        Raises:
            ValueError: naming the variable that is missing, malformed or inconsistent.
        """
        _check_in_step(env)
        job_id = _int(env, "SLURM_JOB_ID", 0)
        nodes, nnodes = _step_nodes(env)
        tasks = _step_tasks(env, nnodes)
        node_id, proc_id, local_id = _task_position(env, nnodes, tasks)
        gpus = env.get("SLURM_GPUS_ON_NODE")
        return cls(
            job_id=job_id,
            nodes=nodes,
            tasks_per_node=tasks,
            node_id=node_id,
            proc_id=proc_id,
            local_id=local_id,
            gpus_on_node=_int(env, "SLURM_GPUS_ON_NODE", 0) if gpus is not None else None,
        )


def _check_in_step(env: Mapping[str, str]) -> None:
    """Refuse to run outside a task of a Slurm job step (outside a job, or in its batch script)."""
    if "SLURM_JOB_ID" not in env:
        raise ValueError(
            "launcher=slurm, but SLURM_JOB_ID is unset: this is not a Slurm job; run it "
            "inside an allocation as `srun overlapkit-train launcher=slurm ...`"
        )
    if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        raise ValueError(
            "launcher=slurm, but SLURM_STEP_ID is unset: this is the batch script itself, "
            "not a task of a job step; start overlapkit-train with srun (one task per node "
            "or one per rank), as recipes/slurm/train.sbatch does"
        )


_NODE_LISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_NODE_COUNTS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
_TASK_COUNTS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
"""Where a step's hosts, their count and their tasks are read, the step's own first: a step may
use part of the allocation, so its variables win over the job's."""


def _step_nodes(env: Mapping[str, str]) -> tuple[tuple[str, ...], int]:
    """The step's hosts in node-id order and their count, checked against each other."""
    nodes_var = _first_set(env, *_NODE_LISTS)
    nodes = tuple(expand_hostlist(env[nodes_var], variable=nodes_var))
    nnodes_var = _first_set(env, *_NODE_COUNTS)
    nnodes = _int(env, nnodes_var, 1)
    if len(nodes) != nnodes:
        raise ValueError(
            f"{nodes_var}={env[nodes_var]!r} names {len(nodes)} node(s), but {nnodes_var}={nnodes}"
        )
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"{nodes_var}={env[nodes_var]!r} names a node twice")
    return nodes, nnodes


def _step_tasks(env: Mapping[str, str], nnodes: int) -> tuple[int, ...]:
    """Tasks per node, the same on every node of the ``nnodes``, checked against the task count
    and the allocation's per-node count."""
    nnodes_var = _first_set(env, *_NODE_COUNTS)
    tasks_var = _first_set(env, *_TASK_COUNTS)
    tasks = tuple(expand_tasks_per_node(env[tasks_var], variable=tasks_var))
    if len(tasks) != nnodes:
        raise ValueError(
            f"{tasks_var}={env[tasks_var]!r} gives {len(tasks)} node(s), but {nnodes_var}={nnodes}"
        )
    ntasks_var = _first_set(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if _int(env, ntasks_var, 1) != sum(tasks):
        raise ValueError(
            f"{ntasks_var}={env[ntasks_var]} but {tasks_var}={env[tasks_var]!r} adds up to "
            f"{sum(tasks)} tasks"
        )
    if len(set(tasks)) != 1:
        raise ValueError(
            f"{tasks_var}={env[tasks_var]!r}: the nodes run different numbers of tasks "
            "(--ntasks without a per-node count?); overlapkit needs the same number on "
            "every node: use --ntasks-per-node"
        )
    per_node = env.get("SLURM_NTASKS_PER_NODE")
    if per_node is not None and per_node.strip() != str(tasks[0]):
        raise ValueError(
            f"SLURM_NTASKS_PER_NODE={per_node} but {tasks_var}={env[tasks_var]!r}: srun "
            "started another number of tasks per node than the allocation asked for"
        )
    return tasks


def _task_position(
    env: Mapping[str, str], nnodes: int, tasks: tuple[int, ...]
) -> tuple[int, int, int]:
    """This task's (node, index in the step, index on its node), numbered node by node."""
    nnodes_var = _first_set(env, *_NODE_COUNTS)
    tasks_var = _first_set(env, *_TASK_COUNTS)
    node_id = _int(env, "SLURM_NODEID", 0)
    proc_id = _int(env, "SLURM_PROCID", 0)
    local_id = _int(env, "SLURM_LOCALID", 0)
    if node_id >= nnodes:
        raise ValueError(f"SLURM_NODEID={node_id} must be < {nnodes_var}={nnodes}")
    if local_id >= tasks[node_id]:
        raise ValueError(
            f"SLURM_LOCALID={local_id} must be < the {tasks[node_id]} task(s) of node "
            f"{node_id} ({tasks_var}={env[tasks_var]!r})"
        )
    if proc_id != node_id * tasks[0] + local_id:
        raise ValueError(
            f"SLURM_PROCID={proc_id} is not node {node_id}'s task {local_id} in block order "
            f"(expected {node_id * tasks[0] + local_id}): ranks must be numbered node by "
            "node; use srun --distribution=block"
        )
    return node_id, proc_id, local_id


def _first_set(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        if env.get(name, "").strip():
            return name
    raise ValueError(f"launcher=slurm: {' / '.join(names)} unset in this Slurm task")


def _int(env: Mapping[str, str], name: str, minimum: int) -> int:
    value = env.get(name)
    if value is None:
        raise ValueError(f"launcher=slurm: {name} is unset in this Slurm task")
    if not value.strip().isdigit() or int(value) < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return int(value)


def slurm_launcher(
    *,
    nproc_per_node: int | None = None,
    host: str | None = None,
    port: int | None = None,
    rdzv_timeout_s: int = 300,
    max_restarts: int = 0,
    collective_timeout_s: float = 300.0,
    stall_limit_s: float | None = None,
    threads_per_rank: int | None = None,
    worker_init: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> LauncherConfig:
    """The ``LauncherConfig`` of this Slurm task (the ``launcher=slurm`` group's target).

    Args:
        nproc_per_node (int): workers torch elastic starts per task with one task per node.
            Defaults to ``SLURM_GPUS_ON_NODE``, else 1. With several tasks per node each task is
            one rank; a value other than the tasks per node is then refused.
        host (str): the address the other nodes reach the first node at, for clusters whose
            node names do not resolve from the compute nodes: an IP address, or a name in which
            ``{node}`` stands for the first node's Slurm name (``{node}-ib0``,
            ``{node}.cluster.internal``). Defaults to the first node's name.
        port (int): TCP port of the rendezvous on the first node. Defaults to
            ``rendezvous_port(SLURM_JOB_ID)``.
        threads_per_rank (int): torch threads per worker. Defaults, with one task per rank, to
            ``SLURM_CPUS_PER_TASK`` when set; otherwise this node's cores divided among them.
        env (Mapping): the variables to read. Defaults to ``os.environ``.
        Others: as ``LauncherConfig``.

    Raises:
        ValueError: a missing, malformed or inconsistent ``SLURM_*`` variable, or a launcher
            value that contradicts the allocation.
    """
    # Imported here, not above: the console script reads ranks_are_tasks before it starts the
    # workers' fork server (overlapkit.train.launch.entry), and elastic imports torch.
    from overlapkit.train.launch.elastic import LauncherConfig

    env = os.environ if env is None else env
    step = SlurmStep.from_env(env)
    per_node = step.tasks_per_node[0]
    if ranks_are_tasks(step.ntasks, len(step.nodes)):
        if nproc_per_node is not None and nproc_per_node != per_node:
            raise ValueError(
                f"launcher.nproc_per_node={nproc_per_node}, but srun started {per_node} tasks "
                f"per node (SLURM_TASKS_PER_NODE) and each task is one rank; drop "
                "launcher.nproc_per_node, or run one task per node (--ntasks-per-node=1) to "
                "let torch elastic start the workers"
            )
        if env.get("SLURM_GPUS_PER_TASK"):
            # Each rank uses GPU SLURM_LOCALID of its node, which a task bound to its own GPU
            # (CUDA_VISIBLE_DEVICES of one device) does not have.
            raise ValueError(
                f"SLURM_GPUS_PER_TASK={env['SLURM_GPUS_PER_TASK']}: with one task per rank each "
                "task uses GPU SLURM_LOCALID of its node; request --gpus-per-node instead of "
                "--gpus-per-task"
            )
        nproc_per_node, local_rank = per_node, step.local_id
        if threads_per_rank is None and env.get("SLURM_CPUS_PER_TASK", "").isdigit():
            threads_per_rank = int(env["SLURM_CPUS_PER_TASK"])  # this rank's own CPUs
    else:
        nproc_per_node = nproc_per_node if nproc_per_node is not None else step.gpus_on_node or 1
        local_rank = None
    if port is None:
        port = rendezvous_port(step.job_id)
    return LauncherConfig(
        nproc_per_node=nproc_per_node,
        nnodes=len(step.nodes),
        node_rank=step.node_id,
        rdzv_endpoint=f"{rendezvous_host(host, step.nodes[0])}:{port}",
        rdzv_id=f"slurm-{step.job_id}",
        rdzv_timeout_s=rdzv_timeout_s,
        max_restarts=max_restarts,
        collective_timeout_s=collective_timeout_s,
        stall_limit_s=stall_limit_s,
        threads_per_rank=threads_per_rank,
        local_rank=local_rank,
        worker_init=list(worker_init),
    )


def rendezvous_host(host: str | None, first_node: str) -> str:
    """``launcher.host`` with ``{node}`` replaced by ``first_node``; ``first_node`` when None.

    Raises:
        ValueError: an empty value, whitespace, a ``:`` (the port is ``launcher.port``) or a
            ``{...}`` other than ``{node}``.
    """
    if host is None:
        return first_node
    text = str(host)
    try:
        address = text.format(node=first_node)
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(
            f"launcher.host={text!r}: only {{node}} (the first node's Slurm name, "
            f"{first_node!r}) may stand in braces ({err})"
        ) from None
    if not address or any(c.isspace() or c == ":" for c in address):
        raise ValueError(
            f"launcher.host={text!r} gives {address!r}: expected an address or a host name "
            "without spaces or ':' (set the port with launcher.port)"
        )
    return address


def task_index(env: Mapping[str, str] | None = None) -> int:
    """This Slurm task's ``SLURM_PROCID``; task 0 hosts rank 0 and keeps the run's Hydra outputs.

    A missing or malformed value reads as 0 here; ``SlurmStep.from_env`` reports it.
    """
    value = (os.environ if env is None else env).get("SLURM_PROCID", "").strip()
    return int(value) if value.isdigit() else 0
