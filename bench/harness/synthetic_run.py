"""A whole synthetic multi-rank run: every rank's trace, with stragglers whose cost is known.

``simulate(spec)`` plays an SPMD training loop on ``spec.ranks`` ranks, step by step: each
step runs ``collectives_per_step`` segments of compute ops, each ended by a collective over all
ranks; a collective starts on a rank once the rank enqueued it and its previous collective
ended (its comm lane is a queue), and ends on every rank a transfer time after the last rank
started it. With ``blocking`` the compute waits for each collective right away (as FSDP's
all-gathers, or a loop calling ``all_reduce``); without, only at the end of the step (as DDP's
bucket all-reduces). Op durations and transfers vary by ``jitter`` (relative), every rank's
clock is off by up to ``clock_offset_s``, and ``injections`` make one rank slower in one place:

- ``compute``: one op of a segment runs ``delay_ms`` longer (the op named ``op`` or the first);
- ``host_gap``: the rank idles ``delay_ms`` before the segment's ops;
- ``data_loading``: the same idle time, inside a ``enumerate(DataLoader)#...`` range;
- ``comm``: the rank's transfer in the segment's collective takes ``delay_ms`` longer (a slow
  link: the rank leaves that collective late and the others wait for it at its next one).

``write_run(spec, directory)`` writes one trace per rank in the shape torch's profiler gives:
NCCL GPU traces (kernels on a compute and a comm stream, their launches, ``record_param_comms``
with ``Process Group Name`` and ``Seq``) or gloo CPU traces (main-thread ``cpu_op``s,
``c10d::allreduce_`` enqueues, ``gloo:all_reduce`` ranges on a gloo thread, ``pg_config``). It
returns the ``Truth``: the run's time and, per injection, its cost: the run's time with every
injection less the run's time with all but that one (the random draws are the same in both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.harness.synthetic_traces import GLOO_TID, TraceBuilder

CAUSES = ("compute", "host_gap", "data_loading", "comm")
OP_NAMES = ("aten::mm", "aten::add_", "aten::gelu", "aten::softmax", "aten::layer_norm")
_GAP_US = 5.0  # between consecutive ops on the compute lane
_LATENCY_US = 10.0  # from a collective's turn on the comm lane to its start
_RESUME_US = 4.0  # from a collective's end to the compute lane resuming after a wait
_ENQUEUE_US = 20.0  # the c10d op's own time on the main thread (gloo)
_STEP_GAP_US = 30.0  # between one step's end and the next one's start
_LOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
_NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"


@dataclass(frozen=True, slots=True)
class Injection:
    """One slower place on one rank (see the module docstring)."""

    rank: int
    step: int
    """The step number (``first_step`` is the first)."""
    position: int
    """The collective of the step whose segment (or transfer, for ``comm``) is slower."""
    cause: str
    delay_ms: float
    op: int = 0
    """Which op of the segment ``compute`` slows (its index)."""


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What ``simulate`` plays (see the module docstring); times in ms."""

    ranks: int = 8
    steps: int = 10
    first_step: int = 1
    backend: str = "nccl"
    """``nccl`` (GPU-shaped traces) or ``gloo`` (CPU-shaped)."""
    collectives_per_step: int = 3
    ops_per_segment: int = 2
    blocking: bool = True
    op_ms: float = 2.0
    transfer_ms: float = 1.0
    jitter: float = 0.002
    clock_offset_s: float = 0.0
    nelems: int = 1 << 20
    ranks_per_host: int = 1
    """Ranks sharing a host, and so a clock (its ``host_name`` and offset)."""
    lean: bool = False
    """Write only what the analysis reads (no flow arrows, no GPU mirrors of CPU ranges, no
    ``Process Group Ranks`` on every collective: ``pg_config`` has them): for thousands of
    ranks."""
    seed: int = 0
    injections: tuple[Injection, ...] = ()

    def __post_init__(self) -> None:
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {self.backend!r}")
        for inj in self.injections:
            if inj.cause not in CAUSES:
                raise ValueError(f"injection cause must be one of {CAUSES}, got {inj.cause!r}")
            if not (0 <= inj.rank < self.ranks and 0 <= inj.position < self.collectives_per_step):
                raise ValueError(f"injection {inj} is outside the run's ranks or collectives")
            if not self.first_step <= inj.step < self.first_step + self.steps:
                raise ValueError(f"injection {inj} is outside steps {self.first_step}..")


