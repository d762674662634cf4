"""``ok.profile``: torch.profiler with a schedule, per-rank traces, and the overlap analysis.

::

    with ok.profile("runs/x", wait=1, warmup=1, active=3) as prof:
        for batch in data:
            train_step(batch)
            prof.step()
    prof.summary()          # this rank's per-step compute / comm / exposed comm (ms)

Traces go to ``logdir`` through ``torch.profiler.tensorboard_trace_handler`` with worker name
``rank{R}``, one file per profiling cycle (``repeat`` cycles give ``repeat`` files, none
overwritten), where torch-tb-profiler finds them. On exit, each rank analyses its own traces and
writes the ``overlap/*`` TensorBoard scalars (``logdir/overlap/rank{R}``) and a copy of each trace
with counter tracks (``logdir/overlap_trace/``). ``overlapkit report logdir`` then reads all ranks.

Once the schedule's last cycle is saved the profiler is stopped, and ``step()`` does nothing but
count, so a long run pays for profiling only during the profiled cycles.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, tensorboard_trace_handler

from overlapkit.profiling.analysis import RunReport, StepMetrics, analyze_files
from overlapkit.profiling.counters import COUNTER_DIR, write_counter_copy
from overlapkit.profiling.tensorboard import write_scalars
from overlapkit.validation import check_int

logger = logging.getLogger(__name__)


class Profile:
    """Context manager returned by ``ok.profile``; see the module docstring.

    Args:
        logdir (str | Path): directory for the traces (created if missing); the TensorBoard
            ``--logdir``.
        wait (int): steps skipped at the start of each cycle. Defaults to 1.
        warmup (int): steps traced but discarded (profiler start-up cost). Defaults to 1.
        active (int): steps recorded per cycle. Defaults to 3.
        repeat (int): number of cycles; 0 repeats until the context exits. Defaults to 1.
        record_shapes (bool): record input shapes (gives collective sizes on gloo). Defaults
            to False.
        use_gzip (bool): write ``.pt.trace.json.gz``. Defaults to False.
        rank (int | None): rank for the file names; None reads it from torch.distributed
            (0 when it is not initialised).
        write_outputs (bool): write the TensorBoard scalars and counter copies on exit.
            Defaults to True.

    Raises:
        TypeError / ValueError: a schedule count is not an int, or is out of range
            (``active >= 1``, the others ``>= 0``).
    """

    def __init__(
        self,
        logdir: str | Path,
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        record_shapes: bool = False,
        use_gzip: bool = False,
        rank: int | None = None,
        write_outputs: bool = True,
    ):
        if not isinstance(logdir, (str, Path)) or not str(logdir):
            raise TypeError(f"ok.profile: logdir must be a non-empty path, got {logdir!r}")
        self.logdir = Path(logdir)
        self.wait = check_int("ok.profile: wait", wait, 0, unit="steps")
        self.warmup = check_int("ok.profile: warmup", warmup, 0, unit="steps")
        self.active = check_int("ok.profile: active", active, 1, unit="steps")
        self.repeat = check_int("ok.profile: repeat", repeat, 0, unit="steps")
        self.record_shapes = bool(record_shapes)
        self.use_gzip = bool(use_gzip)
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = check_int("ok.profile: rank", rank, 0, unit="steps")
        self.write_outputs = write_outputs
        self.step_num = 0
        self.files: list[Path] = []
        self._prof: torch.profiler.profile | None = None
        self._report: RunReport | None = None
        cycle = self.wait + self.warmup + self.active
        self._last_step = cycle * self.repeat if self.repeat else None

    def __enter__(self) -> Profile:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._handler = tensorboard_trace_handler(
            str(self.logdir), worker_name=f"rank{self.rank}", use_gzip=self.use_gzip
        )
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat
            ),
            on_trace_ready=self._save,
            record_shapes=self.record_shapes,
        )
        self._prof.__enter__()
        return self

    def _own_files(self) -> set[Path]:
        return set(self.logdir.glob(f"rank{self.rank}.*.pt.trace.json*"))

    def _save(self, prof: torch.profiler.profile) -> None:
        before = self._own_files()
        self._handler(prof)
        new = sorted(self._own_files() - before)
        self.files.extend(new)
        self._report = None
        logger.info("ok.profile: rank %d wrote %s", self.rank, ", ".join(map(str, new)))

    def step(self) -> None:
        """Mark the end of one training step (call once per iteration)."""
        self.step_num += 1
        if self._prof is None:
            return
        self._prof.step()
        if self._last_step is not None and self.step_num >= self._last_step:
            # Every cycle is saved; stop now so later steps cost nothing.
            self._stop(None, None, None)

    def _stop(self, exc_type, exc, tb) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.__exit__(exc_type, exc, tb)

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop(exc_type, exc, tb)
        if exc_type is not None:
            return  # the loop's error is what matters; skip the analysis
        if not self.files:
            logger.warning(
                "ok.profile: rank %d recorded no trace: %d steps ran, the schedule needs "
                "wait + warmup + active = %d; call prof.step() once per iteration",
                self.rank,
                self.step_num,
                self.wait + self.warmup + self.active,
            )
        elif self.write_outputs:
            self._write_outputs()

    def _write_outputs(self) -> None:
        """TensorBoard scalars and a counter-track copy of each of this rank's traces."""
        report = self.report()
        write_scalars(self.logdir, report.steps)
        metrics = {(m.file, m.step): m for m in report.steps}
        by_file: dict[str, list] = {}
        for lanes in report.lanes:
            by_file.setdefault(lanes.file, []).append((lanes, metrics[(lanes.file, lanes.step)]))
        for path in self.files:
            if path.name in by_file:
                write_counter_copy(path, by_file[path.name], self.logdir / COUNTER_DIR)

    def report(self) -> RunReport:
        """This rank's analysis of the traces saved so far (cached until the next save).

        Raises:
            RuntimeError: no trace has been saved yet.
        """
        if not self.files:
            raise RuntimeError(
                f"ok.profile: rank {self.rank} has no trace yet: after {self.step_num} steps; "
                f"the first is saved after wait + warmup + active = "
                f"{self.wait + self.warmup + self.active} calls of prof.step()"
            )
        if self._report is None:
            self._report = analyze_files(self.files, self.logdir, jobs=1, lanes=True)
        return self._report

    def summary(self) -> list[StepMetrics]:
        """Per step compute, comm, exposed comm, tail (ms) and overlap ratio, for this rank."""
        return self.report().steps


