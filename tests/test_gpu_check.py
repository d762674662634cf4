"""The GPU check (``bench/gpu/check.sh``, ``python -m bench.gpu.check``): its verdicts on recorded
results, its behaviour without a GPU, and its dry run on gloo/CPU through the same torchrun
workers."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu import check, judges
from overlapkit.doctor.check import CHECK_NAMES, PASS

REPO = Path(__file__).resolve().parents[1]


def _worker_results(backend="nccl", device="cuda", bf16_err=2.8e-3, complete=9):
    paths = {
        name: {"max_rel_err": err, "records": 9, "complete": complete, "min_comm_ms": 0.05}
        for name, err in (("fp32", 0.0), ("bf16", bf16_err), ("fp16", 3.2e-4), ("bucketer", 0.0))
    }
    return {"backend": backend, "device": device, "world_size": 1, "paths": paths}


def test_gpu_check_judges_the_hooks_against_the_reference():
    assert judges.judge_ddp(_worker_results(), require_cuda=True)[0]
    ok_, message = judges.judge_ddp(_worker_results(bf16_err=0.05), require_cuda=True)
    assert not ok_ and "bf16 gradient error 5.00e-02 > 0.01" in message
    ok_, message = judges.judge_ddp(_worker_results("gloo", "cpu"), require_cuda=True)
    assert not ok_ and "ran on gloo/cpu, not nccl/cuda" in message
    assert judges.judge_ddp(_worker_results("gloo", "cpu"), require_cuda=False)[0]


def test_gpu_check_needs_every_cuda_event_record_complete():
    assert judges.judge_comm_stats(_worker_results())[0]
    ok_, message = judges.judge_comm_stats(_worker_results(complete=7))
    assert not ok_ and "fp32: 7/9 records complete" in message


def test_gpu_check_wants_cuda_kernels_and_exposed_comm_in_the_report():
    report = {
        "steps": [{"step": 2, "comm_ms": 1.5, "exposed_comm_ms": 0.4}],
        "traces": [{"device": "gpu"}],
    }
    assert judges.judge_report(report, 120, require_cuda=True)[0]
    ok_, message = judges.judge_report(report, 0, require_cuda=True)
    assert not ok_ and "0 CUDA kernel(s)" in message
    no_comm = {"steps": [{"step": 2, "comm_ms": 0.0, "exposed_comm_ms": 0.0}], "traces": []}
    assert "a step with no communication" in judges.judge_report(no_comm, 5, require_cuda=False)[1]


def test_gpu_check_report_needs_both_shared_gpu_ranks_and_hta_agreement():
    report = {
        "steps": [{"rank": r, "step": 2, "comm_ms": 1.5, "exposed_comm_ms": 0.4} for r in (0, 1)],
        "traces": [{"device": "gpu"}, {"device": "gpu"}],
    }
    ours = {0: 73.3, 1: 80.0}
    judge = functools.partial(judges.judge_report, require_cuda=True, ranks=2)
    assert judge(report, 50, hta_overlap_pct={0: 73.0, 1: 80.4}, our_overlap_pct=ours)[0]
    ok_, message = judge(report, 50, hta_overlap_pct={0: 70.0, 1: 80.0}, our_overlap_pct=ours)
    assert not ok_ and "rank 0: overlap 73.3 % vs HTA's 70.0 %" in message
    one_rank = {**report, "steps": report["steps"][:1]}
    assert "steps of ranks [0], expected [0, 1]" in judge(one_rank, 50)[1]


def test_gpu_check_judges_ok_fsdp_and_overlapkit_train_on_cuda():
    fsdp = {"backend": "nccl", "fsdp": {"max_param_diff": 3e-7, "peak_forward_blocks": 2}}
    assert judges.judge_fsdp([fsdp, fsdp], require_cuda=True)[0]
    far = {**fsdp, "fsdp": {"max_param_diff": 1e-2, "peak_forward_blocks": 3}}
    ok_, message = judges.judge_fsdp([fsdp, far], require_cuda=True)
    assert not ok_ and "rank 1: parameters 1.00e-02" in message and "3 blocks" in message
    summary = {"steps_run": 20, "loss_first": 6.1, "loss_last": 4.2, "parallel": "fsdp"}
    assert judges.judge_train(summary, 300, steps=20, require_cuda=True)[0]
    ok_, message = judges.judge_train({**summary, "loss_last": 6.5}, 0, steps=20, require_cuda=True)
    assert not ok_ and "did not fall" in message and "no CUDA kernel" in message


def test_gpu_check_counts_kernel_events_in_a_trace(tmp_path):
    events = [{"cat": "kernel", "name": "ncclKernel"}, {"cat": "cpu_op"}, {"cat": "Kernel"}]
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert judges.count_kernels(path) == 2


def test_gpu_check_wants_nvml_and_an_nccl_topology():
    topo = {"world_size": 1, "library": "nccl", "domains": [{"kind": "nvlink", "ranks": [0]}]}
    view = {"name": "NVIDIA H200", "nvml": True, "nvlinks": [{}] * 18}
    assert judges.judge_topo(view, topo, require_cuda=True)[0]
    no_nvml = {"name": "NVIDIA H200", "nvml": False, "nvlinks": []}
    assert not judges.judge_topo(no_nvml, topo, require_cuda=True)[0]
    ok_, message = judges.judge_topo(None, {**topo, "library": "gloo"}, require_cuda=True)
    assert not ok_ and "NVML did not describe the GPU" in message and "'gloo'" in message


def test_gpu_check_wants_all_doctor_checks_on_the_required_backend():
    checks = [
        {"name": n, "status": PASS, "value": "v", "advice": "a", "details": {"backend": "nccl"}}
        for n in CHECK_NAMES
    ]
    assert judges.judge_doctor({"checks": checks}, backend="nccl")[0]
    assert (
        "backend 'nccl', expected 'gloo'"
        in judges.judge_doctor({"checks": checks}, backend="gloo")[1]
    )
    broken = [{**checks[0], "value": "error: RuntimeError: x"}, *checks[1:]]
    assert "broken: ['topology']" in judges.judge_doctor({"checks": broken}, backend=None)[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_gpu_check_without_cuda_skips_every_item_with_the_reason(tmp_path, capsys):
    assert check.main(["--out", str(tmp_path)]) == check.SKIPPED
    out = capsys.readouterr().out
    assert out.count("SKIP") == len(check.ITEMS) and "needs an NVIDIA GPU" in out
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {v["status"] for v in summary["items"].values()} == {"SKIP"}


@pytest.mark.slow
@pytest.mark.timeout(420)  # two torchrun launches and a report command: minutes under load
def test_gpu_check_dry_run_on_cpu_runs_the_torchrun_worker_and_the_report(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu.check",
            "--allow-cpu",
            "--only",
            "ddp_nccl,comm_stats,report",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert [line.split()[:2] for line in done.stdout.splitlines()[:3]] == [
        ["PASS", "ddp_nccl"],
        ["PASS", "comm_stats"],
        ["PASS", "report"],
    ]
    assert (tmp_path / "worker_rank0.json").exists()
    assert len(list((tmp_path / "profile_2ranks").glob("*.json"))) == 2  # one trace per rank
