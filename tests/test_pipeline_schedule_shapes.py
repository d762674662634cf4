"""The planner's pipeline shapes (``autoplan.pipeline_schedule``) against torch's own schedules.

torch 2.13's schedule classes write each rank's action list; ``replay`` runs those lists with
every forward taking F, every input-gradient step I, every weight-gradient step W (a full
backward I + W; stage 0's input step nothing and its weight step the whole backward, as
``PipelineStage.backward_one_chunk`` runs the first stage), each action starting when its rank
is free and what it waits for has finished (the previous stage's forward, the next stage's
input gradient). The busiest rank's idle time is the bubble the planner must predict, and the
activations held from a forward to its weight step the in-flight count.
"""

from __future__ import annotations

import itertools

import pytest
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from overlapkit.autoplan.pipeline_schedule import (
    PassTimes,
    bubble_s,
    in_flight_micro_batches,
    priced,
)
from overlapkit.layout import TrainingLayout

FORWARD, INPUT, WEIGHT = (
    _ComputationType.FORWARD,
    _ComputationType.BACKWARD_INPUT,
    _ComputationType.BACKWARD_WEIGHT,
)
FULL, OVERLAP = _ComputationType.FULL_BACKWARD, _ComputationType.OVERLAP_F_B
TIMES = [(1.0, i, w) for i, w in itertools.product((0.3, 1.0, 1.7, 2.6), (0.1, 0.6, 1.0, 2.2))]
"""(F, I, W) of one chunk: every ordering of the three, W far below and far above the others."""