@dataclass(slots=True)
class Timeline:
    """Every rank's intervals in true time (µs), as ``simulate`` played them."""

    steps: np.ndarray  # (steps, ranks, 2): start, end
    ops: np.ndarray  # (steps, positions, ops, ranks, 2)
    gaps: np.ndarray  # (steps, positions, ranks, 2): injected idle time, or (t, t)
    loader: np.ndarray  # (steps, positions, ranks) bool: the gap is inside a DataLoader range
    arrival: np.ndarray  # (steps, positions, ranks)
    start: np.ndarray
    end: np.ndarray
    optimizer: np.ndarray  # (steps, ranks, 2)
    total_us: float


@dataclass(slots=True)
class Truth:
    """What the run was: its time and each injection's cost (ms)."""

    total_ms: float
    costs_ms: list[float] = field(default_factory=list)
    """Per injection of the spec, in order: the run's time less the run's time without it."""
    offsets_us: list[float] = field(default_factory=list)
    """Each rank's clock offset as written in its trace."""


def simulate(spec: RunSpec, injections: tuple[Injection, ...] | None = None) -> Timeline:
    """Play the run (with ``injections``, default the spec's) and return every interval."""
    injections = spec.injections if injections is None else injections
    rng = np.random.default_rng(spec.seed)
    n, steps, positions, ops = (
        spec.ranks,
        spec.steps,
        spec.collectives_per_step,
        spec.ops_per_segment,
    )
    base = rng.uniform(0.5, 1.5, (positions, ops)) * spec.op_ms * 1e3
    noise = 1 + spec.jitter * rng.standard_normal((steps, positions, ops, n))
    op_us = base[None, :, :, None] * noise
    transfer = (
        spec.transfer_ms * 1e3 * (1 + spec.jitter * rng.standard_normal((steps, positions, n)))
    )
    optimizer_us = 0.3 * spec.op_ms * 1e3 * (1 + spec.jitter * rng.standard_normal((steps, n)))
    gap_us = np.zeros((steps, positions, n))
    loader = np.zeros((steps, positions, n), bool)
    for inj in injections:
        k = inj.step - spec.first_step
        if inj.cause == "compute":
            op_us[k, inj.position, inj.op % ops, inj.rank] += inj.delay_ms * 1e3
        elif inj.cause == "comm":
            transfer[k, inj.position, inj.rank] += inj.delay_ms * 1e3
        else:
            gap_us[k, inj.position, inj.rank] += inj.delay_ms * 1e3
            loader[k, inj.position, inj.rank] |= inj.cause == "data_loading"
    enqueue = _ENQUEUE_US if spec.backend == "gloo" else 0.0
    out = Timeline(
        steps=np.zeros((steps, n, 2)),
        ops=np.zeros((steps, positions, ops, n, 2)),
        gaps=np.zeros((steps, positions, n, 2)),
        loader=loader,
        arrival=np.zeros((steps, positions, n)),
        start=np.zeros((steps, positions, n)),
        end=np.zeros((steps, positions, n)),
        optimizer=np.zeros((steps, n, 2)),
        total_us=0.0,
    )
    lane = np.zeros(n)  # the compute lane's time on each rank
    comm = np.zeros(n)  # when each rank's comm lane is free
    for k in range(steps):
        out.steps[k, :, 0] = lane
        for p in range(positions):
            out.gaps[k, p, :, 0] = lane
            lane = lane + gap_us[k, p]
            out.gaps[k, p, :, 1] = lane
            for j in range(ops):
                out.ops[k, p, j, :, 0] = lane
                lane = lane + op_us[k, p, j]
                out.ops[k, p, j, :, 1] = lane
                lane = lane + _GAP_US
            arrival = lane.copy()
            start = np.maximum(arrival, comm) + _LATENCY_US
            end = start.max() + transfer[k, p]
            out.arrival[k, p], out.start[k, p], out.end[k, p] = arrival, start, end
            comm = end
            lane = lane + enqueue
            if spec.blocking:
                lane = np.maximum(lane, end + _RESUME_US)
        if not spec.blocking:
            lane = np.maximum(lane, comm + _RESUME_US)
        out.optimizer[k, :, 0] = lane
        lane = lane + optimizer_us[k]
        out.optimizer[k, :, 1] = lane
        out.steps[k, :, 1] = lane
        lane = lane + _STEP_GAP_US
    out.total_us = float(out.steps[-1, :, 1].max() - out.steps[0, :, 0].min())
    return out