def profile(
    logdir: str | Path,
    wait: int = 1,
    warmup: int = 1,
    active: int = 3,
    repeat: int = 1,
    record_shapes: bool = False,
    **kwargs: Any,
) -> Profile:
    """Profile a training loop and measure its exposed communication per step.

    Args:
        logdir (str | Path): trace and TensorBoard directory.
        wait (int): steps skipped per cycle. Defaults to 1.
        warmup (int): steps traced and discarded per cycle. Defaults to 1.
        active (int): steps recorded per cycle. Defaults to 3.
        repeat (int): cycles (0: until exit). Defaults to 1.
        record_shapes (bool): record input shapes (collective sizes on gloo). Defaults to False.
        **kwargs: ``use_gzip``, ``rank``, ``write_outputs`` (see ``Profile``).

    Returns:
        Profile: use it in a ``with`` block; call ``.step()`` per iteration, ``.summary()`` after.

    Example::
        >>> with ok.profile("runs/x", wait=1, warmup=1, active=3) as prof:
        ...     for batch in data:
        ...         train_step(batch)
        ...         prof.step()
        >>> prof.summary()[0].exposed_comm_ms
    """
    return Profile(
        logdir,
        wait=wait,
        warmup=warmup,
        active=active,
        repeat=repeat,
        record_shapes=record_shapes,
        **kwargs,
    )
