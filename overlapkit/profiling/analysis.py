"""Exposed communication per step and per rank, from classified traces (docs/architecture.md).

For each step of each rank, with ``comm`` the collectives assigned to the step (by launch on GPU,
by start on CPU) and ``compute`` the compute intervals assigned to it:

- ``compute_ms`` = |∪ compute|, ``comm_ms`` = |∪ comm|;
- ``exposed_comm_ms`` = |∪ comm ∖ ∪ all compute of the trace|: a collective of step N hidden
  behind step N+1's forward is hidden, and no interval is counted in two steps;
- ``tail_ms`` = the exposed part after the end of the step's last backward compute (when the
  trace has no backward, after the last compute that starts before the step's comm ends);
- ``overlap_ratio`` = 1 - exposed / comm (None for a step without communication).

Across ranks: the slowest rank of each step and the spread of ``comm_ms`` (the rank with the least
comm waited least, so its comm is closest to the transfer itself; the others also waited for it).
"""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from overlapkit.profiling import intervals
from overlapkit.profiling.rank_trace import COLLECTIVE_KINDS, RankTrace, load_rank_trace
from overlapkit.profiling.trace_loader import TraceFormatError

logger = logging.getLogger(__name__)

TRACE_SUFFIXES = (".json", ".json.gz")
TRACE_NAMES = ("*.pt.trace.json*", "rank*_trace.json*")
"""What torch.profiler's ``tensorboard_trace_handler`` and torchtitan's profiler name a trace."""
TORCHTITAN_TRACES = "profiling/traces"
"""Where torchtitan writes them under its dump folder (``Profiler.Config.save_traces_folder``)."""


@dataclass(frozen=True, slots=True)
class KindStats:
    """One collective kind within one step."""

    count: int
    nbytes: int | None
    """Summed input bytes; None when some of its collectives have no size in the trace."""
    time_ms: float
    """|∪ intervals| of this kind, ms."""
    exposed_ms: float = 0.0
    """|∪ intervals of this kind ∖ all compute|, ms (for ``send_recv`` on a pipeline stage: the
    bubble, waiting for the neighbour stage, plus the transfers)."""


@dataclass(frozen=True, slots=True)
class StepLanes:
    """The intervals (µs) behind one step's numbers; what the timeline draws."""

    rank: int
    step: int
    file: str
    pid: Any
    """The main thread's process id in the trace (where counter tracks are drawn)."""
    start: float
    end: float
    compute: list[intervals.Interval]
    comm: list[intervals.Interval]
    exposed: list[intervals.Interval]
    tail_from: float | None
    """Where the tail starts (end of the last backward compute), µs; None without comm."""


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """Per rank, per step numbers; all times in ms (see the module docstring)."""

    rank: int
    step: int
    step_ms: float
    compute_ms: float
    comm_ms: float
    exposed_comm_ms: float
    tail_ms: float
    overlap_ratio: float | None
    kinds: dict[str, KindStats]
    file: str

    def to_dict(self) -> dict[str, Any]:
        row = asdict(self)
        row["kinds"] = {
            kind: {
                "count": s.count,
                "bytes": s.nbytes,
                "time_ms": s.time_ms,
                "exposed_ms": s.exposed_ms,
            }
            for kind, s in self.kinds.items()
        }
        return row


def _by_step(trace: RankTrace, items: list, anchor_of: Callable[[Any], float]) -> dict[int, list]:
    """Group ``items`` by the index of the step window that holds their anchor time."""
    starts = [s[1] for s in trace.steps]
    grouped: dict[int, list] = defaultdict(list)
    for item in items:
        anchor = anchor_of(item)
        i = bisect.bisect_right(starts, anchor) - 1
        if i >= 0 and anchor < trace.steps[i][2]:
            grouped[i].append(item)
    return grouped


def _tail_start(
    comm: list[intervals.Interval], backward: list, compute_all: list[intervals.Interval]
) -> float:
    if backward:
        return max(end for _, end, _ in backward)
    comm_end = comm[-1][1]
    i = bisect.bisect_left(compute_all, comm_end, key=lambda iv: iv[0]) - 1
    return compute_all[i][1] if i >= 0 else comm[0][0]


def _kind_stats(ops: list, compute_all: list[intervals.Interval]) -> dict[str, KindStats]:
    stats = {}
    for kind in COLLECTIVE_KINDS:
        mine = [op for op in ops if op.kind == kind]
        if not mine:
            continue
        sizes = [op.nbytes for op in mine]
        comm = intervals.union((op.start, op.end) for op in mine)
        hiding = intervals.clip(compute_all, comm[0][0], comm[-1][1])
        stats[kind] = KindStats(
            count=len(mine),
            nbytes=None if None in sizes else sum(sizes),
            time_ms=intervals.total(comm) / 1e3,
            exposed_ms=intervals.total(intervals.subtract(comm, hiding)) / 1e3,
        )
    return stats


