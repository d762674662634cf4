"""Analysing trace files on several cores: one worker process per core, one file per task.

Files are independent until the cross-rank step, so they are read in parallel: a
``ProcessPoolExecutor`` whose workers are *spawned* and import only the trace analysis (numpy
and msgspec; ``overlapkit.profiling`` loads torch only for ``ok.profile``), about 0.2 s each.
The forkserver of ``overlapkit.workers`` would fork from a server that imports torch and the
training entry points, several seconds of CPU that a report does not need. Each worker returns
its file's compact result (per step numbers, per collective records), never the events.

Small inputs stay in the calling process: below ``PARALLEL_MIN_BYTES`` of trace in all, starting
workers costs more than it saves.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

PARALLEL_MIN_BYTES = 32 << 20


def default_jobs() -> int:
    """The cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` where
    that does not exist)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def check_jobs(jobs: Any) -> int:
    """``jobs`` as a worker count: None means ``default_jobs()``.

    Raises:
        ValueError: not an int >= 1 (names ``--jobs``).
    """
    if jobs is None:
        return default_jobs()
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs must be a whole number of worker processes >= 1, got {jobs!r}")
    return jobs


def map_files(
    fn: Callable[..., T],
    files: Sequence[Path],
    *,
    jobs: int | None = None,
    min_bytes: int = PARALLEL_MIN_BYTES,
    **kwargs: Any,
) -> Iterator[T]:
    """``fn(path, **kwargs)`` for each file, in order, on up to ``jobs`` worker processes.

    ``fn`` must be a module-level function (workers import it by name). With one job, one
    file, or less than ``min_bytes`` of files in all, everything runs in this process.
    """
    jobs = min(check_jobs(jobs), len(files))
    total = 0
    for path in files:
        with contextlib.suppress(OSError):  # a missing file is the worker's to report
            total += path.stat().st_size
    if jobs <= 1 or total < min_bytes:
        for path in files:
            yield fn(path, **kwargs)
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = [pool.submit(fn, path, **kwargs) for path in files]
        for future in futures:
            yield future.result()
