"""Scaling efficiency ``T(N) / (N x T(1))``: the shared function, and ``bench/scaling.py``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.scaling import SHOWN, build_report, plot
from overlapkit.doctor.scaling import efficiencies, rank_counts, scaling_efficiency

REPO = Path(__file__).resolve().parents[1]


def test_efficiency_is_n_ranks_throughput_over_n_times_one():
    assert scaling_efficiency(100.0, 180.0, 2) == pytest.approx(0.9)
    assert scaling_efficiency(100.0, 400.0, 4) == pytest.approx(1.0)
    assert scaling_efficiency(50.0, 50.0, 1) == 1.0
    assert scaling_efficiency(100.0, 0.0, 8) == 0.0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((100.0, 100.0, 0), "n must be an int >= 1 rank, got 0"),
        ((100.0, 100.0, True), "got True"),
        ((0.0, 100.0, 2), "throughput_1 must be > 0 items/s, got 0.0"),
        ((math.nan, 100.0, 2), "throughput_1"),
        ((100.0, -1.0, 2), "throughput_n must be >= 0 items/s, got -1.0"),
    ],
)
def test_bad_inputs_name_the_offending_value(args, match):
    with pytest.raises(ValueError, match=match):
        scaling_efficiency(*args)


def test_efficiencies_need_the_one_rank_run():
    assert efficiencies({1: 10.0, 2: 15.0}) == {1: 1.0, 2: 0.75}
    with pytest.raises(ValueError, match=r"1-rank throughput; got rank counts \[2, 4\]"):
        efficiencies({2: 10.0, 4: 15.0})


def test_rank_counts_double_up_to_the_world_size():
    assert rank_counts(1) == [1]
    assert rank_counts(2) == [1, 2]
    assert rank_counts(6) == [1, 2, 4, 6]


CFG = {"model": "gpt_tiny", "layers": 4, "width": 256, "batch": 2, "seq_len": 64}


def _medians():
    one = dict.fromkeys(SHOWN, 10.0)
    two = {name: 10.0 + 2.5 * i for i, name in enumerate(SHOWN)}
    return {1: one, 2: two}


def test_report_turns_step_times_into_throughput_and_efficiency():
    report = build_report(_medians(), CFG)
    tokens = 2 * 64
    assert report["unit"] == "tokens/s"
    ddp = report["scaling"]["ddp_default"]
    assert ddp["1"]["throughput"] == pytest.approx(tokens / 0.010)
    # ddp_default is third in SHOWN: 15 ms at 2 ranks -> 2 x 128 / 0.015 tok/s.
    assert ddp["2"]["throughput"] == pytest.approx(2 * tokens / 0.015, rel=1e-4)
    assert ddp["2"]["efficiency"] == pytest.approx(10.0 / 15.0, abs=1e-4)
    assert report["scaling"]["compute_only"]["2"]["efficiency"] == 1.0
    assert ddp["2"]["efficiency_vs_compute_only"] == pytest.approx(10.0 / 15.0, abs=1e-4)
    names = [c["name"] for c in report["cases"]]
    assert names[:2] == ["compute_only@1", "compute_only@2"] and len(names) == 2 * len(SHOWN)
    case = next(c for c in report["cases"] if c["name"] == "ok_ddp@2")
    assert case["speedup_vs_baseline"] == pytest.approx(15.0 / 17.5, abs=1e-3)
    assert {"cases", "baseline", "link"} <= set(report)


def test_report_without_the_one_rank_run_is_refused():
    with pytest.raises(ValueError, match=r"1-rank run; got rank counts \[2\]"):
        build_report({2: _medians()[2]}, CFG)


def test_plot_writes_a_png(tmp_path):
    path = plot(build_report(_medians(), CFG), tmp_path / "sub" / "scaling.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_measures_one_and_two_ranks_and_plots(tmp_path):
    out = tmp_path / "scaling.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.scaling",
            "--rate",
            "none",
            "--model",
            "mlp",
            "--layers",
            "2",
            "--width",
            "128",
            "--batch",
            "16",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--warmup",
            "1",
            "--json",
            str(out),
            "--png",
            str(tmp_path / "scaling.png"),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["scaling"]) == set(SHOWN)
    for per_n in report["scaling"].values():
        assert set(per_n) == {"1", "2"}
        one, two = per_n["1"], per_n["2"]
        assert one["efficiency"] == 1.0
        assert two["efficiency"] == pytest.approx(
            two["throughput"] / (2 * one["throughput"]), abs=1e-3
        )
    assert (tmp_path / "scaling.png").stat().st_size > 0
    assert "scaling efficiency T(n) / (n x T(1))" in done.stdout
