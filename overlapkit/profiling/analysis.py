"""Exposed communication per step and per rank for a run's trace files (docs/profiling.md).

Each file is read and reduced by itself (``analyze_file``: ``rank_trace`` → ``step_metrics``,
and with ``programs`` the collective program of ``programs``), on as many worker processes as
there are cores (``file_pool``). The results are small arrays; ``RunReport`` holds them for the
whole run and makes ``StepMetrics`` rows only when asked (``steps``), so a thousand ranks of
hundreds of steps cost tens of megabytes here. See ``step_metrics`` for what each number means.

Across ranks: ``rank_summary`` (the slowest ranks of each step, per rank totals and
percentiles); matching collectives and stragglers are ``collectives`` and ``stragglers``.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from overlapkit.group.dim_labels import COMM_DIMS
from overlapkit.profiling.file_pool import map_files
from overlapkit.profiling.programs import RankProgram, rank_program
from overlapkit.profiling.rank_summary import (
    TABLE_DTYPE,
    CrossRankStep,
    cross_rank,
    rank_percentiles,
    rank_totals,
    slowest_ranks,
)
from overlapkit.profiling.rank_trace import COLLECTIVE_KINDS, load_rank_trace
from overlapkit.profiling.record_store import DEFAULT_BUDGET_BYTES, SpillStore
from overlapkit.profiling.step_metrics import StepLanes, compute_table, step_rows
from overlapkit.profiling.trace_loader import TraceFormatError

logger = logging.getLogger(__name__)

TRACE_SUFFIXES = (".json", ".json.gz")
TRACE_NAMES = ("*.pt.trace.json*", "rank*_trace.json*")
"""What torch.profiler's ``tensorboard_trace_handler`` and torchtitan's profiler name a trace."""
TORCHTITAN_TRACES = "profiling/traces"
"""Where torchtitan writes them under its dump folder (``Profiler.Config.save_traces_folder``)."""
KIND_ROW_DTYPE = np.dtype(
    [
        ("row", "i8"),
        ("kind", "i4"),
        ("count", "i8"),
        ("bytes", "i8"),
        ("time_ms", "f8"),
        ("exposed_ms", "f8"),
    ]
)

__all__ = [
    "CrossRankStep",
    "KindStats",
    "RunReport",
    "StepLanes",
    "StepMetrics",
    "analyze_files",
    "analyze_run",
    "cross_rank",
    "find_trace_files",
    "rank_totals",
]


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
class StepMetrics:
    """Per rank, per step numbers; all times in ms (see ``step_metrics``)."""

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
    dims: dict[str, KindStats] = field(default_factory=dict)
    """The same numbers per parallel dimension the collectives served (``COMM_DIMS``: tp, cp,
    ep, pp, dp, other; ``comm_dims`` says how each is told)."""

    def to_dict(self) -> dict[str, Any]:
        row = asdict(self)
        for key in ("kinds", "dims"):
            row[key] = {
                name: {
                    "count": s.count,
                    "bytes": s.nbytes,
                    "time_ms": s.time_ms,
                    "exposed_ms": s.exposed_ms,
                }
                for name, s in getattr(self, key).items()
            }
        return row


@dataclass(slots=True)
class FileResult:
    """What a worker returns for one file: small arrays, or why the file was skipped."""

    path: str
    error: str | None = None
    rank: int = 0
    world_size: int | None = None
    device: str = "cpu"
    steps: np.ndarray | None = None
    kinds: np.ndarray | None = None
    dims: np.ndarray | None = None
    lanes: list[StepLanes] = field(default_factory=list)
    program: RankProgram | None = None
    warnings: list[str] = field(default_factory=list)


def analyze_file(
    path: Path,
    *,
    lanes: bool | set[int] = False,
    program: bool = False,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> FileResult:
    """Analyse one trace file (a worker's task; an unreadable file gives ``error``).

    Args:
        path (Path): the trace.
        lanes (bool | set[int]): keep the intervals of every step (True) or of these steps.
        program (bool): also build the collective program (``programs``) for stragglers.
        budget_bytes (int): memory for the file's records before they spill to disk.
    """
    try:
        with SpillStore(budget_bytes) as store:
            trace = load_rank_trace(path, store=store)
            compute = compute_table(trace)
            wanted = {n for n, _, _ in trace.steps} if lanes is True else (lanes or None)
            steps, kinds, dims, step_lanes = step_rows(trace, compute, wanted)
            built = rank_program(trace, compute) if program else None
    except (TraceFormatError, OSError) as err:
        return FileResult(path=str(path), error=str(err).removeprefix(f"{path}: "))
    return FileResult(
        path=str(path),
        rank=trace.rank,
        world_size=trace.world_size,
        device=trace.device,
        steps=steps,
        kinds=kinds,
        dims=dims,
        lanes=step_lanes,
        program=built,
        warnings=trace.warnings,
    )


@dataclass(slots=True)
class RunReport:
    """Everything ``overlapkit report`` prints, for one directory of traces."""

    run_dir: Path
    table: np.ndarray
    """``TABLE_DTYPE``: one row per rank and step, sorted by step then rank (ms)."""
    kind_table: np.ndarray
    """Per row of ``table`` index (``row``) and kind: count, bytes (-1 unknown), time_ms."""
    dim_table: np.ndarray
    """The same per row and parallel dimension (``kind``: a ``COMM_DIMS`` code)."""
    files: list[str]
    skipped: list[dict[str, str]]
    lanes: list[StepLanes] = field(default_factory=list)
    programs: list[RankProgram] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    traces: list[dict[str, Any]] = field(default_factory=list)
    """Per analysed file: ``file``, ``rank``, ``world_size``, ``device`` (gpu/cpu), ``steps``."""
    _steps: list[StepMetrics] | None = None

    @property
    def steps(self) -> list[StepMetrics]:
        """One ``StepMetrics`` per row of ``table`` (made on first use)."""
        if self._steps is None:
            self._steps = self.step_metrics(len(self.table))
        return self._steps

    def step_metrics(self, limit: int) -> list[StepMetrics]:
        """The first ``limit`` rows of ``table`` as ``StepMetrics``."""
        kinds = _stats_by_row(self.kind_table, COLLECTIVE_KINDS, limit)
        dims = _stats_by_row(self.dim_table, COMM_DIMS, limit)
        names = [Path(f).name for f in self.files]
        out = []
        for i, r in enumerate(self.table[:limit].tolist()):
            rank, step, file, step_ms, compute_ms, comm_ms, exposed, tail = r
            out.append(
                StepMetrics(
                    rank=rank,
                    step=step,
                    step_ms=step_ms,
                    compute_ms=compute_ms,
                    comm_ms=comm_ms,
                    exposed_comm_ms=exposed,
                    tail_ms=tail,
                    overlap_ratio=(1.0 - exposed / comm_ms) if comm_ms > 0 else None,
                    kinds=kinds.get(i, {}),
                    file=names[file],
                    dims=dims.get(i, {}),
                )
            )
        return out

    def to_json(self, step_rows: int | None = None) -> dict[str, Any]:
        """``overlapkit report --json`` (docs/json-contracts.md) plus extras.

        Args:
            step_rows (int | None): keep only this many ``steps`` rows (None: all).
        """
        limit = len(self.table) if step_rows is None else min(step_rows, len(self.table))
        steps = self.steps[:limit] if self._steps is not None else self.step_metrics(limit)
        return {
            "run_dir": str(self.run_dir),
            "steps": [row.to_dict() for row in steps],
            "steps_omitted": len(self.table) - limit,
            "files": self.files,
            "skipped": self.skipped,
            "warnings": self.warnings,
            "traces": self.traces,
            "ranks": rank_totals(self.table),
            "cross_rank": [asdict(c) for c in cross_rank(self.table)],
            "slowest_ranks": slowest_ranks(self.table),
            "rank_percentiles": rank_percentiles(self.table),
        }


def _stats_by_row(
    table: np.ndarray, names: tuple[str, ...], limit: int
) -> dict[int, dict[str, KindStats]]:
    """``KIND_ROW_DTYPE`` rows below ``limit`` as ``{row: {names[code]: KindStats}}``."""
    out: dict[int, dict[str, KindStats]] = {}
    for row, code, count, nbytes, time_ms, exposed_ms in table.tolist():
        if row < limit:
            out.setdefault(row, {})[names[code]] = KindStats(
                count=count,
                nbytes=None if nbytes < 0 else nbytes,
                time_ms=time_ms,
                exposed_ms=exposed_ms,
            )
    return out


def find_trace_files(run_dir: Path, iteration: int | None = None) -> list[Path]:
    """The trace files of a run, the one place that decides which they are: the
    ``*.json``/``*.json.gz`` files directly in ``run_dir`` (sorted by name); else, or with
    ``iteration``, torchtitan's: ``iteration_N/[leaf/]rankR_trace.json.gz`` under ``run_dir`` or
    its ``profiling/traces`` (``run_dir`` a torchtitan dump folder), every N or that one."""
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


def analyze_files(
    files: list[Path],
    run_dir: Path,
    *,
    jobs: int | None = None,
    lanes: bool | set[int] = False,
    programs: bool = False,
    **options: Any,
) -> RunReport:
    """Analyse trace files; unreadable ones are listed in ``skipped`` and the rest still count.

    Args:
        files (list[Path]): the traces, in the order their rows are kept for equal keys.
        run_dir (Path): the directory reported.
        jobs (int | None): worker processes (None: the cores available; ``file_pool``).
        lanes (bool | set[int]): keep the intervals of every step (True) or of these steps.
        programs (bool): build each file's collective program (for ``stragglers``).
        **options: ``min_bytes`` (``file_pool.map_files``), ``budget_bytes`` (``analyze_file``).
    """
    min_bytes = options.pop("min_bytes", None)
    pool_options = {} if min_bytes is None else {"min_bytes": min_bytes}
    results = map_files(
        analyze_file, files, jobs=jobs, lanes=lanes, program=programs, **pool_options, **options
    )
    report = RunReport(
        run_dir=run_dir,
        table=np.empty(0, TABLE_DTYPE),
        kind_table=np.empty(0, KIND_ROW_DTYPE),
        dim_table=np.empty(0, KIND_ROW_DTYPE),
        files=[],
        skipped=[],
    )
    tables, kind_tables = [], []
    for result in results:
        if result.error is not None:
            logger.warning("skipping %s: %s", result.path, result.error)
            report.skipped.append({"file": result.path, "reason": result.error})
            continue
        index = len(report.files)
        report.files.append(result.path)
        report.warnings.extend(result.warnings)
        numbers = result.steps["step"]
        report.traces.append(
            {
                "file": result.path,
                "rank": result.rank,
                "world_size": result.world_size,
                "device": result.device,
                "steps": numbers.tolist(),
            }
        )
        table = np.zeros(len(numbers), TABLE_DTYPE)
        table["rank"], table["step"], table["file"] = result.rank, numbers, index
        table["step_ms"] = (result.steps["end"] - result.steps["start"]) / 1e3
        for name in ("compute_ms", "comm_ms", "exposed_comm_ms", "tail_ms"):
            table[name] = result.steps[name]
        tables.append(table)
        kind_tables.append((index, result.kinds, result.dims))
        report.lanes.extend(result.lanes)
        if result.program is not None:
            report.programs.append(result.program)
    _assemble(report, tables, kind_tables)
    return report


def _assemble(report: RunReport, tables: list[np.ndarray], kind_tables: list) -> None:
    """Sort the rows by (step, rank), keep the kinds and dims beside them, warn about
    duplicates."""
    table = np.concatenate(tables) if tables else np.empty(0, TABLE_DTYPE)
    order = np.lexsort((np.arange(len(table)), table["rank"], table["step"]))
    report.table = table[order]
    position = np.empty(len(order), np.int64)
    position[order] = np.arange(len(order))
    row_of = {}
    offset = 0
    for t in tables:
        for k, (file, step) in enumerate(zip(t["file"].tolist(), t["step"].tolist(), strict=True)):
            row_of[(file, step)] = int(position[offset + k])
        offset += len(t)
    for attr, column in (("kind_table", 1), ("dim_table", 2)):
        rows = [
            (row_of[(t[0], int(step))], int(code), int(count), int(nbytes), time_ms, exposed_ms)
            for t in kind_tables
            for step, code, count, nbytes, time_ms, exposed_ms in t[column].tolist()
            if (t[0], int(step)) in row_of
        ]
        setattr(report, attr, np.array(rows, dtype=KIND_ROW_DTYPE))
    keys = report.table[["rank", "step"]]
    if len(keys) > 1:
        same = np.flatnonzero(
            (keys["rank"][1:] == keys["rank"][:-1]) & (keys["step"][1:] == keys["step"][:-1])
        )
        names = [Path(f).name for f in report.files]
        for i in same.tolist():
            a, b = report.table[i], report.table[i + 1]
            report.warnings.append(
                f"rank {a['rank']} step {a['step']} appears in {names[a['file']]} and "
                f"{names[b['file']]}; both are kept (were two runs written to one directory?)"
            )
    report.lanes.sort(key=lambda s: (s.step, s.rank))


def analyze_run(run_dir: str | Path, iteration: int | None = None, **options: Any) -> RunReport:
    """Analyse every trace inside ``run_dir`` (all ranks, all profiling cycles).

    Args:
        run_dir (str | Path): the ``logdir`` given to ``ok.profile`` (or any directory of
            ``.pt.trace.json`` / ``.json.gz`` traces), or a torchtitan dump folder
            (``find_trace_files``).
        iteration (int | None): only torchtitan's ``iteration_N`` folder of that N.
        **options: passed to ``analyze_files`` (``jobs``, ``lanes``, ``programs``, ...).

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
    report = analyze_files(find_trace_files(run_dir, iteration), run_dir, **options)
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
