"""Run the doctor's checks on every rank of a job, or on local ranks it starts itself.

Under torchrun (``RANK`` and ``WORLD_SIZE`` set) every rank calls ``run_doctor``, which joins the
job's process group (NCCL on GPUs, gloo on CPU). Otherwise it starts ``nproc`` local ranks with
``overlapkit.workers.local_ranks.run_on_ranks`` (gloo); on a machine with a GPU per rank, the
checks that communicate use an NCCL group over the same ranks.

Every rank measures; the checks are classified from values all ranks agree on (all-gathered or
reduced), and rank 0's list is broadcast so that every rank returns the same exit code.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import socket
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from overlapkit.cost.calibrate import fit_ring_all_reduce, measure_all_reduce, sizes_between
from overlapkit.cost.estimate import estimate
from overlapkit.ddp.bucket_size import default_bucket_mb
from overlapkit.ddp.wrap import ddp
from overlapkit.doctor import affinity, perf_checks, setup_checks
from overlapkit.doctor.check import CHECK_NAMES, FAIL, Check
from overlapkit.doctor.scaling import rank_counts
from overlapkit.fsdp.wrap import fsdp
from overlapkit.layout import PartialLayout
from overlapkit.profiling import profile
from overlapkit.topology.detect import detect_topology, local_view
from overlapkit.topology.loading import load_topology
from overlapkit.topology.model import Library, Topology
from overlapkit.train.models.workload import DEFAULT_SIZES, Workload, make_workload
from overlapkit.tuning import tuning_report
from overlapkit.validation import check_int, is_finite_number
from overlapkit.workers.local_ranks import run_on_ranks

logger = logging.getLogger(__name__)

ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_")


@dataclass(kw_only=True, slots=True)
class DoctorOptions:
    """What ``overlapkit doctor`` runs; the CLI's options."""

    only: tuple[str, ...] = CHECK_NAMES
    """Checks to run, in checklist order."""
    quick: bool = False
    """Fewer sizes and steps: seconds instead of a minute."""
    topology: str | None = None
    """Expected topology (preset name or YAML file); None: compare with the detected one."""
    sizes: PartialLayout = field(default_factory=PartialLayout)
    """The layout the placement check places (``--tp --ep --cp --pp``; a size not given is 1,
    dp the rest)."""
    bucket_mb: float | None = None
    """The bucket size to judge (MiB); None: overlapkit's default for the model."""
    prefetch: int | None = None
    """The ``ok.fsdp`` prefetch depth to judge (0, 1 or 2); None: its default, 1."""
    model: str = "mlp"
    """``mlp`` or ``gpt_tiny``: the small model the measuring checks train."""
    logdir: str | None = None
    """Keep the profiled run's traces here (``overlapkit report`` reads them); None: discard."""
    scaling_steps: int | None = None
    """Timed steps per rank count (check 8); None: 5 quick, 15 otherwise."""

    def __post_init__(self) -> None:
        if self.model not in ("mlp", "gpt_tiny"):
            raise ValueError(f"--model must be 'mlp' or 'gpt_tiny', got {self.model!r}")
        if self.bucket_mb is not None and not self.bucket_mb > 0:
            raise ValueError(f"--bucket-mb must be > 0 MiB, got {self.bucket_mb!r}")
        if self.bucket_mb is not None and not is_finite_number(self.bucket_mb):
            raise ValueError(f"--bucket-mb must be a finite number of MiB, got {self.bucket_mb!r}")
        if self.prefetch not in (None, 0, 1, 2):
            raise ValueError(f"--prefetch must be 0, 1 or 2, got {self.prefetch!r}")

    @property
    def steps(self) -> int:
        return self.scaling_steps or (5 if self.quick else 15)


