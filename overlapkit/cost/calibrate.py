"""Measure this machine's all-reduce like nccl-tests, fit latency and bandwidth per tier.

``calibrate()`` times ``all_reduce`` for sizes from 4 KiB to 256 MiB (doubling) on the scale-up
tier (the ranks of one node) and, with two or more nodes, the scale-out tier (one rank per
node). For every tier it fits the ring all-reduce model

    t(S) = 2(n-1) x latency + 2(n-1)/n x S / bandwidth

by least squares on *relative* error (every size counts alike, 4 KiB as much as 256 MiB), and
writes a topology YAML with the fitted, achieved figures (efficiency 1.0) that
``ok.load_topology`` and ``overlapkit estimate --topology FILE`` read back.

Timing follows nccl-tests: per size a few warm-up calls, then iterations each fenced by a
barrier; an iteration's time is the slowest rank's; the reported time is the median iteration,
or another quantile: on a shared machine other work only ever adds time, so a lower quantile
(``quantile=0.25``) measures the undisturbed collective more reproducibly than the median does.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from overlapkit.topology.detect import detect_topology
from overlapkit.topology.loading import parse_topology_yaml
from overlapkit.topology.model import DomainKind, FabricKind, Topology
from overlapkit.topology.units import format_bytes, format_seconds
from overlapkit.validation import is_finite_number
from overlapkit.workers.local_ranks import run_on_ranks

logger = logging.getLogger(__name__)

DEFAULT_MIN_BYTES = 4 * 2**10
DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_OUTPUT = Path("runs/calibration/topology.yaml")


@dataclass(frozen=True, slots=True)
class Measurement:
    """One size's all-reduce: time (s; a quantile of the iterations, the median by default) and
    nccl-tests algbw / busbw (GB/s)."""

    nbytes: int
    time_s: float
    group_size: int
    iterations: int
    samples: tuple[float, ...] = ()
    """Every iteration's time (s, slowest rank), in the order they ran."""

    @property
    def algbw_GBps(self) -> float:
        return self.nbytes / self.time_s / 1e9

    @property
    def busbw_GBps(self) -> float:
        n = self.group_size
        return self.algbw_GBps * 2 * (n - 1) / n


@dataclass(frozen=True, slots=True)
class TierFit:
    """Fitted ring all-reduce figures of one tier."""

    tier: str
    """``"scale_up"`` or ``"scale_out"``."""
    ranks: tuple[int, ...]
    latency_us: float
    """Per ring step, us."""
    bandwidth_GBps: float
    """Achieved per rank and direction, GB/s."""
    measurements: tuple[Measurement, ...]

    def predict_s(self, nbytes: float) -> float:
        """The fitted model's all-reduce time for ``nbytes``, in seconds."""
        n = len(self.ranks)
        return 2 * (n - 1) * self.latency_us * 1e-6 + 2 * (n - 1) / n * nbytes / (
            self.bandwidth_GBps * 1e9
        )


@dataclass(frozen=True, slots=True)
class Calibration:
    fits: tuple[TierFit, ...]
    topology: Topology
    yaml_text: str
    backend: str


