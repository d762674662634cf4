"""The test harness itself: results in rank order, child tracebacks surfaced, no hang."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.multiproc import RankFailure, run_on_ranks


def _all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, t.item()


def test_results_come_back_in_rank_order_over_a_real_gloo_group():
    assert run_on_ranks(_all_reduce_rank, 2) == [(0, 1.0), (1, 1.0)]


def _raise_in_rank_one(rank, world_size):
    if rank == 1:
        raise ZeroDivisionError("deliberate failure on rank 1")
    return rank


def test_a_child_exception_is_reported_with_its_traceback():
    with pytest.raises(RankFailure, match=r"rank 1 raised(.|\n)*deliberate failure on rank 1"):
        run_on_ranks(_raise_in_rank_one, 2)


def _rank_one_dies_mid_collective(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))  # never completes: its peer is gone


@pytest.mark.slow
def test_a_dead_rank_ends_the_run_within_the_collective_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_rank_one_dies_mid_collective, 2, collective_timeout_s=3)
    assert "rank 1 returned nothing: exit code 3" in str(failure.value)
    # Bounded by the harness (collective timeout + grace + spawn), far below the test timeout.
    assert time.monotonic() - start < 60


def _what_the_rank_sees(rank, world_size):
    return os.environ.get("OVERLAPKIT_TEST_MARK"), "HOME" in os.environ, os.getcwd(), os.getpid()


def test_ranks_see_the_callers_environment_and_directory_of_the_call_not_the_fork_servers(
    tmp_path, monkeypatch
):
    # The fork server (overlapkit.workers.forkserver) runs from the first call on, with this
    # process's environment of that moment; later changes must still reach the ranks.
    [(_, had_home, first_cwd, first_pid), _] = run_on_ranks(_what_the_rank_sees, 2)
    assert had_home and first_cwd == os.getcwd()
    monkeypatch.setenv("OVERLAPKIT_TEST_MARK", "set after the server started")
    monkeypatch.delenv("HOME")
    monkeypatch.chdir(tmp_path)
    for mark, has_home, cwd, pid in run_on_ranks(_what_the_rank_sees, 2):
        assert (mark, has_home, cwd) == ("set after the server started", False, str(tmp_path))
        assert pid not in (first_pid, os.getpid())
