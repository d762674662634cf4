"""A real 4-rank gloo run of ``overlapkit-train`` with rank 2 slowed by the test fault hook:
``overlapkit report --stragglers`` names rank 2, the collective it delays and the cause.

One run (``OVERLAPKIT_TEST_SLOW=2:150``: rank 2 sleeps 150 ms in the forward of every step)
shared by every check here. Four ranks share the machine's two cores, so steps jitter by tens of
milliseconds; the sleep is chosen as a multiple of that (``JITTER_MULTIPLE``, checked on the
run itself: the spread of the other ranks' arrivals at the collective rank 2 delays).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bench.harness.slow_rank import SLOW_ENV
from overlapkit.profiling import cli
from overlapkit.profiling.analysis import analyze_run
from overlapkit.profiling.stragglers import find_stragglers
from overlapkit.profiling.tensorboard import WAIT_TAGS
from tests.faults import WORKER_INIT
from tests.test_train_e2e import _finish, _start
from tests.torch_version import requires_torch

pytestmark = pytest.mark.slow

SLOW_RANK, SLOW_MS = 2, 150.0
JITTER_MULTIPLE = 3.0


@pytest.fixture(scope="module")
def slowed_run(tmp_path_factory):
    """The profile directory of a 4-rank demo run with rank 2 sleeping in every forward."""
    root = tmp_path_factory.mktemp("slowed")
    output = _finish(
        _start(
            [
                "profiler=on",
                "launcher.nproc_per_node=4",
                "train.steps=6",
                "train.checkpoint_every=0",
                f"hydra.run.dir={root / 'run'}",
                f"launcher.worker_init=[{WORKER_INIT}]",
            ],
            root,
            env={SLOW_ENV: f"{SLOW_RANK}:{SLOW_MS:g}"},
        ),
        timeout_s=400,
    )
    assert f"rank {SLOW_RANK} spends {SLOW_MS:.1f} ms more (sleep) per step" in output
    [profile] = (root / "run" / "tb").glob("*/profile")
    return profile


@pytest.fixture(scope="module")
def found(slowed_run):
    return find_stragglers(analyze_run(slowed_run, jobs=1, programs=True).programs)


def test_the_slowed_rank_is_named_with_its_cause_and_collective_in_every_profiled_step(found):
    top = found.stragglers[0]
    assert (top.rank, top.cause) == (SLOW_RANK, "host_gap"), found.stragglers[:5]
    mine = [s for s in found.stragglers if s.rank == SLOW_RANK and s.cause == "host_gap"]
    # The sleep comes before the step's forward: the rank is late for the step's first bucket.
    assert {s.step for s in mine if s.collective == "all_reduce #0"} == {3, 4, 5}, mine
    assert found.per_rank()[0]["rank"] == SLOW_RANK
    # It idled about the sleep longer than the others (give or take their own idle time and
    # the OS's: four ranks share two cores), and the others waited for most of that.
    for s in mine:
        assert s.excess_ms >= 0.5 * SLOW_MS and s.cost_ms >= 0.5 * SLOW_MS, s


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