def sizes_between(min_bytes: int, max_bytes: int) -> list[int]:
    """Doubling sizes from ``min_bytes`` to ``max_bytes`` (bytes, multiples of 4)."""
    if min_bytes < 4 or max_bytes < min_bytes:
        raise ValueError(f"need 4 <= min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    sizes, size = [], int(min_bytes)
    while size <= max_bytes:
        sizes.append(size - size % 4)
        size *= 2
    return sizes


def sample_quantile(samples: Sequence[float], quantile: float) -> float:
    """The ``quantile`` (0..1, linear interpolation) of ``samples``; 0.5 is the median."""
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    if not samples:
        raise ValueError("quantile of no samples")
    ordered = sorted(samples)
    position = quantile * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def fit_ring_all_reduce(
    measurements: Sequence[Measurement], *, min_bytes: int = 0
) -> tuple[float, float]:
    """(latency_us per step, bandwidth_GBps) of the ring model that best fits, relatively.

    Minimises sum(((a + b S) - t) / t)^2 over a = 2(n-1) latency and b = 2(n-1)/(n bandwidth),
    over the sizes >= ``min_bytes`` only; a negative intercept is refitted as zero latency.

    Fitting from ``min_bytes`` exists because one line cannot follow a transport whose small
    messages behave differently (gloo on loopback: the per-step cost of messages up to ~1 MiB
    overlaps their transfer, beyond it adds to it); fit the range the planner will ask about.

    Raises:
        ValueError: fewer than two sizes, or times that do not grow with size.
    """
    measurements = [m for m in measurements if m.nbytes >= min_bytes]
    if len(measurements) < 2:
        raise ValueError(
            f"fitting needs two or more sizes >= {min_bytes} bytes, got {len(measurements)}"
        )
    n = measurements[0].group_size
    # Normal equations of the weighted problem: rows (1/t, S/t), target 1.
    rows = [(1 / m.time_s, m.nbytes / m.time_s) for m in measurements]
    s11 = sum(x * x for x, _ in rows)
    s12 = sum(x * y for x, y in rows)
    s22 = sum(y * y for _, y in rows)
    r1, r2 = sum(x for x, _ in rows), sum(y for _, y in rows)
    det = s11 * s22 - s12 * s12
    a, b = (s22 * r1 - s12 * r2) / det, (s11 * r2 - s12 * r1) / det
    if a < 0:
        a, b = 0.0, r2 / s22
    if not b > 0:
        raise ValueError(
            f"all-reduce times do not grow with size up to {measurements[-1].nbytes} bytes, so "
            "no bandwidth shows; measure larger sizes (--max-bytes) or on a quieter machine"
        )
    return a / (2 * (n - 1)) * 1e6, 2 * (n - 1) / n / b / 1e9


def _check_budget(budget_s: float) -> None:
    if not is_finite_number(budget_s) or not budget_s > 0:
        raise ValueError(f"--budget-s must be a finite number of seconds > 0, got {budget_s!r}")


def measure_all_reduce(
    sizes: Sequence[int],
    *,
    group: dist.ProcessGroup | None = None,
    budget_s: float = 0.25,
    progress: bool = True,
    label: str = "all_reduce",
    min_iterations: int = 5,
    quantile: float = 0.5,
) -> list[Measurement]:
    """Time ``all_reduce`` of float32 buffers of each size on ``group`` (a collective).

    Args:
        sizes (Sequence[int]): buffer sizes in bytes.
        group (ProcessGroup): the group; every member calls this. Defaults to the world.
        budget_s (float): about this many seconds per size (``min_iterations`` to 50).
        progress (bool): show a tqdm bar on the group's rank 0.
        label (str): the bar's label.
        min_iterations (int): at least this many timed iterations per size. Defaults to 5.
        quantile (float): which quantile of the iterations is a size's time. Defaults to the
            median (0.5); 0.25 suits a shared machine (see the module docstring).

    Returns:
        list[Measurement]: one per size, identical on every rank.
    """
    sample_quantile([0.0], quantile)  # reject a bad quantile before any collective
    _check_budget(budget_s)
    group = group or dist.group.WORLD
    n = dist.get_world_size(group)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )
    show = progress and dist.get_rank(group) == 0
    out = []
    for nbytes in tqdm(
        sizes, desc=label, unit="size", disable=not show, file=sys.stderr, leave=False
    ):
        buffer = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
        warm = _timed(buffer, group, device, iterations=2)
        iterations = min(50, max(min_iterations, math.ceil(budget_s / max(max(warm), 1e-6))))
        times = _timed(buffer, group, device, iterations=iterations)
        out.append(
            Measurement(
                nbytes=nbytes,
                time_s=sample_quantile(times, quantile),
                group_size=n,
                iterations=iterations,
                samples=tuple(times),
            )
        )
    return out