def torch_actions(name: str, pp: int, micro_batches: int, chunks: int) -> dict[int, list]:
    """Each rank's actions as torch's schedule ``name`` writes them (no stages built: the list
    depends only on these counts)."""
    cls = torch_schedules.get_schedule_class(name)
    schedule = cls.__new__(cls)
    schedule.pp_group_size, schedule._n_microbatches = pp, micro_batches
    schedule.n_local_stages, schedule.num_stages = chunks, pp * chunks
    schedule._num_stages = pp * chunks
    if name == "1F1B":
        return _forwards_numbered(schedule._get_pipeline_order())
    schedule.number_of_rounds = max(1, micro_batches // pp)
    schedule.microbatches_per_round = micro_batches // schedule.number_of_rounds
    actions = {rank: schedule._calculate_single_rank_operations(rank) for rank in range(pp)}
    if name == "InterleavedZeroBubble":
        schedule.pipeline_order = actions
        actions = schedule._add_bubbles_to_actions(pp * chunks)
    return actions


def _forwards_numbered(actions: dict[int, list]) -> dict[int, list]:
    """``Schedule1F1B`` steps its own loop; the order it writes for display numbers the last
    rank's forwards from 1 (torch 2.13). Each rank's forwards numbered 0, 1, ... in order."""
    numbered = {}
    for rank, acts in actions.items():
        forwards = iter(range(len(acts)))
        numbered[rank] = [
            a._replace(microbatch_index=next(forwards))
            if a is not None and a.computation_type == FORWARD
            else a
            for a in acts
        ]
    return numbered


def _seconds(action: _Action, times: tuple[float, float, float]) -> float:
    forward, input_grad, weight = times
    kind, first = action.computation_type, action.stage_index == 0
    if kind == FORWARD:
        return forward
    if kind == INPUT:
        return 0.0 if first else input_grad
    if kind == WEIGHT:
        return input_grad + weight if first else weight
    return input_grad + weight if kind == FULL else 0.0  # REDUCE_GRAD and the like: no compute


def _waits_for(action: _Action, last_stage: int) -> tuple | None:
    """The event ``action`` starts after (None: nothing on another rank)."""
    stage, kind, micro_batch = action.stage_index, action.computation_type, action.microbatch_index
    if kind == FORWARD and stage > 0:
        return (stage - 1, "F", micro_batch)
    if kind in (INPUT, FULL):
        return (stage, "F", micro_batch) if stage == last_stage else (stage + 1, "I", micro_batch)
    return None


def replay(actions: dict[int, list], stages: int, times: tuple[float, float, float]):
    """(makespan, peak micro-batch chunks held on the busiest rank) of the action lists."""
    todo = {rank: [a for a in acts if a is not None] for rank, acts in actions.items()}
    done: dict[tuple, float] = {}
    free = dict.fromkeys(todo, 0.0)
    held, peak = dict.fromkeys(todo, 0), 0
    while any(todo.values()):
        moved = False
        for rank, queue in todo.items():
            while queue:
                action = queue[0]
                parts = action.sub_actions if action.computation_type == OVERLAP else (action,)
                waits = [_waits_for(part, stages - 1) for part in parts]
                if any(w is not None and w not in done for w in waits):
                    break
                for part, wait in zip(parts, waits, strict=True):
                    start = max(free[rank], done[wait] if wait else 0.0)
                    free[rank] = start + _seconds(part, times)
                    key = (part.stage_index, part.microbatch_index)
                    if part.computation_type == FORWARD:
                        done[(*key[:1], "F", key[1])] = free[rank]
                        held[rank] += 1
                    elif part.computation_type in (INPUT, FULL):
                        done[(*key[:1], "I", key[1])] = free[rank]
                    if part.computation_type in (WEIGHT, FULL):
                        held[rank] -= 1
                    peak = max(peak, held[rank])
                queue.pop(0)
                moved = True
        assert moved, "the schedule deadlocks"
    return max(free.values()), peak


CASES = (
    [("1F1B", pp, m, 1) for pp, m in ((2, 4), (4, 4), (4, 8), (8, 16))]
    + [
        (name, pp, m, v)
        for name in ("Interleaved1F1B", "InterleavedZeroBubble")
        for pp, m, v in ((2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 6, 4), (8, 16, 2))
    ]
    + [("InterleavedZeroBubble", pp, m, v) for pp, m, v in ((4, 6, 2), (3, 4, 3), (4, 10, 3))]
    + [
        (name, pp, m, 2)
        for name in ("ZBVZeroBubble", "DualPipeV")
        for pp, m in ((2, 4), (2, 5), (3, 6), (4, 8), (4, 12), (8, 16))
    ]
    + [("ZBVZeroBubble", pp, 2 * pp - 1, 2) for pp in (2, 4)]
)


@pytest.mark.parametrize(("name", "pp", "micro_batches", "chunks"), CASES)
def test_bubble_and_activations_as_torch_schedules_them(name, pp, micro_batches, chunks):
    layout = TrainingLayout(
        pp=pp,
        num_micro_batches=micro_batches,
        virtual_stages=chunks,
        schedule=None if name in ("1F1B", "Interleaved1F1B") else name,
    )
    assert priced(name, layout)
    actions = torch_actions(name, pp, micro_batches, chunks)
    for times in TIMES:
        makespan, peak = replay(actions, pp * chunks, times)
        measured = makespan - micro_batches * chunks * sum(times)
        passes = PassTimes(*(chunks * t for t in times))  # the rank's chunks together
        assert bubble_s(layout, passes) == pytest.approx(measured, abs=1e-9), times
    assert in_flight_micro_batches(layout) * chunks == pytest.approx(peak)


def test_zero_bubble_h1_and_the_stretch():
    """With W at most F and I, the interleaved zero-bubble shape is ZB-H1's (pp - 1)(F + B - 2W)
    per chunk, a third of 1F1B's at F = I = W; exposed traffic stretches it as it does 1F1B's."""
    layout = TrainingLayout(pp=4, num_micro_batches=8, virtual_stages=2)
    passes = PassTimes(2.0, 2.4, 1.6)
    zero_bubble = TrainingLayout(**{**_fields(layout), "schedule": "InterleavedZeroBubble"})
    f, i, w = 1.0, 1.2, 0.8  # per chunk
    assert bubble_s(zero_bubble, passes) == pytest.approx(3 * (f + (i + w) - 2 * w))
    assert bubble_s(layout, passes, stretch=1.5) == pytest.approx(1.5 * 3 * (f + i + w))
    assert not priced("ZBVZeroBubble", TrainingLayout(pp=4, num_micro_batches=6, virtual_stages=2))
    assert not priced(
        "InterleavedZeroBubble", TrainingLayout(pp=4, num_micro_batches=3, virtual_stages=2)
    )
    assert not priced("DualPipeV", TrainingLayout(pp=4, num_micro_batches=8, virtual_stages=3))


def _fields(layout: TrainingLayout) -> dict:
    return {name: getattr(layout, name) for name in layout.__dataclass_fields__}
