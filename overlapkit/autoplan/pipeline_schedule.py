"""The bubble and the activations in flight of each pipeline schedule, as torch schedules it.

A micro-batch's pass through one model chunk is a forward ``F``, an input-gradient step ``I``
and a weight-gradient step ``W`` (its backward ``B = I + W``). 1F1B and interleaved 1F1B run
``B`` whole: their bubble is ``(pp - 1)(F + B)`` per chunk (Narayanan et al., SC'21). The
zero-bubble schedules of ``torch.distributed.pipelining`` run ``I`` when the previous stage
waits for it and defer ``W`` to fill the bubble (Qi et al., ICLR'24). Their bubble is the
maximum of a few linear forms in ``F``, ``I`` and ``W`` (``SHAPES``), read off torch 2.13's own
action lists (``_calculate_single_rank_operations``) with every action taking its time and
waiting for the one it depends on (tests/test_pipeline_schedule_shapes.py replays the lists):

- ``InterleavedZeroBubble`` (ZB-1P, v chunks per rank): ``(pp - 1) max(F + I - W, F, I)`` per
  chunk, for every v and every micro-batch count from pp up; with ``W <= F, I`` that is ZB-H1's
  ``(pp - 1)(F + B - 2W)``. Fewer than pp micro-batches: torch pads the schedule with idle
  steps, another shape, not priced (``priced``).
- ``ZBVZeroBubble`` and ``DualPipeV`` (two chunks per rank in a V): the maxima below, for at
  least ``2 pp - 1`` and ``2 pp`` micro-batches (fewer leave the V's warm-up unfilled; not
  priced). DualPipeV's overlapped forward-and-backward runs one half after the other, as torch
  runs it.

Stage 0 never splits its backward (torch's ``backward_one_chunk`` skips the input step of the
first stage and runs the whole backward as its weight step); the shapes include it. Pipeline
traffic and other per-micro-batch costs stretch each pass alike (``bubble_s``).

Data-parallel traffic: the step's last gradients are complete as the last micro-batch's
backward ends, or under a split backward as its deferred weight steps do; the reduction that
starts from them hides behind that compute (``gradient_window_s``), ``W`` rather than ``B``.

Activations: a micro-batch's are held from its forward to its weight step (what ``W`` needs
of them replaces what ``I`` frees). The peak count on the busiest rank
(``in_flight_micro_batches``), in micro-batches through all of a rank's chunks: 1F1B
``min(pp, m)``; interleaved 1F1B ``min(pp + (pp - 1) / v, m)`` (Korthikanti et al., section
4.2.3: ``1 + (pp - 1) / (pp v)`` times 1F1B's, its warm-up capped at the step's micro-batches);
InterleavedZeroBubble ``pp`` with m a multiple of pp (``((v - 1) r + pp) / v`` for rounds of
``r`` micro-batches); ZBVZeroBubble ``pp``; DualPipeV ``pp + 1/2``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from overlapkit.layout import TrainingLayout
from overlapkit.layout.overlapkit_train import SCHEDULES
from overlapkit.layout.training_layout import INTERLEAVED_1F1B, ONE_F_ONE_B

INTERLEAVED_ZERO_BUBBLE = "InterleavedZeroBubble"
ZBV_ZERO_BUBBLE = "ZBVZeroBubble"
DUAL_PIPE_V = "DualPipeV"


@dataclass(frozen=True, slots=True)
class PassTimes:
    """One micro-batch's passes through a pipeline rank's chunks, seconds (all of them)."""

    forward_s: float
    input_s: float
    """The backward's input-gradient step (recomputation and everything without weights)."""
    weight_s: float
    """The backward's weight-gradient step (the GEMMs' weight gradients)."""


Shape = Callable[[int, float, float, float], float]
"""Bubble per chunk of ``(pp - 1, F, I, W)`` (one chunk's pass times)."""


def _one_f_one_b(q: int, f: float, i: float, w: float) -> float:
    return q * (f + i + w)


def _interleaved_zero_bubble(q: int, f: float, i: float, w: float) -> float:
    return q * max(f + i - w, f, i)


def _zbv(q: int, f: float, i: float, w: float) -> float:
    return max(
        i + (q - 1) * w,
        q * i,
        2 * q * (i - w),
        f + (q - 1) * w,
        (2 * q - 1) * f - (q - 1) * i,
        2 * q * f - q * i - w,
        (2 * q - 1) * f + i - 2 * q * w,
        2 * q * f - (2 * q + 1) * w,
    )


def _dual_pipe_v(q: int, f: float, i: float, w: float) -> float:
    return max(
        q * i - f,
        q * (2 * i - w) - f,
        q * f,
        q * (f + i - w),
        q * (2 * f - i - w),
        2 * q * (f - w),
    )