def _timed(
    buffer: torch.Tensor, group: dist.ProcessGroup, device: torch.device, *, iterations: int
) -> list[float]:
    """Per-iteration all-reduce time of the slowest rank, seconds."""
    times = torch.zeros(iterations, dtype=torch.float64)
    for i in range(iterations):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times[i] = time.perf_counter() - start
    reduced = times.to(device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return reduced.cpu().tolist()


def calibrate_collective(
    sizes: Sequence[int],
    *,
    budget_s: float = 0.25,
    progress: bool = True,
    quantile: float = 0.5,
    fit_min_bytes: int = 0,
) -> Calibration:
    """Measure and fit every tier of the running job; a collective over the default group.

    See ``calibrate`` for the arguments.
    """
    topology = detect_topology()
    nodes = topology.nodes()
    tiers = []
    first_node = nodes[0]
    if len(first_node) > 1:
        tiers.append(("scale_up", first_node))
    if len(nodes) > 1:
        tiers.append(("scale_out", tuple(ranks[0] for ranks in nodes)))
    fits = []
    for tier, ranks in tiers:
        # new_group is itself collective: every rank creates every tier's group.
        group = (
            dist.group.WORLD if len(ranks) == topology.world_size else dist.new_group(list(ranks))
        )
        if dist.get_rank() in ranks:
            measured = measure_all_reduce(
                sizes,
                group=group,
                budget_s=budget_s,
                progress=progress,
                label=f"{tier} all_reduce",
                quantile=quantile,
            )
            latency_us, bandwidth = fit_ring_all_reduce(measured, min_bytes=fit_min_bytes)
            fits.append(TierFit(tier, ranks, latency_us, bandwidth, tuple(measured)))
        dist.barrier()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, fits)
    merged = {fit.tier: fit for rank_fits in gathered for fit in rank_fits}
    fits = [merged[tier] for tier, _ in tiers]
    backend = str(dist.get_backend()).lower()
    text = calibrated_yaml(
        topology, fits, backend=backend, quantile=quantile, fit_min_bytes=fit_min_bytes
    )
    return Calibration(tuple(fits), parse_topology_yaml(text, source="calibration"), text, backend)


def _worker(rank: int, world_size: int, sizes: list[int], options: dict) -> Calibration | None:
    result = calibrate_collective(sizes, **options)
    return result if rank == 0 else None


def calibrate(
    *,
    ranks: int = 2,
    min_bytes: int = DEFAULT_MIN_BYTES,
    max_bytes: int = DEFAULT_MAX_BYTES,
    budget_s: float = 0.25,
    output: str | Path | None = DEFAULT_OUTPUT,
    progress: bool = True,
    quantile: float = 0.5,
    fit_min_bytes: int = 0,
) -> Calibration:
    """Measure this machine's all-reduce and write a fitted topology YAML.

    Inside an initialised job (torchrun) every rank calls it and the job's ranks are measured;
    otherwise ``ranks`` local gloo workers are spawned for it.

    Args:
        ranks (int): local workers to spawn when not inside a job. Defaults to 2.
        min_bytes (int): smallest buffer, bytes. Defaults to 4 KiB.
        max_bytes (int): largest buffer, bytes. Defaults to 256 MiB.
        budget_s (float): seconds spent per size, about. Defaults to 0.25.
        output (str | Path): where rank 0 writes the YAML; None writes nothing.
        progress (bool): show a progress bar. Defaults to True.
        quantile (float): the quantile of each size's iterations that is fitted. Defaults to
            the median; 0.25 on a shared machine.
        fit_min_bytes (int): fit only the sizes >= this (bytes); all are measured and shown.
            Defaults to 0, every size.

    Returns:
        Calibration: measurements and fits per tier, the YAML text and its topology.

    Raises:
        RankFailure: a local worker raised or died (a RuntimeError carrying its traceback).
    """
    if ranks < 2:
        raise ValueError(f"--ranks must be >= 2 to measure a collective, got {ranks}")
    sizes = sizes_between(min_bytes, max_bytes)
    sample_quantile([0.0], quantile)
    _check_budget(budget_s)  # here, before workers are spawned to find it
    if sum(size >= fit_min_bytes for size in sizes) < 2:
        raise ValueError(
            f"--fit-min-bytes {fit_min_bytes} leaves fewer than two of the measured sizes "
            f"({format_bytes(sizes[0])} .. {format_bytes(sizes[-1])}) to fit"
        )
    options = {
        "budget_s": budget_s,
        "progress": progress,
        "quantile": quantile,
        "fit_min_bytes": fit_min_bytes,
    }
    if dist.is_available() and dist.is_initialized():
        result = calibrate_collective(sizes, **options)
        write = dist.get_rank() == 0
    else:
        # A 256 MiB gloo all-reduce takes seconds behind a slow emulated link.
        result = run_on_ranks(
            _worker,
            ranks,
            sizes,
            options,
            collective_timeout_s=120,
            total_timeout_s=1800,
        )[0]
        write = True
    if output is not None and write:
        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(result.yaml_text)
        logger.info("wrote calibrated topology to %s", path)
    return result


