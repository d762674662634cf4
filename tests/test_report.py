"""``overlapkit report``: table, JSON keys (docs/json-contracts.md), timeline PNG, counters."""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import subprocess
import sys

import matplotlib.image
import pytest

from bench.harness.synthetic_traces import TraceBuilder
from overlapkit import cli as overlapkit_cli
from overlapkit.profiling import cli
from overlapkit.profiling.analysis import analyze_run
from overlapkit.profiling.counters import write_counter_copy

STEP_KEYS = {"rank", "step", "compute_ms", "comm_ms", "exposed_comm_ms", "tail_ms", "overlap_ratio"}


def _write_run(run_dir, ranks=2):
    """Two ranks, steps 4 and 5; rank 1 communicates longer in step 5 (it waits for rank 0)."""
    run_dir.mkdir(exist_ok=True)
    for rank in range(ranks):
        t = TraceBuilder(rank=rank, backend="gloo")
        for i, n in enumerate((4, 5)):
            base = i * 1000
            t.step(n, base, base + 900)
            t.cpu_op("autograd::engine::evaluate_function: MmBackward0", base, base + 400)
            t.gloo("all_reduce", base + 300, base + 600 + 100 * rank * i, nelems=256)
            t.cpu_op("aten::add_", base + 700, base + 800)
        t.write(run_dir / f"rank{rank}.17.pt.trace.json")
    return run_dir


def _run(argv, capsys):
    parser = argparse.ArgumentParser(prog="overlapkit")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code = args.func(args)
    return code, capsys.readouterr().out


def test_json_has_the_design_keys_and_the_numbers_of_the_analysis(tmp_path, capsys):
    run = _write_run(tmp_path)
    (run / "notes.json").write_text("{}")
    code, out = _run(["report", str(run), "--json"], capsys)
    assert code == 0
    payload = json.loads(out)
    assert {"steps", "files", "skipped"} <= set(payload)
    assert len(payload["steps"]) == 4
    for row in payload["steps"]:
        assert set(row) >= STEP_KEYS
    row = next(r for r in payload["steps"] if (r["rank"], r["step"]) == (1, 5))
    # comm [300, 700] against compute [0, 400] + [700, 800]: exposed 300 µs, all after backward.
    assert (row["comm_ms"], row["exposed_comm_ms"], row["tail_ms"]) == pytest.approx(
        (0.4, 0.3, 0.3)
    )
    assert row["kinds"]["all_reduce"] == {
        "count": 1,
        "bytes": 1024,
        "time_ms": pytest.approx(0.4),
        "exposed_ms": pytest.approx(0.3),
    }
    assert [s["file"].rsplit("/", 1)[-1] for s in payload["skipped"]] == ["notes.json"]
    assert [(t["rank"], t["world_size"], t["device"], t["steps"]) for t in payload["traces"]] == [
        (0, 2, "cpu", [4, 5]),
        (1, 2, "cpu", [4, 5]),
    ]
    [step5] = [c for c in payload["cross_rank"] if c["step"] == 5]
    assert (step5["max_comm_rank"], step5["comm_spread_ms"]) == (1, pytest.approx(0.1))


def test_the_table_lists_every_rank_and_step_and_the_skipped_files(tmp_path, capsys):
    run = _write_run(tmp_path)
    (run / "broken.pt.trace.json").write_text('{"traceEvents": [{"ph": "X"')
    code, out = _run(["report", str(run)], capsys)
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if "exposed_ms" in line)
    assert header.split()[:8] == [
        "step",
        "rank",
        "step_ms",
        "compute_ms",
        "comm_ms",
        "exposed_ms",
        "tail_ms",
        "overlap",
    ]
    rows = [line.split() for line in lines[lines.index(header) + 1 :][:4]]
    assert [(r[0], r[1]) for r in rows] == [("4", "0"), ("4", "1"), ("5", "0"), ("5", "1")]
    assert rows[3][4:8] == ["0.40", "0.30", "0.30", "25%"]
    assert "across ranks" in out
    assert any("broken.pt.trace.json" in line and "truncated" in line for line in lines)


def test_png_timeline_is_drawn_for_the_chosen_step(tmp_path, capsys):
    run = _write_run(tmp_path / "run")
    png = tmp_path / "t.png"
    code, out = _run(["report", str(run), "--png", str(png), "--step", "4"], capsys)
    assert code == 0 and f"timeline: {png}" in out
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 200 and image.shape[1] > 600
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_an_unknown_step_and_an_empty_directory_exit_2_with_the_reason(tmp_path, capsys):
    run = _write_run(tmp_path / "run")
    assert (
        overlapkit_cli.main(["report", str(run), "--png", str(tmp_path / "x.png"), "--step", "9"])
        == 2
    )
    assert "--step 9 is not in the traces; steps there: [4, 5]" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert overlapkit_cli.main(["report", str(tmp_path / "empty")]) == 2
    assert "no readable profiler trace" in capsys.readouterr().err


def test_python_dash_m_runs_the_report(tmp_path):
    run = _write_run(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "overlapkit.cli", "report", str(run), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["steps"]) == 4


def _integrate(counters, series):
    """Area under one series of a step-function counter track, µs."""
    points = sorted((e["ts"], e["args"][series]) for e in counters)
    return sum(v * (t2 - t1) for (t1, v), (t2, _) in itertools.pairwise(points))


@pytest.mark.parametrize("name", ["rank0.1.pt.trace.json", "rank0.1.pt.trace.json.gz"])
def test_counter_copy_traces_exposed_and_hidden_comm_and_analyses_the_same(tmp_path, name):
    t = TraceBuilder(rank=0, backend="gloo")
    t.step(1, 0, 1000)
    t.cpu_op("autograd::engine::evaluate_function: MmBackward0", 0, 400)
    t.gloo("all_reduce", 300, 600)
    t.gloo("all_reduce", 650, 700, tid=9002)
    (tmp_path / "run").mkdir()
    original = t.write(tmp_path / "run" / name)
    report = analyze_run(tmp_path / "run", lanes=True)
    [m], [lanes] = report.steps, report.lanes
    copy = write_counter_copy(original, [(lanes, m)], tmp_path / "copy")
    assert copy.name == name
    copied = analyze_run(tmp_path / "copy")
    assert copied.steps[0].exposed_comm_ms == m.exposed_comm_ms
    with gzip.open(copy, "rt") if name.endswith(".gz") else copy.open() as f:
        events = json.load(f)["traceEvents"]
    comm = [e for e in events if e.get("ph") == "C" and e["name"] == "overlapkit comm"]
    assert _integrate(comm, "exposed") == pytest.approx(m.exposed_comm_ms * 1e3)  # 200 + 50
    assert _integrate(comm, "hidden") == pytest.approx((m.comm_ms - m.exposed_comm_ms) * 1e3)
    step = [e for e in events if e.get("ph") == "C" and e["name"] == "overlapkit step (ms)"]
    assert step[0]["args"]["exposed_comm_ms"] == pytest.approx(0.25)
    assert all(e["pid"] == t.pid for e in comm + step)