QUICK_SIZES = {
    "mlp": {"layers": 4, "width": 512, "batch": 64},
    "gpt_tiny": {"layers": 2, "width": 128, "batch": 2},
}
"""The workload's sizes under ``--quick`` (``DEFAULT_SIZES`` otherwise)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(
    models: Sequence[nn.Module],
    loss: Callable[[nn.Module], torch.Tensor],
    steps: int,
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    warmup: int = 2,
    after_step: Callable[[], None] | None = None,
    barrier: bool = True,
) -> list[float]:
    """Per model, the median step time (ms) of the slowest rank of ``group``.

    A step is forward, backward and an SGD update. The models take turns step by step, so
    that machine noise hits them alike. Each step starts after a barrier unless ``barrier`` is
    False (under the profiler, where a barrier would count as communication).
    """
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    times = torch.zeros(len(models), steps, dtype=torch.float64)
    for i in range(warmup + steps):
        for j, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            if barrier:
                dist.barrier(group=group)
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss(model).backward()
            optimizer.step()
            _sync(device)
            if after_step is not None:
                after_step()
            if i >= warmup:
                times[j, i - warmup] = (time.perf_counter() - start) * 1e3
    slowest = times.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return [statistics.median(row) for row in slowest.cpu().tolist()]


# ------------------------------------------------------------------------------------------
# the per-rank run


@dataclass(slots=True)
class _Context:
    rank: int
    world_size: int
    group: dist.ProcessGroup
    backend: str
    device: torch.device
    topology: Topology
    expected: Topology | None
    env: dict[str, str]
    options: DoctorOptions

    @property
    def reference(self) -> Topology:
        """The topology predictions use: the expected one when it can hold the job."""
        if self.expected is not None and self.expected.world_size >= self.world_size:
            return self.expected
        return self.topology


def _workload(ctx: _Context) -> Workload:
    """The small model the measuring checks train, and this rank's batch."""
    sizes = (QUICK_SIZES if ctx.options.quick else DEFAULT_SIZES)[ctx.options.model]
    return make_workload(ctx.options.model, rank=ctx.rank, device=ctx.device, **sizes)


def _comm_setup(rank: int, world_size: int) -> tuple[dist.ProcessGroup, str, torch.device]:
    """The group the checks communicate over: NCCL when every rank has its own GPU."""
    backend = str(dist.get_backend()).lower()
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return dist.group.WORLD, backend, torch.device("cuda", local)
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        # Local ranks from run_on_ranks share a host: one GPU each, NCCL over the same ranks.
        torch.cuda.set_device(rank)
        return dist.new_group(backend="nccl"), "nccl", torch.device("cuda", rank)
    if torch.cuda.is_available():
        logger.warning(
            "doctor: %d rank(s) but %d GPU(s): NCCL needs one GPU per rank; measuring on gloo/CPU",
            world_size,
            torch.cuda.device_count(),
        )
    return dist.group.WORLD, backend, torch.device("cpu")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}


def _check_topology(ctx: _Context) -> Check:
    envs: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(envs, ctx.env, group=ctx.group)
    check = setup_checks.check_topology(
        ctx.topology,
        backend=ctx.backend,
        env=ctx.env,
        interfaces=[name for _, name in socket.if_nameindex()],
        expected=ctx.expected,
    )
    differing = sorted(
        {k for e in envs for k in set(e) ^ set(envs[0])}
        | {k for e in envs for k in e if k in envs[0] and e[k] != envs[0][k]}
    )
    if differing:
        return Check(
            check.name,
            FAIL,
            check.value,
            f"ranks see different settings of {', '.join(differing)}: the library needs the "
            "same on every rank; " + check.advice,
            check.details,
        )
    return check


def _check_affinity(ctx: _Context) -> Check:
    mine = affinity.affinity_facts(
        local_view(rank=ctx.rank), rail=ctx.topology.devices[ctx.rank].nic
    )
    facts: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(facts, mine, group=ctx.group)
    return affinity.check_nic_affinity(facts, nodes=ctx.topology.num_nodes)


def _check_bandwidth(ctx: _Context) -> Check:
    if ctx.world_size < 2:
        return perf_checks.not_applicable(
            "bandwidth",
            "one rank has no one to talk to",
            "run with --nproc 2 or more (or under torchrun with several ranks)",
        )
    quick = ctx.options.quick
    sizes = sizes_between(256 * 2**10, (8 if quick else 64) * 2**20)
    measured = measure_all_reduce(
        sizes, group=ctx.group, budget_s=0.05 if quick else 0.2, progress=False, min_iterations=3
    )
    try:
        fit = fit_ring_all_reduce(measured)
    except ValueError as err:
        logger.warning("doctor: no bandwidth fit: %s", err)
        fit = None
    reference = ctx.reference
    if ctx.backend != "nccl" and str(reference.library) == "nccl":
        return perf_checks.not_applicable(
            "bandwidth",
            f"measured {measured[-1].busbw_GBps:.3g} GB/s busbw on {ctx.backend}, but the "
            f"catalogue figure of {reference.name!r} is for NCCL",
            "give every rank its own GPU (--nproc <= GPUs) or run under torchrun, so that "
            "NCCL is measured",
        )
    predicted = estimate(
        "all_reduce", nbytes=measured[-1].nbytes, topology=reference, group_size=ctx.world_size
    )
    rows = [{"bytes": m.nbytes, "time_s": m.time_s, "busbw_GBps": m.busbw_GBps} for m in measured]
    return perf_checks.check_bandwidth(
        rows,
        predicted_busbw_GBps=predicted.busbw_GBps,
        reference=reference.name,
        nominal=ctx.expected is None and reference.library is Library.GLOO,
        fit=fit,
    )


