"""A real 4-rank gloo run of ``overlapkit-train`` with rank 2 slowed by the test fault hook:
``overlapkit report --stragglers`` names rank 2, the collective it delays and the cause.

The run is the ddp job of tests/test_train_parallel_nd.py's 4-rank sweep (``four_rank_sweep``:
8 steps of 2 micro-batches, full recomputation, profiled steps 3-5), whose rank 2 sleeps 150 ms
in the forward of every step (``OVERLAPKIT_TEST_SLOW=2:150`` in that job only); one launch for
both files' checks. Four ranks share the machine's two cores, so steps jitter by tens of
milliseconds; the sleep is chosen as a multiple of that (``JITTER_MULTIPLE``, checked on the run
itself: the spread of the other ranks' arrivals at the collective rank 2 delays).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from overlapkit.profiling import cli
from overlapkit.profiling.analysis import analyze_run
from overlapkit.profiling.stragglers import find_stragglers
from overlapkit.profiling.tensorboard import WAIT_TAGS
from tests.test_train_parallel_nd import SLOW_MS, SLOW_RANK, SLOWED
from tests.torch_version import requires_torch

pytestmark = pytest.mark.slow

JITTER_MULTIPLE = 3.0
PROFILED_STEPS = {3, 4, 5}
DOUBLE_COUNT_BOUND = 1.5
"""Per step, what is found of the sleep is at most this many sleeps: counted twice it would be
2; the rank's own noise on top of one sleep is under half of it (the other ranks' arrival
spread is under a third, ``JITTER_MULTIPLE``)."""


@pytest.fixture(scope="module")
def slowed_run(four_rank_sweep):
    """The profile directory of the sweep's job with rank 2 sleeping in every forward."""
    runs, output = four_rank_sweep
    slowed = f"rank {SLOW_RANK} spends {SLOW_MS:.1f} ms more (sleep) per step"
    assert output.count(slowed) == 1, output[-3000:]  # in that job only
    [profile] = (runs[SLOWED] / "tb").glob("*/profile")
    return profile


@pytest.fixture(scope="module")
def found(slowed_run):
    return find_stragglers(analyze_run(slowed_run, jobs=1, programs=True).programs)


@pytest.mark.timeout(900)  # the first test to use four_rank_sweep runs it
def test_the_slowed_rank_is_named_with_its_cause_and_collective_in_every_profiled_step(found):
    top = found.stragglers[0]
    assert (top.rank, top.cause) == (SLOW_RANK, "host_gap"), found.stragglers[:5]
    mine = [s for s in found.stragglers if s.rank == SLOW_RANK and s.cause == "host_gap"]
    # The sleep comes before the step's forward: the rank is late for the step's first bucket.
    assert {s.step for s in mine if s.collective == "all_reduce #0"} == PROFILED_STEPS, mine
    assert found.per_rank()[0]["rank"] == SLOW_RANK
    # It idled about the sleep longer than the others (give or take their own idle time and
    # the OS's: four ranks share two cores), and the others waited for most of that.
    for s in mine:
        assert s.excess_ms >= 0.5 * SLOW_MS and s.cost_ms >= 0.5 * SLOW_MS, s


def test_the_sleep_is_found_once_per_step_and_costs_at_most_itself(found):
    # Upper bounds, which a double count (the sleep in two segments of a step, or in both halves
    # of one, or one excess removed twice) would fail and the lower bounds above would not.
    mine = [s for s in found.stragglers if s.rank == SLOW_RANK]
    for step in PROFILED_STEPS:
        here = [s for s in mine if s.step == step]
        assert sum(s.excess_ms for s in here) <= DOUBLE_COUNT_BOUND * SLOW_MS, here
        # Without the delay the run ends sooner by at most the delay; the others waited at most
        # as long as rank 2 was late, each.
        assert sum(s.cost_ms for s in here) <= DOUBLE_COUNT_BOUND * SLOW_MS, here
        for s in here:
            assert s.late_ms <= DOUBLE_COUNT_BOUND * SLOW_MS, s
            assert s.others_waited_ms <= 3 * DOUBLE_COUNT_BOUND * SLOW_MS, s


def test_the_sleep_is_a_multiple_of_the_step_jitter_of_the_other_ranks(found):
    m = found.matching
    start = m.aligned("start")
    first = [
        rows
        for rows, c in zip(m.members, found.collectives, strict=True)
        if c["collective"] == "all_reduce #0"
    ]
    spread = [np.ptp(start[rows][m.row_rank[rows] != SLOW_RANK]) / 1e3 for rows in first]
    jitter = float(np.median(spread))
    print(
        f"other ranks' arrival spread at all_reduce #0: {spread} ms; sleep {SLOW_MS} ms = "
        f"{SLOW_MS / jitter:.1f} x the median"
    )
    assert jitter * JITTER_MULTIPLE <= SLOW_MS


@requires_torch("2.12", "traces that name their host_name; before, each rank is a host")
def test_one_host_means_one_clock_and_the_what_if_blames_the_slowed_rank(found):
    assert set(found.matching.offsets_us.values()) == {0.0}
    w = found.what_if
    assert w.slowdown > 1.0 and w.worst_ranks == [SLOW_RANK]
    assert w.per_rank[SLOW_RANK] == max(w.per_rank.values())
    assert w.replay_error_us < 1.0


def _report(argv, capsys):
    parser = argparse.ArgumentParser(prog="overlapkit")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_the_report_command_prints_names_draws_and_writes_the_waits(slowed_run, tmp_path, capsys):
    heatmap, logdir = tmp_path / "wait.png", tmp_path / "tb"
    payload = json.loads(
        _report(
            [
                "report",
                str(slowed_run),
                "--stragglers",
                "--json",
                "--jobs",
                "1",
                "--heatmap",
                str(heatmap),
                f"--tensorboard={logdir}",
            ],
            capsys,
        )
    )
    first = payload["stragglers"][0]
    assert {"rank", "collective", "cause", "cost_ms"} <= set(first)
    assert (first["rank"], first["cause"], first["collective"]) == (
        SLOW_RANK,
        "host_gap",
        "all_reduce #0",
    )
    costs = [s["cost_ms"] for s in payload["stragglers"]]
    assert costs == sorted(costs, reverse=True)
    assert {"steps", "files", "skipped"} <= set(payload) and payload["skipped"] == []
    assert heatmap.stat().st_size > 5_000
    acc = EventAccumulator(str(logdir / "overlap" / f"rank{SLOW_RANK}"))
    acc.Reload()
    assert set(WAIT_TAGS) <= set(acc.Tags()["scalars"])
    others = EventAccumulator(str(logdir / "overlap" / "rank0"))
    others.Reload()
    # Rank 0 waits for rank 2 at the first bucket of every profiled step; rank 2 waits least.
    waited = {e.step: e.value for e in others.Scalars(WAIT_TAGS[0])}
    slowed = {e.step: e.value for e in acc.Scalars(WAIT_TAGS[0])}
    assert all(waited[s] > slowed[s] for s in waited)
    text = _report(
        ["report", str(slowed_run), "--stragglers", "--jobs", "1", "--step-rows", "0"], capsys
    )
    line = next(line for line in text.splitlines() if line.strip().startswith(f"{SLOW_RANK} "))
    assert "all_reduce #0" in line and "host_gap" in line
