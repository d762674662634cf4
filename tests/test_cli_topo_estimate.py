"""``overlapkit topo``, ``estimate`` and ``calibrate`` through their argparse registration."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from overlapkit.cost import cli as cost_cli
from overlapkit.planner import cli as planner_cli
from overlapkit.topology import cli as topology_cli
from overlapkit.topology import load_topology

REPO = Path(__file__).resolve().parent.parent
GLOO_PRINT_STANDIN = REPO / "tests" / "gloo_print_standin"


def _run(argv, capsys):
    parser = argparse.ArgumentParser(prog="overlapkit")
    subparsers = parser.add_subparsers(dest="command", required=True)
    topology_cli.register(subparsers)
    planner_cli.register(subparsers)
    cost_cli.register(subparsers)
    args = parser.parse_args(argv)
    code = args.func(args)
    return code, capsys.readouterr().out


def test_topo_json_has_the_design_keys(capsys):
    code, out = _run(["topo", "--preset", "dgx-h100x2", "--json"], capsys)
    doc = json.loads(out)
    assert code == 0
    assert doc["world_size"] == 16 and len(doc["nodes"]) == 2
    assert doc["domains"][0]["kind"] == "nvlink" and doc["domains"][0]["bandwidth_GBps"] == 450
    assert doc["fabric"]["kind"] == "rail-optimized" and doc["fabric"]["nic_GBps"] == 50
    assert len(doc["fabric"]["rails"]) == 8


def test_topo_table_shows_domains_nodes_rails_and_bandwidths(capsys):
    _, out = _run(["topo", "--preset", "gb200-nvl72x2", "--fabric", "fat-tree"], capsys)
    assert "144 device(s) on 36 node(s)" in out
    assert "nvlink  0-71" in out and "nvlink  72-143" in out
    assert "scale-out fabric: fat-tree, infiniband, 4 NIC(s) per node x 50 GB/s" in out
    assert "rails (ranks sending through NIC i of their node)" in out


def test_topo_detects_this_machine_by_default(capsys):
    _, out = _run(["topo", "--json"], capsys)
    doc = json.loads(out)
    # Detection reports the hardware: NCCL where CUDA is, gloo on a CPU-only host.
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert doc["name"] == "detected" and doc["library"] == expected


def test_topo_validates_a_file(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nnodes: 0\n")
    with pytest.raises(ValueError, match="bad.yaml:2: nodes: must be >= 1"):
        _run(["topo", "--file", str(path)], capsys)


def test_estimate_reproduces_the_worked_example_from_a_bare_link(capsys):
    _, out = _run(
        [
            "estimate",
            "--collective",
            "all_reduce",
            "--bytes",
            "140e9",
            "--bandwidth",
            "1.8TB/s",
            "--group-size",
            "1024",
            "--json",
        ],
        capsys,
    )
    doc = json.loads(out)
    assert doc["algorithm"] == "ring" and doc["group_size"] == 1024
    assert doc["time_s"] == pytest.approx(0.1554, abs=5e-5)
    assert doc["busbw_GBps"] == pytest.approx(1800)
    _, out = _run(
        [
            "estimate",
            "--collective",
            "all_reduce",
            "--bytes",
            "140GB",
            "--bandwidth",
            "400Gbit/s",
            "--group-size",
            "1024",
        ],
        capsys,
    )
    assert "time       5.595 s" in out and "algorithm  ring" in out


def test_estimate_with_latency_adds_two_steps_per_rank(capsys):
    _, out = _run(
        [
            "estimate",
            "--collective",
            "all_reduce",
            "--bytes",
            "0",
            "--bandwidth",
            "50GB/s",
            "--latency",
            "5us",
            "--group-size",
            "4",
            "--algorithm",
            "ring",
            "--json",
        ],
        capsys,
    )
    assert json.loads(out)["time_s"] == pytest.approx(6 * 5e-6)


def test_estimate_on_a_preset_lists_its_candidates(capsys):
    _, out = _run(
        [
            "estimate",
            "--collective",
            "all_reduce",
            "--bytes",
            "1.5GiB",
            "--topology",
            "dgx-h100x4",
            "--group-size",
            "16",
        ],
        capsys,
    )
    assert "all_reduce of 1.5 GiB on 16 rank(s) of dgx-h100x4 (library nccl)" in out
    assert "candidates (fastest first)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bytes", "-1", "--topology", "dgx-h100"], "--bytes must be >= 0"),
        (
            ["--bytes", "1", "--topology", "dgx-h100", "--group-size", "9"],
            "group_size 9 must be between 1 and the 8",
        ),
        (["--bytes", "1", "--bandwidth", "1TB/s"], "--bandwidth needs --group-size"),
        (["--bytes", "1", "--topology", "dgx-h100", "--latency", "5us"], "--latency goes with"),
        (["--bytes", "1", "--topology", "dgx-h1000"], "Did you mean dgx-h100"),
        (
            ["--bytes", "1", "--topology", "dgx-a100", "--algorithm", "switch"],
            "switch needs scale-up domains",
        ),
        (
            ["--bytes", "1", "--bandwidth", "fast", "--group-size", "2"],
            "--bandwidth: cannot read 'fast'",
        ),
    ],
)
def test_estimate_rejects_bad_input_naming_it(argv, message, capsys):
    with pytest.raises(ValueError, match=message):
        _run(["estimate", "--collective", "all_reduce", *argv], capsys)


def test_estimate_requires_a_topology_or_a_bandwidth(capsys):
    with pytest.raises(SystemExit):
        _run(["estimate", "--collective", "all_reduce", "--bytes", "1"], capsys)


@pytest.mark.slow
def test_calibrate_measures_small_sizes_and_writes_a_usable_topology(tmp_path):
    # Up to 4 MiB: small enough to stay quick, large enough that bandwidth shows over the noise.
    # Through the real command, with a stand-in for torch 2.9's gloo writing to file descriptor
    # 1 from C++ in every rank: stdout must hold the JSON only.
    output = tmp_path / "calibrated.yaml"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "overlapkit.cli",
            "calibrate",
            "--min-bytes",
            "4KiB",
            "--max-bytes",
            "4MiB",
            "--budget-s",
            "0.01",
            "--quantile",
            "0.25",
            "--output",
            str(output),
            "--no-progress",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "PYTHONPATH": f"{GLOO_PRINT_STANDIN}{os.pathsep}{REPO}"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The stand-in printed in both ranks, and it went to stderr.
    assert done.stderr.count("[Gloo] Rank 0 is connected") == 2, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["backend"] == "gloo"
    tier = doc["tiers"][0]
    assert tier["tier"] == "scale_up" and tier["ranks"] == [0, 1]
    assert [s["bytes"] for s in tier["sizes"]] == [4096 * 2**i for i in range(11)]
    assert all(s["time_s"] > 0 and s["busbw_GBps"] > 0 for s in tier["sizes"])
    assert tier["bandwidth_GBps"] > 0 and tier["latency_us"] >= 0
    assert "quantile 0.25 of each size's iterations" in output.read_text()
    topo = load_topology(output)
    assert topo.world_size == 2
    assert topo.domains[0].bandwidth_GBps == pytest.approx(tier["bandwidth_GBps"], rel=1e-4)


def test_calibrate_rejects_a_quantile_outside_zero_one_before_measuring(tmp_path, capsys):
    with pytest.raises(ValueError, match="quantile must be in \\(0, 1\\), got 1.5"):
        _run(["calibrate", "--quantile", "1.5", "--output", str(tmp_path / "t.yaml")], capsys)
    assert not (tmp_path / "t.yaml").exists()


def test_calibrate_rejects_a_fit_range_with_fewer_than_two_sizes(tmp_path, capsys):
    argv = ["calibrate", "--max-bytes", "1MiB", "--fit-min-bytes", "1MiB"]
    with pytest.raises(ValueError, match="--fit-min-bytes 1048576 leaves fewer than two"):
        _run([*argv, "--output", str(tmp_path / "t.yaml")], capsys)