def _check_algorithms(ctx: _Context) -> Check:
    return setup_checks.check_algorithms(ctx.reference, backend=ctx.backend, env=ctx.env)


def _ddp(
    ctx: _Context, model: nn.Module, bucket_mb: Any, group: dist.ProcessGroup | None = None
) -> nn.Module:
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return ddp(model, bucket_mb=bucket_mb, process_group=group or ctx.group, device_ids=device_ids)


def _current_bucket_mb(ctx: _Context, model: nn.Module) -> float:
    if ctx.options.bucket_mb is not None:
        return ctx.options.bucket_mb
    return default_bucket_mb([p for p in model.parameters() if p.requires_grad])


def _check_bucket_size(ctx: _Context) -> Check:
    if ctx.world_size < 2:
        return perf_checks.not_applicable(
            "bucket_size", "one rank reduces nothing", "run with --nproc 2 or more"
        )
    workload = _workload(ctx)
    current = _current_bucket_mb(ctx, workload.new_model())
    report, chosen_ms, current_ms = _tuned_against_current(
        ctx, workload, lambda model, bucket_mb: _ddp(ctx, model, bucket_mb), current
    )
    return perf_checks.check_bucket_size(
        current_mb=current,
        current_step_ms=current_ms,
        report=report,
        explicit=ctx.options.bucket_mb is not None,
        chosen_step_ms=chosen_ms,
    )


def _fsdp(ctx: _Context, model: nn.Module, prefetch: int | str) -> nn.Module:
    # ok.fsdp's mesh must span the world: the doctor's group does (gloo world or its NCCL twin).
    mesh = (
        None
        if ctx.group is dist.group.WORLD
        else DeviceMesh.from_group(ctx.group, device_type=ctx.device.type)
    )
    return fsdp(model, prefetch=prefetch, mesh=mesh)


def _check_prefetch(ctx: _Context) -> Check:
    if ctx.world_size < 2:
        return perf_checks.not_applicable(
            "prefetch", "one rank shards nothing", "run with --nproc 2 or more"
        )
    current = 1 if ctx.options.prefetch is None else ctx.options.prefetch
    report, chosen_ms, current_ms = _tuned_against_current(
        ctx, _workload(ctx), lambda model, prefetch: _fsdp(ctx, model, prefetch), current
    )
    return perf_checks.check_prefetch(
        current_depth=current,
        current_step_ms=current_ms,
        report=report,
        explicit=ctx.options.prefetch is not None,
        chosen_step_ms=chosen_ms,
    )


def _tuned_against_current(
    ctx: _Context,
    workload: Workload,
    wrap: Callable[[nn.Module, Any], nn.Module],
    current: Any,
) -> tuple[Any, float | None, float]:
    """Train ``wrap(model, "auto")`` until its tuning settles (or the step budget ends), then
    time it interleaved with ``wrap(model, current)``.

    Returns:
        tuple: the tuning report, the settled model's median step (ms; None if it never settled)
        and the ``current`` setting's median step (ms).
    """
    tuned = wrap(workload.new_model(), "auto")
    optimizer = torch.optim.SGD(tuned.parameters(), lr=1e-3)
    report = tuning_report(tuned)
    for _ in range(40 if ctx.options.quick else 100):
        optimizer.zero_grad(set_to_none=True)
        workload.loss(tuned).backward()
        optimizer.step()
        report = tuning_report(tuned)
        if report.settled:
            break
    # Once settled the tuned model runs the chosen setting; both are timed alike, interleaved.
    chosen_ms, current_ms = timed_steps(
        [tuned, wrap(workload.new_model(), current)],
        workload.loss,
        ctx.options.steps,
        group=ctx.group,
        device=ctx.device,
    )
    return report, chosen_ms if report.settled else None, current_ms


def _check_overlap(ctx: _Context) -> Check:
    if ctx.world_size == 1:
        return perf_checks.not_applicable(
            "overlap", "one rank communicates nothing", "run with --nproc 2 or more"
        )
    workload = _workload(ctx)
    model = workload.new_model()
    wrapped = _ddp(ctx, model, _current_bucket_mb(ctx, model))
    logdir = ctx.options.logdir or tempfile.mkdtemp(prefix=f"ovk-doctor-rank{ctx.rank}-")
    try:
        with profile(logdir, wait=1, warmup=1, active=3, write_outputs=False) as prof:
            timed_steps(
                [wrapped],
                workload.loss,
                3,
                group=ctx.group,
                device=ctx.device,
                after_step=prof.step,
                barrier=False,
            )
        rows = [row.to_dict() for row in prof.summary()]
    finally:
        if ctx.options.logdir is None:
            shutil.rmtree(logdir, ignore_errors=True)
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, rows, group=ctx.group)
    return perf_checks.check_overlap([row for rank_rows in gathered for row in rank_rows])


