"""``overlapkit doctor``: each check's classification on recorded inputs, and real runs.

The classifiers are pure functions, so they are fed recorded facts (presets, sysfs-style PCI
paths, measurements, profiler rows) and their pass/warn/fail is checked against the thresholds
they document. The slow tests run the real command on two gloo ranks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from overlapkit import cli
from overlapkit.doctor import affinity, perf_checks, setup_checks
from overlapkit.doctor.check import (
    CHECK_NAMES,
    FAIL,
    PASS,
    STATUSES,
    WARN,
    Check,
    exit_code,
    parse_only,
)
from overlapkit.doctor.render import render, to_json
from overlapkit.doctor.runner import DoctorOptions
from overlapkit.layout import PartialLayout
from overlapkit.topology import (
    Device,
    DomainKind,
    ScaleUpDomain,
    Topology,
    load_topology,
)
from overlapkit.tuning.report import Trial, TuningReport

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the Check type


def test_check_rejects_an_unknown_status():
    with pytest.raises(ValueError, match="'ok'"):
        Check("topology", "ok", "x", "y")


def test_exit_code_is_one_only_when_a_check_failed():
    passing = Check("a", PASS, "v", "a")
    warning = Check("b", WARN, "v", "a")
    assert exit_code([passing, warning]) == 0
    assert exit_code([passing, Check("c", FAIL, "v", "a")]) == 1


def test_only_keeps_checklist_order_and_rejects_unknown_names():
    assert parse_only("scaling,topology") == ("topology", "scaling")
    assert parse_only(None) == CHECK_NAMES
    with pytest.raises(ValueError, match="'bandwith'.*valid: topology"):
        parse_only("bandwith")


def test_json_has_the_design_keys_and_the_table_every_check():
    checks = [Check("topology", PASS, "2 cpu", "fine"), Check("scaling", FAIL, "28%", "slow")]
    doc = to_json(checks, {"world_size": 2, "launcher": "local"})
    assert [set(c) for c in doc["checks"]] == [{"name", "status", "value", "advice"}] * 2
    assert doc["status"] == FAIL
    text = render(checks, {"world_size": 2, "launcher": "local"})
    assert "PASS  topology" in text and "FAIL  scaling" in text and "-> slow" in text
    assert "1 passed, 0 warned, 1 failed (exit code 1)" in text


def test_options_name_the_offending_value(capsys):
    assert cli.main(["doctor", "--tp", "0"]) == 2  # refused before any rank starts
    assert "--tp must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--model.*'bert'"):
        DoctorOptions(model="bert")
    with pytest.raises(ValueError, match="--bucket-mb must be > 0 MiB, got -1"):
        DoctorOptions(bucket_mb=-1.0)
    with pytest.raises(ValueError, match="--bucket-mb must be a finite number of MiB, got inf"):
        DoctorOptions(bucket_mb=math.inf)


# ----------------------------------------------------------------------------- 1. topology

CPU = load_topology("cpu-gloo")


def test_topology_passes_and_shows_what_the_library_sees():
    check = setup_checks.check_topology(
        CPU, backend="gloo", env={"GLOO_SOCKET_IFNAME": "lo"}, interfaces=["lo", "eth0"]
    )
    assert check.status == PASS
    assert "backend gloo, world size 2" in check.value and "GLOO_SOCKET_IFNAME=lo" in check.value


def test_topology_mismatch_with_the_expected_one_fails():
    check = setup_checks.check_topology(
        CPU, backend="gloo", env={}, interfaces=["lo"], expected=load_topology("dgx-h100")
    )
    assert check.status == FAIL
    assert "world size 2, expected 8" in check.advice
    assert "device kind ['cpu'], expected ['gpu']" in check.advice


def test_socket_ifname_that_matches_no_interface_fails():
    check = setup_checks.check_topology(
        CPU, backend="gloo", env={"GLOO_SOCKET_IFNAME": "ib0"}, interfaces=["lo", "eth0"]
    )
    assert check.status == FAIL and "'ib0' matches no interface" in check.advice


def test_multi_node_without_an_interface_setting_warns():
    check = setup_checks.check_topology(
        load_topology("dgx-h100x2"), backend="nccl", env={}, interfaces=["lo", "ib0"]
    )
    assert check.status == WARN and "NCCL_SOCKET_IFNAME is unset" in check.advice


def test_nccl_ifname_prefixes_exclusions_and_exact_names():
    names = ["lo", "eth0", "eth1", "ib0", "docker0"]
    pick = setup_checks.matching_interfaces
    assert pick("eth", names, variable="NCCL_SOCKET_IFNAME") == ["eth0", "eth1"]
    assert pick("^docker,lo", names, variable="NCCL_SOCKET_IFNAME") == ["eth0", "eth1", "ib0"]
    assert pick("=eth", names, variable="NCCL_SOCKET_IFNAME") == []
    assert pick("eth0,ib0", names, variable="GLOO_SOCKET_IFNAME") == ["eth0", "ib0"]
    assert pick("eth", names, variable="GLOO_SOCKET_IFNAME") == []


# ----------------------------------------------------------------------------- 2. NIC affinity
# A DGX-H100-style PCIe tree: each GPU and its NIC below one PCIe switch of socket 0's root
# complex 0000:17 (GPU 0) or 0000:3b (GPU 1); a NIC on socket 1 (root 0000:9a).

ROOT = "/sys/devices"
GPU0 = f"{ROOT}/pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0/0000:1a:00.0"
NIC0 = f"{ROOT}/pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:01.0/0000:1b:00.0"
GPU1 = f"{ROOT}/pci0000:3b/0000:3b:01.0/0000:3c:00.0/0000:3d:00.0/0000:3e:00.0"
NIC1 = f"{ROOT}/pci0000:3b/0000:3b:01.0/0000:3c:00.0/0000:3d:01.0/0000:3f:00.0"
NIC_FAR = f"{ROOT}/pci0000:9a/0000:9a:01.0/0000:9b:00.0/0000:9c:01.0/0000:9d:00.0"


def _facts(rank, gpu, rail, nics, gpu_numa=0):
    return {
        "rank": rank,
        "hostname": "node0",
        "gpu_pci_path": gpu,
        "gpu_numa": gpu_numa,
        "rail": rail,
        "nics": [{"name": name, "pci_path": path, "numa": numa} for name, path, numa in nics],
    }


NICS = [("mlx5_0", NIC0, 0), ("mlx5_1", NIC1, 0)]


def test_pci_path_types_follow_nccls_distances():
    assert affinity.pci_path_type(GPU0, NIC0, 0, 0) == "PIX"
    assert affinity.pci_path_type(GPU0, f"{ROOT}/pci0000:17/0000:17:02.0/0000:20:00.0") == ("PHB")
    assert affinity.pci_path_type(GPU0, NIC1, 0, 0) == "NODE"
    assert affinity.pci_path_type(GPU0, NIC_FAR, 0, 1) == "SYS"


def test_each_gpu_on_its_nearest_nic_passes():
    facts = [_facts(0, GPU0, 0, NICS), _facts(1, GPU1, 1, NICS)]
    check = affinity.check_nic_affinity(facts, nodes=2)
    assert check.status == PASS
    assert "rank 0 -> mlx5_0 (PIX), rank 1 -> mlx5_1 (PIX)" in check.value


def test_a_gpu_sending_through_a_farther_nic_warns_and_names_the_nearer_one():
    facts = [_facts(0, GPU0, 1, NICS), _facts(1, GPU1, 1, NICS)]
    check = affinity.check_nic_affinity(facts, nodes=2)
    assert check.status == WARN
    assert "rank 0 sends through mlx5_1 (NODE) but mlx5_0 is nearer (PIX)" in check.advice


def test_only_cross_socket_nics_warn():
    facts = [_facts(0, GPU0, 0, [("mlx5_9", NIC_FAR, 1)])]
    check = affinity.check_nic_affinity(facts, nodes=2)
    assert check.status == WARN and "across the CPU interconnect (SYS)" in check.advice


def test_affinity_is_not_applicable_on_cpu_and_harmless_on_one_node():
    cpu = [_facts(0, None, 0, []), _facts(1, None, 0, [])]
    assert affinity.check_nic_affinity(cpu, nodes=1).status == PASS
    assert "not applicable" in affinity.check_nic_affinity(cpu, nodes=1).value
    single = [_facts(0, GPU0, 0, [("mlx5_9", NIC_FAR, 1)])]
    assert affinity.check_nic_affinity(single, nodes=1).status == PASS


def test_affinity_facts_read_numa_nodes_from_sysfs(tmp_path):
    gpu, nic = tmp_path / "gpu", tmp_path / "nic"
    for path, numa in ((gpu, "1"), (nic, "-1")):
        path.mkdir()
        (path / "numa_node").write_text(numa + "\n")
    view = {
        "rank": 3,
        "hostname": "h",
        "gpu": {"pci_path": str(gpu)},
        "nics": [{"name": "mlx5_0", "pci_path": str(nic)}],
    }
    facts = affinity.affinity_facts(view, rail=0)
    assert facts["gpu_numa"] == 1 and facts["nics"][0]["numa"] is None and facts["rank"] == 3


# ----------------------------------------------------------------------------- 4. algorithms

H100X2 = load_topology("dgx-h100x2")


def test_nothing_forced_passes_and_lists_the_choice_per_size():
    check = setup_checks.check_algorithms(H100X2, backend="nccl", env={})
    assert check.status == PASS
    assert [row["algorithm"] for row in check.details["sizes"]] == [
        "tree",
        "ring",
        "switch",
        "switch",
    ]


def test_forcing_ring_warns_with_the_predicted_slowdown():
    check = setup_checks.check_algorithms(H100X2, backend="nccl", env={"NCCL_ALGO": "Ring"})
    assert check.status == WARN
    forced = [row["forced"] for row in check.details["sizes"]]
    assert {f["algorithm"] for f in forced} == {"ring"}
    big = check.details["sizes"][-1]
    assert big["forced"]["time_s"] > big["time_s"]
    assert "256 MiB: ring/" in check.advice and "vs switch" in check.advice


def test_unknown_algorithm_or_protocol_fails():
    bad_algo = setup_checks.check_algorithms(CPU, backend="gloo", env={"NCCL_ALGO": "fastest"})
    assert bad_algo.status == FAIL and "unknown algorithm(s) ['fastest']" in bad_algo.advice
    bad_proto = setup_checks.check_algorithms(H100X2, backend="nccl", env={"NCCL_PROTO": "LL64"})
    assert bad_proto.status == FAIL and "['ll64']" in bad_proto.advice


def test_nccl_lists_take_exclusions_and_per_collective_forms():
    valid = list(setup_checks.NCCL_ALGOS)
    assert setup_checks.parse_nccl_list("^ring,tree", valid)[0] == set(valid) - {"ring", "tree"}
    assert setup_checks.parse_nccl_list("allreduce:tree;allgather:ring", valid) == (
        {"tree", "ring"},
        [],
    )


def test_restricting_settings_warn():
    check = setup_checks.check_algorithms(H100X2, backend="nccl", env={"NCCL_P2P_DISABLE": "1"})
    assert check.status == WARN and "peer-to-peer" in check.advice


# ----------------------------------------------------------------------------- 7. placement


def test_tp_inside_a_node_passes_with_rail_aligned_dp():
    check = setup_checks.check_placement(H100X2, PartialLayout(tp=8))
    assert check.status == PASS
    assert "tp=8 inside one nvlink domain" in check.value and "rail-aligned" in check.value


def test_tp_across_domains_warns():
    check = setup_checks.check_placement(H100X2, PartialLayout(tp=16))
    assert check.status == WARN and "tp=16 spans 2 scale-up domains" in check.advice


def test_dp_across_nodes_whose_rails_differ_warns():
    """Node 1 sends both GPUs through NIC 0 (its second port is down): dp cannot stay on a rail."""
    devices = (
        Device(0, 0, 0, nic=0),
        Device(1, 0, 1, nic=1),
        Device(2, 1, 0, nic=0),
        Device(3, 1, 1, nic=0),
    )
    domains = tuple(
        ScaleUpDomain(DomainKind.NVLINK, ranks, 450.0, 3.4, 18) for ranks in ((0, 1), (2, 3))
    )
    fabric = dataclasses.replace(H100X2.fabric, nics_per_node=2)
    topology = Topology("irregular-rails", devices, domains, fabric)
    check = setup_checks.check_placement(topology, PartialLayout(tp=2))
    assert check.status == WARN and "dp groups are not rail-aligned" in check.advice


def test_sizes_that_do_not_fit_fail_with_the_planners_reason():
    check = setup_checks.check_placement(H100X2, PartialLayout(tp=6))
    assert check.status == FAIL and "does not divide the 16 ranks" in check.advice


# ----------------------------------------------------------------------------- 3. bandwidth

SWEEP = [
    {"bytes": 2**20, "time_s": 2e-3, "busbw_GBps": 0.5},
    {"bytes": 8 * 2**20, "time_s": 9e-3, "busbw_GBps": 0.93},
]


@pytest.mark.parametrize(
    ("predicted", "nominal", "status"),
    [
        (1.0, False, PASS),
        (1.3, False, PASS),
        (2.0, False, WARN),
        (4.0, False, FAIL),
        (4.0, True, WARN),
        (0.5, False, WARN),
    ],
)
def test_bandwidth_is_judged_against_the_catalogue(predicted, nominal, status):
    check = perf_checks.check_bandwidth(
        SWEEP, predicted_busbw_GBps=predicted, reference="t", nominal=nominal, fit=(50.0, 1.0)
    )
    assert check.status == status
    assert check.details["ratio"] == pytest.approx(0.93 / predicted)
    assert "0.93 GB/s busbw at 8 MiB" in check.value


# ----------------------------------------------------------------------------- 5. bucket size


def _report(chosen, settled=True):
    trials = [
        Trial(value=1.0, step_ms=100.0, exposed_ms=10.0),
        Trial(value=4.0, step_ms=90.0, exposed_ms=5.0),
    ]
    return TuningReport(
        knob="bucket_mb",
        trials=trials,
        chosen=chosen if settled else None,
        settled=settled,
        settled_at_step=10 if settled else None,
        reason="fastest trial",
    )


def test_bucket_size_agreeing_with_auto_passes():
    check = perf_checks.check_bucket_size(
        current_mb=4.0, current_step_ms=91.0, report=_report(4.0), explicit=True
    )
    assert check.status == PASS and "auto-tuning agrees" in check.advice


def test_bucket_size_slower_than_autos_choice_warns_and_says_which():
    check = perf_checks.check_bucket_size(
        current_mb=1.0, current_step_ms=None, report=_report(4.0), explicit=True
    )
    assert check.status == WARN and "use bucket_mb=4" in check.advice
    assert "+11.1%" in check.value


def test_bucket_size_within_tolerance_passes_when_measured_alike():
    check = perf_checks.check_bucket_size(
        current_mb=1.0,
        current_step_ms=92.0,
        report=_report(4.0),
        explicit=False,
        chosen_step_ms=90.0,
    )
    assert check.status == PASS and "default bucket_mb=1 MiB" in check.value


def test_unsettled_tuning_warns():
    check = perf_checks.check_bucket_size(
        current_mb=1.0, current_step_ms=92.0, report=_report(4.0, settled=False), explicit=True
    )
    assert check.status == WARN and "did not settle" in check.value


def _prefetch_report(chosen):
    return TuningReport(
        knob="prefetch",
        trials=[
            Trial(value=0, step_ms=120.0, exposed_ms=None, peak_bytes=2**20),
            Trial(value=1, step_ms=100.0, exposed_ms=None, peak_bytes=2**21),
            Trial(value=2, step_ms=80.0, exposed_ms=None, peak_bytes=3 * 2**20),
        ],
        chosen=chosen,
        settled=True,
        settled_at_step=14,
        reason="fastest trial",
    )


def test_default_prefetch_slower_than_autos_depth_warns_naming_the_depth():
    check = perf_checks.check_prefetch(
        current_depth=1, current_step_ms=None, report=_prefetch_report(2), explicit=False
    )
    assert check.name == "prefetch" and check.status == WARN
    assert "the default prefetch=1; auto chose 2" in check.value and "+25.0%" in check.value
    assert "use prefetch=2" in check.advice


def test_prefetch_agreeing_with_auto_passes():
    check = perf_checks.check_prefetch(
        current_depth=2, current_step_ms=81.0, report=_prefetch_report(2), explicit=True
    )
    assert check.status == PASS and "your prefetch=2" in check.value


def test_doctor_rejects_a_prefetch_depth_it_cannot_judge():
    with pytest.raises(ValueError, match="--prefetch must be 0, 1 or 2, got 3"):
        DoctorOptions(prefetch=3)


# ----------------------------------------------------------------------------- 6. overlap


def _rows(exposed, tail, comm=20.0, step=100.0, n=4):
    return [{"step_ms": step, "comm_ms": comm, "exposed_comm_ms": exposed, "tail_ms": tail}] * n


def test_hidden_comm_passes_and_exposed_tail_warns_about_buckets():
    assert perf_checks.check_overlap(_rows(5.0, 2.0)).status == PASS
    check = perf_checks.check_overlap(_rows(30.0, 25.0, comm=40.0))
    assert check.status == WARN and "tail after backward" in check.advice
    assert check.details["exposed_share"] == pytest.approx(0.3)
    mid = perf_checks.check_overlap(_rows(30.0, 2.0, comm=40.0))
    assert "exposed during backward" in mid.advice


def test_no_collective_in_the_trace_warns():
    check = perf_checks.check_overlap(_rows(0.0, 0.0, comm=0.0))
    assert check.status == WARN and "saw no collective" in check.advice
    assert perf_checks.check_overlap([]).status == WARN


# ----------------------------------------------------------------------------- 8. scaling


def test_scaling_thresholds_follow_the_efficiency():
    assert perf_checks.check_scaling({1: 100.0, 2: 180.0}).status == PASS
    warn = perf_checks.check_scaling({1: 100.0, 2: 130.0})
    assert warn.status == WARN and "65% at 2 ranks" in warn.advice
    fail = perf_checks.check_scaling({1: 100.0, 2: 90.0, 4: 80.0})
    assert fail.status == FAIL and "4 ranks are slower than one (20%)" in fail.advice
    assert fail.details["efficiency"] == {"1": 1.0, "2": 0.45, "4": 0.2}
    assert perf_checks.check_scaling({1: 100.0}).status == WARN


# ----------------------------------------------------------------------------- the command


def _doctor(*argv, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "overlapkit.cli", "doctor", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={
            **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
            **(env or {}),
        },
    )


def test_the_overlapkit_command_has_doctor():
    assert "overlapkit.doctor.cli" in cli.COMMAND_MODULES


def test_unknown_check_is_a_usage_error(capsys):
    assert cli.main(["doctor", "--only", "speed"]) == 2
    assert "unknown check(s) ['speed']" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_doctor_on_two_ranks_reports_all_eight_checks():
    # tests/gloo_print_standin writes to file descriptor 1 in every rank, as torch 2.9's gloo
    # does from C++: stdout must still hold the JSON only.
    standin = f"{REPO / 'tests' / 'gloo_print_standin'}{os.pathsep}{REPO}"
    done = _doctor("--json", "--nproc", "2", "--quick", env={"PYTHONPATH": standin})
    assert "[Gloo] Rank 0 is connected" in done.stderr, done.stderr[-2000:]
    doc = json.loads(done.stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    assert list(checks) == list(CHECK_NAMES), done.stderr[-2000:]
    for check in doc["checks"]:
        assert check["status"] in STATUSES
        assert not check["value"].startswith("error"), check
    assert done.returncode == (1 if any(c["status"] == FAIL for c in doc["checks"]) else 0)
    topology = checks["topology"]["details"]
    # The doctor measures over NCCL where each rank can have a GPU of its own.
    nccl = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    assert (topology["backend"], topology["world_size"]) == ("nccl" if nccl else "gloo", 2)
    sizes = checks["bandwidth"]["details"]["sizes"]
    assert len(sizes) >= 2 and all(s["busbw_GBps"] > 0 for s in sizes)
    assert checks["overlap"]["details"]["comm_ms"] > 0
    throughput = checks["scaling"]["details"]["throughput"]
    assert set(throughput) == {"1", "2"} and all(v > 0 for v in throughput.values())


@pytest.mark.slow
def test_invalid_nccl_algo_and_a_topology_mismatch_fail_the_run():
    done = _doctor(
        "--json",
        "--quick",
        "--nproc",
        "1",
        "--only",
        "topology,algorithms",
        "--topology",
        "dgx-h100",
        env={"NCCL_ALGO": "fastest"},
    )
    doc = json.loads(done.stdout)
    assert done.returncode == 1
    assert [c["status"] for c in doc["checks"]] == [FAIL, FAIL]
    assert "world size 1, expected 8" in doc["checks"][0]["advice"]
    assert "NCCL_ALGO='fastest'" in doc["checks"][1]["advice"]
