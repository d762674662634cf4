"""The measuring glue of auto-tuning: trials over steps, shared across ranks, then settle.

A ``Tuner`` is told when a training step ends (``step_ended``) by a small adapter (a forward
pre-hook for DDP and FSDP, the end of ``GradBucketer.wait()``). It runs the trial order of
``overlapkit.tuning.decide`` with ``apply(value)`` switching the knob between steps:

- each trial discards its first ``discard_steps`` steps (a new layout's warm-up; DDP's first two
  steps after a new reducer) and measures the next ``measure_steps``; the first trial also
  discards ``WARMUP_STEPS`` more, because a process's first steps run slower (allocator, caches,
  fresh connections) and would penalise the first candidates of the ladder;
- at the end of a trial, the measurements of all ranks are combined with one all-reduce (MAX:
  per step, the slowest rank decides the step time), so every rank holds identical numbers and
  makes the same next move without further talk;
- when the search is over, the decision is computed the same way and, as a guard, rank 0's
  choice is broadcast (one scalar). Every rank switches to it at the same step boundary, the
  choice is logged on rank 0, and the adapter's ``detach()`` removes its hooks: a settled tuner
  costs nothing (no hook, timer or collective left).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from overlapkit.tuning.decide import decide, next_trial
from overlapkit.tuning.report import Trial, TuningReport

logger = logging.getLogger(__name__)

WARMUP_STEPS = 2

# Given the tags of a trial's measured steps: per-step exposed tail (ms) or None, and the
# trial's peak bytes or None.
Extras = Callable[[list[int]], tuple[list[float] | None, int | None]]


class Tuner:
    """Runs the trial search for one knob of one wrapped object.

    Args:
        knob (str): ``"bucket_mb"`` or ``"prefetch"``.
        candidates (Sequence): values to try, in ladder order.
        apply (Callable): switches the knob to a value; called between steps on every rank.
        detach (Callable): removes the adapter's hooks once settled.
        group (ProcessGroup): the ranks that must agree (the wrapper's group).
        device (torch.device): where the all-reduce buffer lives (CUDA for NCCL).
        extras (Extras | None): per-trial exposed tails and peak bytes, from the step tags.
        max_bytes (int | None): trials whose peak bytes exceed this are never chosen.
        first_step (int): the optimizer step that the first ``step_ended`` call precedes.
        discard_steps (int): steps at the start of each trial that are not measured.
        measure_steps (int): measured steps per trial.
        caller (str): for log lines (``"ok.ddp"``).
    """

    def __init__(
        self,
        *,
        knob: str,
        candidates: Sequence[float | int],
        apply: Callable[[float | int], None],
        detach: Callable[[], None],
        group: dist.ProcessGroup,
        device: torch.device,
        extras: Extras | None = None,
        max_bytes: int | None = None,
        first_step: int = 0,
        discard_steps: int = 1,
        measure_steps: int = 3,
        caller: str,
    ):
        if not candidates:
            raise ValueError(f"{caller}: no candidates to tune {knob} over")
        self.knob = knob
        self.candidates = list(candidates)
        self.current = self.candidates[0]
        self._apply = apply
        self._detach = detach
        self._group = group
        self._device = device
        self._extras = extras
        self._max_bytes = max_bytes
        self._discard = discard_steps
        self._discard_now = discard_steps + WARMUP_STEPS
        self._measure = measure_steps
        self._caller = caller
        self._report = TuningReport(knob=knob)
        self._boundaries = 0
        self._first_step = first_step
        self._trial_steps = 0
        self._samples: list[float] = []
        self._tags: list[int] = []
        self._last_ms: float | None = None
        self.settled = False
        self._apply(self.current)

    def report(self) -> TuningReport:
        current = self._report
        return TuningReport(
            knob=current.knob,
            trials=[replace(t) for t in current.trials],
            chosen=current.chosen,
            settled=current.settled,
            settled_at_step=current.settled_at_step,
            reason=current.reason,
        )

    def step_ended(self, tag: int) -> None:
        """A step ended (or, on the first call, is about to start); ``tag`` names the step that
        ended in the adapter's own records (for ``extras``)."""
        now = time.perf_counter() * 1e3
        if self._last_ms is not None:
            if self._trial_steps >= self._discard_now:
                self._samples.append(now - self._last_ms)
                self._tags.append(tag)
            self._trial_steps += 1
            if self._trial_steps == self._discard_now + self._measure:
                self._discard_now = self._discard
                self._end_trial()
        self._boundaries += 1
        # Taken after any collective or switch above, so those never count as step time.
        self._last_ms = None if self.settled else time.perf_counter() * 1e3

    def _usable(self) -> list[Trial]:
        limit = self._max_bytes
        return [
            t
            for t in self._report.trials
            if limit is None or t.peak_bytes is None or t.peak_bytes <= limit
        ]

    def _end_trial(self) -> None:
        exposed, peak = self._extras(self._tags) if self._extras else (None, None)
        measured = self._measure
        values = list(self._samples) + (exposed or [0.0] * measured) + [float(peak or 0)]
        combined = torch.tensor(values, dtype=torch.float64, device=self._device)
        dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=self._group)
        combined = combined.tolist()
        trial = Trial(
            value=self.current,
            step_ms=round(statistics.median(combined[:measured]), 3),
            exposed_ms=None
            if exposed is None
            else round(statistics.median(combined[measured:-1]), 3),
            peak_bytes=None if peak is None else int(combined[-1]),
        )
        self._report.trials.append(trial)
        self._samples, self._tags, self._trial_steps = [], [], 0
        usable = self._usable()
        over_bound = {t.value for t in self._report.trials} - {t.value for t in usable}
        candidates = [c for c in self.candidates if c not in over_bound]
        following = next_trial(candidates, usable) if candidates else None
        if following is None:
            self._settle(usable)
        else:
            self._switch(following)

    def _switch(self, value: float | int) -> None:
        if value != self.current:
            self._apply(value)
            self.current = value

    def _settle(self, usable: list[Trial]) -> None:
        unit = " MiB" if self.knob == "bucket_mb" else ""
        if usable:
            chosen, reason = decide(usable, unit=unit)
        else:
            # Every candidate broke the memory bound as measured: fall back to the smallest.
            chosen, reason = min(self.candidates), "every trial exceeded max_memory"
        # The inputs were identical on every rank; rank 0's answer is sent anyway as a guard.
        value = torch.tensor([float(chosen)], dtype=torch.float64, device=self._device)
        dist.broadcast(value, src=dist.get_global_rank(self._group, 0), group=self._group)
        chosen = type(chosen)(value.item())
        self._switch(chosen)
        self.settled = True
        report = self._report
        report.chosen = chosen
        report.settled = True
        report.settled_at_step = self._first_step + self._boundaries
        report.reason = reason
        self._detach()
        if dist.get_rank() == 0:
            logger.info(
                "%s: auto-tuned %s=%g%s from %d trials (%s); in use from step %d",
                self._caller,
                self.knob,
                chosen,
                unit,
                len(report.trials),
                reason,
                report.settled_at_step,
            )