def _check_placement(ctx: _Context) -> Check:
    return setup_checks.check_placement(ctx.reference, ctx.options.sizes)


def _check_scaling(ctx: _Context) -> Check:
    workload = _workload(ctx)
    throughputs = {}
    for n in rank_counts(ctx.world_size):
        # new_group is collective: every rank creates every group, members run.
        ranks = list(range(n))
        group = (
            ctx.group
            if n == ctx.world_size
            else dist.new_group(ranks, backend="nccl" if ctx.backend == "nccl" else "gloo")
        )
        if ctx.rank in ranks:
            model = workload.new_model()
            wrapped = _ddp(ctx, model, _current_bucket_mb(ctx, model), group)
            (step_ms,) = timed_steps(
                [wrapped], workload.loss, ctx.options.steps, group=group, device=ctx.device
            )
            throughputs[n] = n * workload.items / (step_ms / 1e3)
        # The ranks outside wait here for the members to finish.
        dist.barrier(group=ctx.group)
    agreed: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(agreed, throughputs, group=ctx.group)
    unit = "samples" if ctx.options.model == "mlp" else "tokens"
    return perf_checks.check_scaling(agreed[0], unit=unit)


CHECKS: dict[str, Callable[[_Context], Check]] = {
    "topology": _check_topology,
    "nic_affinity": _check_affinity,
    "bandwidth": _check_bandwidth,
    "algorithms": _check_algorithms,
    "bucket_size": _check_bucket_size,
    "prefetch": _check_prefetch,
    "overlap": _check_overlap,
    "placement": _check_placement,
    "scaling": _check_scaling,
}


def doctor_on_rank(rank: int, world_size: int, options: DoctorOptions) -> list[Check]:
    """Run the selected checks on this rank of an initialised job; every rank calls it.

    Returns:
        list[Check]: rank 0's results, the same on every rank.
    """
    group, backend, device = _comm_setup(rank, world_size)
    topology = detect_topology(group)
    expected = load_topology(options.topology) if options.topology else None
    ctx = _Context(rank, world_size, group, backend, device, topology, expected, _env(), options)
    checks = []
    for name in options.only:
        try:
            checks.append(CHECKS[name](ctx))
        except Exception as err:  # a doctor reports a broken check instead of stopping
            logger.error("doctor: check %s raised:\n%s", name, traceback.format_exc())
            checks.append(
                Check(
                    name,
                    FAIL,
                    f"error: {type(err).__name__}: {err}",
                    "the check itself failed; see the log above for the traceback",
                )
            )
    agreed = [checks if rank == 0 else None]
    dist.broadcast_object_list(agreed, src=0, group=group)
    return agreed[0]


def _launched_rank(rank: int, world_size: int, options: DoctorOptions) -> list[dict[str, Any]]:
    return [c.to_dict() for c in doctor_on_rank(rank, world_size, options)]


def under_torchrun() -> bool:
    """Started by torchrun / torch elastic (``RANK`` and ``WORLD_SIZE`` in the environment)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_doctor(options: DoctorOptions, *, nproc: int = 2) -> tuple[list[Check], dict[str, Any]]:
    """Run the doctor: on this job's ranks under torchrun, else on ``nproc`` local ranks.

    Returns:
        tuple: the checks (rank 0's, which every rank agrees on) and facts about the run
        (``world_size``, ``launcher``, ``rank``).

    Raises:
        ValueError: ``nproc < 1``.
        RankFailure: a local rank raised or died (a RuntimeError carrying its traceback).
    """
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        started = not dist.is_initialized()
        if started:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
        try:
            checks = doctor_on_rank(rank, world, options)
        finally:
            if started:
                dist.destroy_process_group()
        return checks, {"world_size": world, "launcher": "torchrun", "rank": rank}
    check_int("--nproc", nproc, 1)
    rows = run_on_ranks(
        _launched_rank,
        nproc,
        options,
        collective_timeout_s=120,
        total_timeout_s=900,
    )[0]
    checks = [Check(**row) for row in rows]
    return checks, {"world_size": nproc, "launcher": "local", "rank": 0}