def analyze_trace(trace: RankTrace) -> tuple[list[StepMetrics], list[StepLanes]]:
    """Per step metrics and the intervals behind them, for one rank's trace."""
    compute_all = intervals.union((s, e) for s, e, _ in trace.compute)
    comm_by_step = _by_step(trace, trace.comm, lambda op: op.anchor)
    compute_by_step = _by_step(trace, trace.compute, lambda iv: iv[2])
    backward_by_step = _by_step(trace, trace.backward, lambda iv: iv[2])
    metrics, lanes = [], []
    for i, (number, start, end) in enumerate(trace.steps):
        ops = comm_by_step.get(i, [])
        comm = intervals.union((op.start, op.end) for op in ops)
        compute = intervals.union((s, e) for s, e, _ in compute_by_step.get(i, []))
        tail_from = None
        exposed: list[intervals.Interval] = []
        if comm:
            hiding = intervals.clip(compute_all, comm[0][0], comm[-1][1])
            exposed = intervals.subtract(comm, hiding)
            tail_from = _tail_start(comm, backward_by_step.get(i, []), compute_all)
        comm_us, exposed_us = intervals.total(comm), intervals.total(exposed)
        tail_us = intervals.total(intervals.clip(exposed, tail_from, float("inf"))) if comm else 0.0
        metrics.append(
            StepMetrics(
                rank=trace.rank,
                step=number,
                step_ms=(end - start) / 1e3,
                compute_ms=intervals.total(compute) / 1e3,
                comm_ms=comm_us / 1e3,
                exposed_comm_ms=exposed_us / 1e3,
                tail_ms=tail_us / 1e3,
                overlap_ratio=(1.0 - exposed_us / comm_us) if comm_us > 0 else None,
                kinds=_kind_stats(ops, compute_all),
                file=trace.path.name,
            )
        )
        lanes.append(
            StepLanes(
                rank=trace.rank,
                step=number,
                file=trace.path.name,
                pid=trace.main_pid,
                start=start,
                end=end,
                compute=compute,
                comm=comm,
                exposed=exposed,
                tail_from=tail_from,
            )
        )
    return metrics, lanes


@dataclass(frozen=True, slots=True)
class CrossRankStep:
    """One step across ranks: who was slowest and how far ``comm_ms`` spread (ms)."""

    step: int
    ranks: int
    slowest_rank: int
    slowest_step_ms: float
    fastest_step_ms: float
    min_comm_rank: int
    min_comm_ms: float
    max_comm_rank: int
    max_comm_ms: float
    comm_spread_ms: float
    """max - min comm_ms: roughly the time the faster ranks waited for the slowest one."""


def cross_rank(steps: list[StepMetrics]) -> list[CrossRankStep]:
    """For each step number: the slowest rank and the spread of comm time across ranks."""
    by_number: dict[int, list[StepMetrics]] = defaultdict(list)
    for row in steps:
        by_number[row.step].append(row)
    out = []
    for number in sorted(by_number):
        rows = by_number[number]
        slowest = max(rows, key=lambda r: r.step_ms)
        least = min(rows, key=lambda r: r.comm_ms)
        most = max(rows, key=lambda r: r.comm_ms)
        out.append(
            CrossRankStep(
                step=number,
                ranks=len({r.rank for r in rows}),
                slowest_rank=slowest.rank,
                slowest_step_ms=slowest.step_ms,
                fastest_step_ms=min(r.step_ms for r in rows),
                min_comm_rank=least.rank,
                min_comm_ms=least.comm_ms,
                max_comm_rank=most.rank,
                max_comm_ms=most.comm_ms,
                comm_spread_ms=most.comm_ms - least.comm_ms,
            )
        )
    return out


def rank_totals(steps: list[StepMetrics]) -> list[dict[str, Any]]:
    """Per rank sums over its steps and the whole-trace overlap percentage."""
    out = []
    for rank in sorted({r.rank for r in steps}):
        rows = [r for r in steps if r.rank == rank]
        comm = sum(r.comm_ms for r in rows)
        exposed = sum(r.exposed_comm_ms for r in rows)
        out.append(
            {
                "rank": rank,
                "steps": len(rows),
                "compute_ms": sum(r.compute_ms for r in rows),
                "comm_ms": comm,
                "exposed_comm_ms": exposed,
                "tail_ms": sum(r.tail_ms for r in rows),
                "overlap_pct": 100.0 * (1.0 - exposed / comm) if comm > 0 else None,
            }
        )
    return out


