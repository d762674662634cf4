"""Counter tracks (``"ph": "C"``) that put exposed communication on the trace timeline.

``write_counter_copy`` writes a copy of a trace with two counters added to its main process:

- ``overlapkit comm`` — stacked series ``exposed`` and ``hidden``: 1 while the step's collectives
  run uncovered by compute, resp. covered by it; 0 otherwise;
- ``overlapkit step (ms)`` — ``compute_ms``, ``comm_ms``, ``exposed_comm_ms`` of each step, held
  from the step's start to its end.

TensorBoard's trace view and Perfetto draw counters as area charts above the process's threads.
The copy keeps the original's name and lives in a sibling directory (``overlap_trace/``), so the
original is untouched and the copy shows up in torch-tb-profiler as a run of its own.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from overlapkit.profiling import intervals
from overlapkit.profiling.analysis import StepLanes, StepMetrics
from overlapkit.profiling.trace_loader import TraceFormatError, open_text

COUNTER_DIR = "overlap_trace"
_EVENTS_START = re.compile(r'"traceEvents"\s*:\s*\[')


def _counter(name: str, pid: Any, ts: float, values: dict[str, float]) -> dict[str, Any]:
    return {"ph": "C", "name": name, "pid": pid, "ts": ts, "args": values}


def counter_events(lanes: StepLanes, metrics: StepMetrics) -> list[dict[str, Any]]:
    """The counter events for one step (timestamps in the trace's µs)."""
    pid = lanes.pid
    events = [
        _counter(
            "overlapkit step (ms)",
            pid,
            lanes.start,
            {
                "compute_ms": round(metrics.compute_ms, 3),
                "comm_ms": round(metrics.comm_ms, 3),
                "exposed_comm_ms": round(metrics.exposed_comm_ms, 3),
            },
        ),
        _counter(
            "overlapkit step (ms)",
            pid,
            lanes.end,
            {"compute_ms": 0, "comm_ms": 0, "exposed_comm_ms": 0},
        ),
    ]
    hidden = intervals.subtract(lanes.comm, lanes.exposed)
    # Each boundary sets both series; sampling at every boundary keeps the stack exact.
    edges = sorted({t for iv in (*lanes.exposed, *hidden) for t in iv})
    for t in edges:
        exposed = intervals.contains(lanes.exposed, t)
        covered = intervals.contains(hidden, t)
        events.append(
            _counter(
                "overlapkit comm",
                pid,
                t,
                {
                    "exposed": int(exposed),
                    "hidden": int(covered),
                },
            )
        )
    return events


def write_counter_copy(
    trace_path: Path, steps: Iterable[tuple[StepLanes, StepMetrics]], out_dir: Path
) -> Path:
    """Copy ``trace_path`` into ``out_dir`` with counter events for ``steps`` inserted.

    The events are spliced in at the start of ``traceEvents``; the rest of the file is copied
    as text, so the copy is as faithful as the original.

    Returns:
        Path: the copy (same file name, gzip-compressed when the original is).

    Raises:
        TraceFormatError: the file has no ``traceEvents`` array.
    """
    counters = [event for lanes, metrics in steps for event in counter_events(lanes, metrics)]
    with open_text(trace_path) as stream:
        text = stream.read()
    match = _EVENTS_START.search(text)
    if match is None:
        raise TraceFormatError(f'{trace_path}: no "traceEvents" array to add counters to')
    inserted = ",".join(json.dumps(event) for event in counters)
    rest = text[match.end() :]
    if inserted and rest.lstrip()[:1] != "]":
        inserted += ","
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / trace_path.name
    payload = text[: match.end()] + inserted + rest
    if out.name.endswith(".gz"):
        with gzip.open(out, "wt", encoding="utf-8") as f:
            f.write(payload)
    else:
        out.write_text(payload, encoding="utf-8")
    return out