def calibrated_yaml(
    topology: Topology,
    fits: Sequence[TierFit],
    *,
    backend: str,
    quantile: float = 0.5,
    fit_min_bytes: int = 0,
) -> str:
    """A topology file with the fitted figures of ``fits`` on ``topology``'s shape."""
    by_tier = {fit.tier: fit for fit in fits}
    up = by_tier.get("scale_up")
    out = by_tier.get("scale_out")
    domain = topology.domains[0]
    devices_per_node = max(len(r) for r in topology.nodes())
    nodes_per_domain = len({topology.devices[r].node for r in domain.ranks})
    fabric = topology.fabric
    doc = {
        "name": f"calibrated-{socket.gethostname()}",
        # gloo runs one ring, as fitted; other backends get no extra factors on top of measured.
        "library": "gloo" if backend == "gloo" else "ideal",
        "nodes": topology.num_nodes,
        "devices_per_node": devices_per_node,
        "device_kind": str(topology.devices[0].kind),
        "scale_up": {
            "kind": str(domain.kind),
            "nodes_per_domain": nodes_per_domain,
            "links": domain.links,
            "bandwidth": f"{up.bandwidth_GBps if up else domain.achieved_GBps:.6g}GB/s",
            "latency": f"{up.latency_us if up else domain.latency_us:.6g}us",
            "efficiency": 1.0,
            "in_network_reduction": domain.in_network_reduction
            and domain.kind is not DomainKind.NONE,
        },
        "scale_out": {
            "kind": str(fabric.kind if fabric.kind is not FabricKind.NONE else FabricKind.FAT_TREE),
            "transport": str(fabric.transport),
            "nics_per_node": max(fabric.nics_per_node, 1),
            "nic_bandwidth": f"{out.bandwidth_GBps if out else fabric.achieved_GBps:.6g}GB/s",
            "latency": f"{out.latency_us if out else fabric.latency_us:.6g}us",
            "efficiency": 1.0,
        },
    }
    lines = [
        f"# Measured by `overlapkit calibrate` on {socket.gethostname()} at "
        f"{datetime.datetime.now().isoformat(timespec='seconds')} (pid {os.getpid()}).",
        f"# {backend} all_reduce, sizes {format_bytes(fits[0].measurements[0].nbytes)} .. "
        f"{format_bytes(fits[0].measurements[-1].nbytes)}, quantile {quantile:g} of each size's "
        "iterations;",
        f"# fitted per tier, sizes >= {format_bytes(fit_min_bytes)}, by relative least squares",
        "# to t = 2(n-1) x latency + 2(n-1)/n x S / bandwidth; figures are achieved "
        "(efficiency 1).",
    ]
    for fit in fits:
        lines.append(
            f"#   {fit.tier}: ranks {list(fit.ranks)}, latency {fit.latency_us:.4g} us "
            f"per step, bandwidth {fit.bandwidth_GBps:.4g} GB/s per rank"
        )
    if out is None:
        lines.append("# scale_out was not measured (one node): its figures are the detected ones.")
    return "\n".join(lines) + "\n" + yaml.safe_dump(doc, sort_keys=False)


def render_calibration(result: Calibration) -> str:
    """nccl-tests-like table per tier, with the fit beside each measurement."""
    lines = []
    for fit in result.fits:
        lines.append(f"{fit.tier}: {result.backend} all_reduce on ranks {list(fit.ranks)}")
        lines.append(
            f"  {'size':>10}  {'time':>10}  {'algbw GB/s':>10}  {'busbw GB/s':>10}  "
            f"{'fit':>10}  {'fit/meas':>8}"
        )
        for m in fit.measurements:
            predicted = fit.predict_s(m.nbytes)
            lines.append(
                f"  {format_bytes(m.nbytes):>10}  {format_seconds(m.time_s):>10}  "
                f"{m.algbw_GBps:>10.3f}  {m.busbw_GBps:>10.3f}  "
                f"{format_seconds(predicted):>10}  {predicted / m.time_s:>8.2f}"
            )
        lines.append(
            f"  fit: latency {fit.latency_us:.4g} us per step, bandwidth "
            f"{fit.bandwidth_GBps:.4g} GB/s per rank and direction"
        )
    return "\n".join(lines)