@dataclass(slots=True)
class RunReport:
    """Everything ``overlapkit report`` prints, for one directory of traces."""

    run_dir: Path
    steps: list[StepMetrics]
    lanes: list[StepLanes]
    files: list[str]
    skipped: list[dict[str, str]]
    warnings: list[str] = field(default_factory=list)
    traces: list[dict[str, Any]] = field(default_factory=list)
    """Per analysed file: ``file``, ``rank``, ``world_size``, ``device`` (gpu/cpu), ``steps``."""

    def to_json(self) -> dict[str, Any]:
        """``overlapkit report --json`` (docs/json-contracts.md) plus extras."""
        return {
            "run_dir": str(self.run_dir),
            "steps": [row.to_dict() for row in self.steps],
            "files": self.files,
            "skipped": self.skipped,
            "warnings": self.warnings,
            "traces": self.traces,
            "ranks": rank_totals(self.steps),
            "cross_rank": [asdict(c) for c in cross_rank(self.steps)],
        }


def find_trace_files(run_dir: Path, iteration: int | None = None) -> list[Path]:
    """The ``*.json``/``*.json.gz`` files directly in ``run_dir`` (sorted by name); else, or
    with ``iteration``, torchtitan's: ``iteration_N/[leaf/]rankR_trace.json.gz`` under
    ``run_dir`` or its ``profiling/traces`` (``run_dir`` a torchtitan dump folder), every N or
    that one."""
    direct = [p for p in run_dir.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES)]
    if direct and iteration is None:
        return sorted(direct)
    folders = f"iteration_{'*' if iteration is None else iteration}"
    return sorted(
        p
        for base in (run_dir, run_dir / TORCHTITAN_TRACES)
        for p in base.glob(f"{folders}/**/*")
        if p.is_file() and p.name.endswith(TRACE_SUFFIXES)
    )


def analyze_files(files: list[Path], run_dir: Path) -> RunReport:
    """Analyse trace files; unreadable ones are listed in ``skipped`` and the rest still count."""
    report = RunReport(run_dir=run_dir, steps=[], lanes=[], files=[], skipped=[])
    seen: dict[tuple[int, int], str] = {}
    for path in files:
        try:
            trace = load_rank_trace(path)
        except (TraceFormatError, OSError) as err:
            reason = str(err).removeprefix(f"{path}: ")
            logger.warning("skipping %s: %s", path, reason)
            report.skipped.append({"file": str(path), "reason": reason})
            continue
        report.files.append(str(path))
        report.warnings.extend(trace.warnings)
        report.traces.append(
            {
                "file": str(path),
                "rank": trace.rank,
                "world_size": trace.world_size,
                "device": trace.device,
                "steps": [number for number, _, _ in trace.steps],
            }
        )
        metrics, lanes = analyze_trace(trace)
        for row in metrics:
            key = (row.rank, row.step)
            if key in seen:
                report.warnings.append(
                    f"rank {row.rank} step {row.step} appears in {seen[key]} and {row.file}; "
                    "both are kept (were two runs written to one directory?)"
                )
            seen.setdefault(key, row.file)
        report.steps.extend(metrics)
        report.lanes.extend(lanes)
    report.steps.sort(key=lambda r: (r.step, r.rank))
    report.lanes.sort(key=lambda s: (s.step, s.rank))
    return report


def analyze_run(run_dir: str | Path, iteration: int | None = None) -> RunReport:
    """Analyse every trace inside ``run_dir`` (all ranks, all profiling cycles).

    Args:
        run_dir (str | Path): the ``logdir`` given to ``ok.profile`` (or any directory of
            ``.pt.trace.json`` / ``.json.gz`` traces), or a torchtitan dump folder
            (``find_trace_files``).
        iteration (int | None): only torchtitan's ``iteration_N`` folder of that N.

    Returns:
        RunReport: per step, per rank metrics in ms; skipped files with the reason.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist.
        ValueError: ``run_dir`` is a file, or it holds no readable trace (the message lists
            what was skipped, and subdirectories that hold traces).
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} is a file, not a directory of traces")
    report = analyze_files(find_trace_files(run_dir, iteration), run_dir)
    if report.files:
        return report
    detail = "; ".join(f"{Path(s['file']).name}: {s['reason']}" for s in report.skipped)
    nested = sorted(
        {str(p.parent.relative_to(run_dir)) for name in TRACE_NAMES for p in run_dir.rglob(name)}
        - {"."}
    )
    hint = f" Subdirectories with traces: {', '.join(nested)}." if nested else ""
    where = f"iteration_{iteration} of " if iteration is not None else ""
    raise ValueError(
        f"no readable profiler trace (*.pt.trace.json, *.json.gz) in {where}{str(run_dir)!r}"
        + (f"; skipped {detail}" if detail else "")
        + "."
        + hint
    )