SHAPES: dict[str, Shape] = {
    ONE_F_ONE_B: _one_f_one_b,
    INTERLEAVED_1F1B: _one_f_one_b,
    INTERLEAVED_ZERO_BUBBLE: _interleaved_zero_bubble,
    ZBV_ZERO_BUBBLE: _zbv,
    DUAL_PIPE_V: _dual_pipe_v,
}
"""Each priced schedule's bubble per chunk (module doc)."""
ZERO_BUBBLE_SCHEDULES = (INTERLEAVED_ZERO_BUBBLE, ZBV_ZERO_BUBBLE, DUAL_PIPE_V)
"""torch's schedules that split the backward (``Framework.zero_bubble_schedules`` runs them)."""


def schedule_of(layout: TrainingLayout) -> str:
    """The schedule ``layout`` runs (``TrainingLayout.pipeline_schedule``; 1F1B's shape, with
    no bubble, without a pipeline)."""
    return layout.pipeline_schedule or ONE_F_ONE_B


def rounds(layout: TrainingLayout) -> int:
    """Rounds torch's interleaved schedules run a step's micro-batches in: ``max(1, m // pp)``."""
    return max(1, layout.num_micro_batches // layout.pp)


def priced(schedule: str, layout: TrainingLayout) -> bool:
    """Whether ``SHAPES`` prices ``schedule`` for ``layout``'s chunks and micro-batches (where
    its shape is torch's): 1F1B with one chunk; interleaved 1F1B with several and the
    micro-batches a multiple of pp; InterleavedZeroBubble with several, at least pp micro-batches
    and a multiple of its rounds; ZBVZeroBubble at two chunks and ``2 pp - 1`` micro-batches or
    more (fewer leave torch's warm-up unfilled), DualPipeV at two chunks and ``2 pp``."""
    if schedule not in SHAPES:
        return False
    v, pp, m = layout.virtual_stages, layout.pp, layout.num_micro_batches
    if schedule == ZBV_ZERO_BUBBLE:
        return v == 2 and m >= 2 * pp - 1
    if schedule == DUAL_PIPE_V:
        return v == 2 and m >= 2 * pp
    if schedule == ONE_F_ONE_B:
        return v == 1
    if schedule == INTERLEAVED_ZERO_BUBBLE:
        return v > 1 and m >= pp and m % rounds(layout) == 0
    return v > 1 and m % pp == 0


def bubble_s(layout: TrainingLayout, passes: PassTimes, stretch: float = 1.0) -> float:
    """Seconds the busiest rank idles in one step of ``layout``'s schedule.

    Args:
        layout (TrainingLayout): pp, its chunks per rank and its schedule (``schedule_of``).
        passes (PassTimes): one micro-batch through the rank's chunks (its ``virtual_stages``
            chunks together; each chunk takes ``1 / v`` of each).
        stretch (float): >= 1, how much a micro-batch's exposed traffic lengthens each pass
            (its time over its compute).

    Returns:
        float: >= 0; 0 without a pipeline.
    """
    if layout.pp == 1:
        return 0.0
    shape = SHAPES[schedule_of(layout)]
    v = layout.virtual_stages
    per_chunk = shape(layout.pp - 1, passes.forward_s / v, passes.input_s / v, passes.weight_s / v)
    return max(0.0, per_chunk) * stretch


def gradient_window_s(layout: TrainingLayout, passes: PassTimes) -> float:
    """The compute a step's last gradient reduction can start in, seconds: the last
    micro-batch's backward (``I + W``), or under a split backward its weight steps (``W``),
    which finish the gradients and which the reduction starts from (module doc)."""
    if schedule_of(layout) in ZERO_BUBBLE_SCHEDULES:
        return passes.weight_s
    return passes.input_s + passes.weight_s


def in_flight_micro_batches(layout: TrainingLayout) -> float:
    """Micro-batches whose activations the busiest pipeline rank holds at once (module doc),
    counted through all of its chunks."""
    schedule, pp, v = schedule_of(layout), layout.pp, layout.virtual_stages
    if schedule == INTERLEAVED_1F1B:
        return min(pp + (pp - 1) / v, layout.num_micro_batches)
    if schedule == INTERLEAVED_ZERO_BUBBLE:  # its warm-up: a round on each earlier chunk
        per_round = layout.num_micro_batches / rounds(layout)
        return ((v - 1) * per_round + pp) / v
    if schedule == DUAL_PIPE_V:
        return pp + 0.5
    return float(min(pp, layout.num_micro_batches))


def schedule_variants(layout: TrainingLayout) -> list[TrainingLayout]:
    """``layout`` on each other schedule the search proposes: ``planned`` in
    ``overlapkit.layout.overlapkit_train.SCHEDULES``, beyond 1F1B and interleaved 1F1B (the
    layout's own), where ``SHAPES`` prices it (``priced``). Empty without a pipeline or with a
    schedule already chosen."""
    if layout.pp == 1 or layout.schedule is not None:
        return []
    return [
        dataclasses.replace(layout, schedule=schedule.name)
        for schedule in SCHEDULES
        if schedule.planned
        and schedule.name in ZERO_BUBBLE_SCHEDULES
        and priced(schedule.name, layout)
    ]
