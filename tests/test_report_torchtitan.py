"""``overlapkit report`` reads a torchtitan run: real torch.profiler traces of 2 gloo ranks,
written where and as torchtitan's profiler writes them
(``<dump>/profiling/traces/iteration_N/rankR_trace.json.gz``, ``tools/profiler.py``'s
``trace_handler``: ``export_chrome_trace`` at each cycle's end)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from overlapkit import cli
from overlapkit.profiling.analysis import TORCHTITAN_TRACES
from tests.multiproc import run_on_ranks

PROFILE_ITER_DIR = "iteration_{step}"
PROFILE_FILE = "rank{rank}_trace.json.gz"
ITERATIONS = (3, 6)  # wait 1, warmup 1, active 1, two cycles: traces at steps 3 and 6


def _torchtitan_profiled_run(rank: int, world_size: int, dump: str) -> None:
    """A matmul and an all-reduce per step, profiled as torchtitan's Profiler does."""
    import torch
    import torch.distributed as dist

    trace_dir = os.path.join(dump, TORCHTITAN_TRACES)

    def trace_handler(prof):
        step_dir = os.path.join(trace_dir, PROFILE_ITER_DIR.format(step=prof.step_num))
        os.makedirs(step_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(step_dir, PROFILE_FILE.format(rank=rank)))

    x = torch.randn(256, 256)
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=1, repeat=2)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=schedule,
        on_trace_ready=trace_handler,
    ) as prof:
        for _ in range(max(ITERATIONS)):
            y = x @ x
            dist.all_reduce(y)
            prof.step()


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan_dump")
    run_on_ranks(_torchtitan_profiled_run, 2, str(root))
    return root


def _report(argv, capsys):
    code = cli.main(["report", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_report_reads_every_iteration_of_a_torchtitan_dump_folder(dump, capsys):
    code, out, _ = _report([str(dump), "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    files = sorted(os.path.relpath(f, dump) for f in report["files"])
    assert files == [
        f"{TORCHTITAN_TRACES}/iteration_{n}/rank{r}_trace.json.gz"
        for n in ITERATIONS
        for r in (0, 1)
    ]
    assert {(s["rank"], s["step"]) for s in report["steps"]} >= {(0, 2), (1, 2), (0, 5), (1, 5)}
    assert all(s["comm_ms"] > 0 for s in report["steps"])  # the all-reduce is found
    # The traces folder itself, and one iteration folder, are read too.
    code, out, _ = _report([str(dump / TORCHTITAN_TRACES), "--json"], capsys)
    assert code == 0 and len(json.loads(out)["files"]) == 4
    code, out, _ = _report([str(dump / TORCHTITAN_TRACES / "iteration_6"), "--json"], capsys)
    assert code == 0 and len(json.loads(out)["files"]) == 2


@pytest.mark.slow
def test_iteration_picks_one_and_a_missing_one_is_named(dump, capsys):
    code, out, _ = _report([str(dump), "--iteration", "3", "--json"], capsys)
    assert code == 0
    assert all("/iteration_3/" in f for f in json.loads(out)["files"])
    assert {s["step"] for s in json.loads(out)["steps"]} == {2}
    code, _, err = _report([str(dump), "--iteration", "9"], capsys)
    assert code == 2 and "no readable profiler trace" in err and "iteration_9 of" in err


@pytest.mark.slow
def test_the_no_traces_hint_names_the_subfolders_torchtitan_wrote(dump, capsys):
    code, _, err = _report([str(dump / "profiling")], capsys)
    assert code == 2
    assert "Subdirectories with traces: traces/iteration_3, traces/iteration_6." in err


@pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed"
)
def test_the_layout_is_torchtitans_own():
    from torchtitan.tools import profiler

    assert profiler.PROFILE_DIR == TORCHTITAN_TRACES
    assert (profiler.PROFILE_ITER_DIR, profiler.PROFILE_FILE) == (PROFILE_ITER_DIR, PROFILE_FILE)