def truth(spec: RunSpec) -> Truth:
    """The run's time and each injection's cost (see the module docstring)."""
    total = simulate(spec).total_us
    costs = []
    for i in range(len(spec.injections)):
        others = spec.injections[:i] + spec.injections[i + 1 :]
        costs.append((total - simulate(spec, others).total_us) / 1e3)
    return Truth(total_ms=total / 1e3, costs_ms=costs, offsets_us=_offsets(spec).tolist())


def _offsets(spec: RunSpec) -> np.ndarray:
    """Each rank's clock: one offset per host, µs since the epoch as Kineto's clock."""
    rng = np.random.default_rng(spec.seed + 7919)
    hosts = -(-spec.ranks // spec.ranks_per_host)
    offsets = rng.uniform(-1, 1, hosts) * spec.clock_offset_s * 1e6
    return 1.7e12 + np.repeat(offsets, spec.ranks_per_host)[: spec.ranks]


def _rank_trace(spec: RunSpec, t: Timeline, rank: int, origin: float) -> TraceBuilder:
    groups = [{"pg_name": "0", "ranks": list(range(spec.ranks))}]
    builder = TraceBuilder(
        rank=rank,
        world_size=spec.ranks,
        backend=spec.backend,
        groups=groups,
        pid=1000 + rank,
        main_tid=1000 + rank,
        host=f"node{rank // spec.ranks_per_host}",
    )
    gpu = spec.backend == "nccl"
    seq = 0
    for k in range(spec.steps):
        number = spec.first_step + k
        builder.step(number, origin + t.steps[k, rank, 0], origin + t.steps[k, rank, 1])
        for p in range(spec.collectives_per_step):
            g0, g1 = t.gaps[k, p, rank]
            if t.loader[k, p, rank] and g1 > g0:
                builder.user_annotation(_LOADER, origin + g0, origin + g1)
            for j in range(spec.ops_per_segment):
                s, e = origin + t.ops[k, p, j, rank]
                name = OP_NAMES[(p * spec.ops_per_segment + j) % len(OP_NAMES)]
                if gpu:
                    builder.kernel(
                        f"void {name.split('::')[1]}_kernel<float>(float*)",
                        s,
                        e,
                        launch_at=s - 4.0,
                        flows=not spec.lean,
                    )
                else:
                    builder.cpu_op(name, s, e)
            a = origin + t.arrival[k, p, rank]
            s, e = origin + t.start[k, p, rank], origin + t.end[k, p, rank]
            if gpu:
                builder.kernel(
                    _NCCL,
                    s,
                    e,
                    launch_at=a - 4.5,
                    stream=20,
                    collective="allreduce",
                    nelems=spec.nelems,
                    seq=seq,
                    flows=not spec.lean,
                    mirror=not spec.lean,
                    ranks_in_metadata=not spec.lean,
                )
            else:
                dims = [[[spec.nelems]], [], [], [], [], []]
                builder.cpu_op(
                    "c10d::allreduce_",
                    a,
                    a + _ENQUEUE_US,
                    args={
                        "Input Dims": dims,
                        "Input type": ["TensorList", "", "", "", "Scalar", "Scalar"],
                    },
                )
                builder.gloo("all_reduce", s, e, nelems=spec.nelems, tid=GLOO_TID)
            seq += 1
        s, e = origin + t.optimizer[k, rank]
        if gpu:
            builder.kernel(
                "void multi_tensor_apply_kernel<adam>(float*)",
                s,
                e,
                launch_at=s - 4.0,
                flows=not spec.lean,
            )
        else:
            builder.cpu_op("aten::_fused_adamw_", s, e)
    return builder


def write_run(spec: RunSpec, directory: str | Path, *, ranks: range | None = None) -> Truth:
    """Write the run's traces to ``directory`` (``rank{R}.1.pt.trace.json``) and return its
    ``Truth``; ``ranks`` writes only those ranks' files (for writing in parallel)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    timeline = simulate(spec)
    offsets = _offsets(spec)
    for rank in ranks if ranks is not None else range(spec.ranks):
        _rank_trace(spec, timeline, rank, offsets[rank]).write(
            directory / f"rank{rank}.1.pt.trace.json"
        )
    return truth(spec)
