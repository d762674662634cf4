"""Per-step exposed communication on hand-built traces whose answers are worked out by hand.

Times in the traces are µs; the metrics are ms. Each test's comment shows the arithmetic.
"""

from __future__ import annotations

import json
import logging

import pytest

from bench.harness.synthetic_traces import TraceBuilder
from overlapkit.profiling.analysis import analyze_files, analyze_run, cross_rank

NCCL_AR = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
GEMM = "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4>(Params)"
BACKWARD = "autograd::engine::evaluate_function: MmBackward0"
AUTOGRAD_TID = 77


def _metrics(builder: TraceBuilder, tmp_path, name="rank0.1.pt.trace.json"):
    report = analyze_files([builder.write(tmp_path / name)], tmp_path)
    return {m.step: m for m in report.steps}


def _check(m, *, compute, comm, exposed, tail):
    assert m.compute_ms == pytest.approx(compute)
    assert m.comm_ms == pytest.approx(comm)
    assert m.exposed_comm_ms == pytest.approx(exposed)
    assert m.tail_ms == pytest.approx(tail)


def _gpu_step(t: TraceBuilder, backward_tid: int | None = None) -> None:
    """Compute stream 7, comm stream 20; one collective half hidden, one after the compute."""
    t.step(1, 0, 1000)
    t.kernel(GEMM, 100, 400, launch_at=50)
    t.kernel(GEMM, 450, 700, launch_at=420, launch_tid=backward_tid)
    t.kernel(NCCL_AR, 300, 600, launch_at=280, stream=20, collective="allreduce", nelems=1000)
    t.kernel(NCCL_AR, 700, 900, launch_at=690, stream=20, collective="allreduce", nelems=1000)


def _numbers(m):
    return (m.compute_ms, m.comm_ms, m.exposed_comm_ms, m.tail_ms, m.overlap_ratio, m.kinds)


def test_gpu_trace_exposed_comm_is_comm_minus_compute_kernels(tmp_path):
    t = TraceBuilder()
    _gpu_step(t)
    m = _metrics(t, tmp_path)[1]
    # compute 300 + 250; comm 300 + 200; exposed [400, 450] + [700, 900] = 250;
    # no backward in the trace: tail after the last compute before the comm ends (700) = 200.
    _check(m, compute=0.55, comm=0.5, exposed=0.25, tail=0.2)
    assert m.overlap_ratio == pytest.approx(0.5)
    assert m.kinds["all_reduce"].count == 2
    assert m.kinds["all_reduce"].nbytes == 2 * 1000 * 4
    assert m.kinds["all_reduce"].time_ms == pytest.approx(0.5)


def test_gpu_user_annotation_mirrors_are_not_counted_as_comm(tmp_path):
    with_mirrors = TraceBuilder()
    _gpu_step(with_mirrors)
    # A mirror drawn wider than its kernel, as when the CPU range outlives the launch, and the
    # mirror of the step range itself on the compute stream.
    with_mirrors._range("gpu_user_annotation", "nccl:all_reduce", 200, 950, pid=0, tid=20)
    with_mirrors._range("gpu_user_annotation", "ProfilerStep#1", 100, 1200, pid=0, tid=7)
    without = TraceBuilder()
    _gpu_step(without)
    without.events = [e for e in without.events if e.get("cat") != "gpu_user_annotation"]
    assert any(e.get("cat") == "gpu_user_annotation" for e in with_mirrors.events)
    a = _metrics(with_mirrors, tmp_path, "a.pt.trace.json")[1]
    b = _metrics(without, tmp_path, "b.pt.trace.json")[1]
    assert _numbers(a) == _numbers(b)
    assert a.comm_ms == pytest.approx(0.5)


def test_gpu_tail_starts_after_the_last_backward_kernel_not_the_optimizer(tmp_path):
    t = TraceBuilder()
    # The 450-700 kernel is launched from inside a backward op on autograd's device thread;
    # an optimizer kernel runs at 850-880, launched from the main thread.
    t.cpu_op(BACKWARD, 400, 460, tid=AUTOGRAD_TID)
    _gpu_step(t, backward_tid=AUTOGRAD_TID)
    t.kernel("void at::native::vectorized_elementwise_kernel<4>(add)", 850, 880, launch_at=840)
    m = _metrics(t, tmp_path)[1]
    # exposed [400, 450] + [700, 850] + [880, 900] = 220; tail after 700 (backward end) = 170.
    _check(m, compute=0.58, comm=0.5, exposed=0.22, tail=0.17)


def test_comm_spanning_a_step_boundary_belongs_to_the_step_that_launched_it(tmp_path):
    t = TraceBuilder()
    t.step(1, 0, 1000)
    t.step(2, 1000, 2000)
    t.kernel(GEMM, 100, 900, launch_at=50)
    t.kernel(NCCL_AR, 980, 1100, launch_at=950, stream=20, collective="allreduce", nelems=8)
    t.kernel(GEMM, 1060, 1080, launch_at=990)  # launched in step 1, runs in step 2's time
    t.kernel(GEMM, 1010, 1050, launch_at=1005)
    steps = _metrics(t, tmp_path)
    # Step 1: compute 800 + 20; comm 120; exposed [980, 1010] + [1050, 1060] + [1080, 1100]
    # = 60 (step 2's kernel hides part of it); tail after 1080 = 20.
    _check(steps[1], compute=0.82, comm=0.12, exposed=0.06, tail=0.02)
    _check(steps[2], compute=0.04, comm=0.0, exposed=0.0, tail=0.0)
    assert steps[2].overlap_ratio is None
    assert steps[2].kinds == {}


def test_a_kernel_without_a_launch_record_belongs_to_the_step_it_runs_in(tmp_path):
    t = TraceBuilder()
    t.step(1, 0, 100)
    t.step(2, 100, 200)
    t.kernel(NCCL_AR, 150, 180, stream=20, collective="allreduce")
    steps = _metrics(t, tmp_path)
    assert steps[1].comm_ms == 0
    assert steps[2].comm_ms == pytest.approx(0.03)


@pytest.mark.parametrize("metadata_on_kernel", [True, False])
def test_collective_kinds_and_bytes_come_from_nccl_metadata(tmp_path, metadata_on_kernel):
    t = TraceBuilder()
    t.step(1, 0, 1000)
    kw = {"stream": 20, "metadata_on_kernel": metadata_on_kernel}
    t.kernel(
        "ncclDevKernel_AllGather_RING_LL",
        10,
        20,
        launch_at=5,
        collective="allgather",
        nelems=1000,
        dtype="BFloat16",
        **kw,
    )
    t.kernel(
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL",
        30,
        50,
        launch_at=25,
        collective="_reduce_scatter_base",
        nelems=64,
        **kw,
    )
    t.kernel(
        "ncclDevKernel_SendRecv",
        60,
        90,
        launch_at=55,
        collective="all_to_allv",
        nelems=10,
        dtype="Half",
        **kw,
    )
    t.kernel(
        "ncclDevKernel_Broadcast_RING_LL",
        95,
        99,
        launch_at=92,
        collective="broadcast",
        nelems=3,
        **kw,
    )
    kinds = _metrics(t, tmp_path)[1].kinds
    assert {k: (v.count, v.nbytes) for k, v in kinds.items()} == {
        "all_gather": (1, 2000),
        "reduce_scatter": (1, 256),
        "all_to_all": (1, 20),
        "other": (1, 12),
    }
    assert kinds["all_to_all"].time_ms == pytest.approx(0.03)


def test_an_nccl_kernel_without_metadata_is_comm_with_unknown_bytes(tmp_path):
    t = TraceBuilder()
    t.step(1, 0, 100)
    t.kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 10, 40, launch_at=5, stream=20)
    m = _metrics(t, tmp_path)[1]
    assert m.comm_ms == pytest.approx(0.03)
    assert m.kinds["reduce_scatter"].nbytes is None


def _cpu_step(t: TraceBuilder) -> None:
    t.step(5, 0, 1000)
    t.cpu_op("aten::linear", 0, 200)
    t.cpu_op("aten::addmm", 10, 190)  # nested: counted once
    t.cpu_op("autograd::engine::evaluate_function: AddmmBackward0", 250, 500)
    t.cpu_op("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 500, 620)
    t.cpu_op("c10d::allreduce_", 540, 600)  # a grad hook's enqueue, inside AccumulateGrad
    t._range("user_annotation", "Optimizer.step#SGD.step", 850, 950, pid=t.pid, tid=t.main_tid)
    t.cpu_op("aten::add_", 860, 940)
    t.gloo("all_reduce", 560, 800, nelems=1000)
    t.gloo("all_gather", 300, 400, tid=9002, nelems=10)


def test_cpu_trace_counts_gloo_ranges_against_main_thread_ops(tmp_path):
    t = TraceBuilder(backend="gloo")
    _cpu_step(t)
    m = _metrics(t, tmp_path)[5]
    # compute [0, 200] + [250, 540] + [600, 620] + [860, 940] = 590 (the enqueue is cut out);
    # comm [300, 400] + [560, 800] = 340; [300, 400] hides behind backward; exposed
    # [560, 600] + [620, 800] = 220; backward ends at 620, so the tail is 180.
    _check(m, compute=0.59, comm=0.34, exposed=0.22, tail=0.18)
    assert m.overlap_ratio == pytest.approx(1 - 220 / 340)
    assert {k: (v.count, v.nbytes) for k, v in m.kinds.items()} == {
        "all_reduce": (1, 4000),
        "all_gather": (1, 40),
    }
    assert m.step_ms == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        # (compute_ms, comm_ms, exposed_ms, tail_ms, overlap_ratio)
        ("entirely_hidden", (0.2, 0.05, 0.0, 0.0, 1.0)),
        ("entirely_exposed", (0.15, 0.2, 0.2, 0.2, 0.0)),
        ("zero_comm", (0.2, 0.0, 0.0, 0.0, None)),
    ],
)
def test_edge_cases_hidden_exposed_and_no_comm(tmp_path, case, expected):
    t = TraceBuilder(backend="gloo")
    t.step(1, 0, 400)
    if case == "entirely_hidden":
        t.cpu_op("autograd::engine::evaluate_function: MmBackward0", 0, 200)
        t.gloo("all_reduce", 100, 150)
    elif case == "entirely_exposed":
        t.cpu_op("autograd::engine::evaluate_function: MmBackward0", 0, 100)
        t.gloo("all_reduce", 100, 300)
        t.cpu_op("aten::add_", 300, 350)
    else:
        t.cpu_op("aten::mm", 0, 200)
    m = _metrics(t, tmp_path)[1]
    got = (m.compute_ms, m.comm_ms, m.exposed_comm_ms, m.tail_ms, m.overlap_ratio)
    assert got == pytest.approx(expected)


def test_every_step_is_kept_including_the_last(tmp_path):
    t = TraceBuilder(backend="gloo")
    for n in (3, 4, 5):
        t.step(n, (n - 3) * 100, (n - 2) * 100)
        t.gloo("all_reduce", (n - 3) * 100 + 10, (n - 3) * 100 + 20)
    steps = _metrics(t, tmp_path)
    assert sorted(steps) == [3, 4, 5]
    assert steps[5].comm_ms == pytest.approx(0.01)


def test_cross_rank_names_the_slowest_rank_and_the_comm_spread(tmp_path):
    for rank, (step_end, comm_end) in enumerate([(1000, 900), (1200, 400)]):
        t = TraceBuilder(rank=rank, backend="gloo")
        t.step(7, 0, step_end)
        t.cpu_op("aten::mm", 0, 100)
        t.gloo("all_reduce", 100, comm_end)
        t.write(tmp_path / f"rank{rank}.1.pt.trace.json")
    report = analyze_run(tmp_path)
    [c] = cross_rank(report.steps)
    assert (c.step, c.ranks, c.slowest_rank) == (7, 2, 1)
    assert (c.slowest_step_ms, c.fastest_step_ms) == pytest.approx((1.2, 1.0))
    assert (c.min_comm_rank, c.max_comm_rank) == (1, 0)
    assert c.comm_spread_ms == pytest.approx(0.8 - 0.3)


def test_several_files_per_rank_are_all_analysed(tmp_path):
    for cycle, steps in enumerate([(2, 3), (8, 9)]):
        t = TraceBuilder(rank=0, backend="gloo")
        for i, n in enumerate(steps):
            t.step(n, cycle * 1e6 + i * 100, cycle * 1e6 + (i + 1) * 100)
        t.write(tmp_path / f"rank0.{cycle}.pt.trace.json")
    report = analyze_run(tmp_path)
    assert [(r.rank, r.step) for r in report.steps] == [(0, 2), (0, 3), (0, 8), (0, 9)]
    assert len(report.files) == 2
    assert report.warnings == []


def test_the_same_step_in_two_files_of_one_rank_is_kept_and_warned_about(tmp_path):
    for k in range(2):
        t = TraceBuilder(rank=0, backend="gloo")
        t.step(4, 0, 100)
        t.write(tmp_path / f"rank0.{k}.pt.trace.json")
    report = analyze_run(tmp_path)
    assert len(report.steps) == 2
    assert any("rank 0 step 4 appears in" in w for w in report.warnings)


# Bad input.


def test_a_directory_without_traces_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"no readable profiler trace .* in '.*test_a_dir"):
        analyze_run(tmp_path)


def test_the_error_points_at_subdirectories_that_hold_traces(tmp_path):
    t = TraceBuilder()
    t.step(1, 0, 10)
    (tmp_path / "run_a").mkdir()
    t.write(tmp_path / "run_a" / "rank0.1.pt.trace.json")
    with pytest.raises(ValueError, match=r"Subdirectories with traces: run_a"):
        analyze_run(tmp_path)


def test_a_missing_directory_and_a_file_are_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        analyze_run(tmp_path / "nope")
    (tmp_path / "f.json").write_text("{}")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        analyze_run(tmp_path / "f.json")


def test_non_trace_json_and_truncated_traces_are_skipped_by_name_and_the_rest_analysed(tmp_path):
    good = TraceBuilder(rank=1, backend="gloo")
    _cpu_step(good)
    good.write(tmp_path / "rank1.1.pt.trace.json")
    (tmp_path / "config.json").write_text(json.dumps({"lr": 0.1}))
    text = json.dumps(good.to_dict())
    (tmp_path / "rank0.1.pt.trace.json").write_text(text[: len(text) // 2])
    no_steps = TraceBuilder(rank=2)
    no_steps.cpu_op("aten::mm", 0, 10)
    no_steps.write(tmp_path / "rank2.1.pt.trace.json")
    report = analyze_run(tmp_path)
    assert [r.rank for r in report.steps] == [1]
    reasons = {s["file"].rsplit("/", 1)[-1]: s["reason"] for s in report.skipped}
    assert set(reasons) == {"config.json", "rank0.1.pt.trace.json", "rank2.1.pt.trace.json"}
    assert "not a profiler trace" in reasons["config.json"]
    assert "truncated" in reasons["rank0.1.pt.trace.json"]
    assert "no ProfilerStep#N" in reasons["rank2.1.pt.trace.json"]


def test_a_trace_without_distributed_info_is_rank_zero_with_a_warning(tmp_path, caplog):
    t = TraceBuilder(rank=5, distributed=False)
    t.step(1, 0, 10)
    t.write(tmp_path / "worker.1.pt.trace.json")
    with caplog.at_level(logging.WARNING, logger="overlapkit.profiling"):
        report = analyze_run(tmp_path)
    assert [r.rank for r in report.steps] == [0]
    assert any("no distributedInfo" in w and "rank 0" in w for w in report.warnings)
    assert "worker.1.pt.trace.json: no distributedInfo" in caplog.text


def test_pipeline_send_recv_is_its_own_kind_with_its_exposed_time(tmp_path):
    # A pipeline stage on gloo: gloo:send / gloo:recv ranges on the main thread (gloo records
    # point-to-point there, not on its worker threads), and a dp all-reduce.
    t = TraceBuilder(backend="gloo")
    t.step(3, 0, 1000)
    t.cpu_op("aten::linear", 100, 400)  # forward of micro-batch 0
    t.gloo("recv", 0, 100, tid=t.main_tid, nelems=64)  # waits for the previous stage: exposed
    t.gloo("send", 400, 600, tid=t.main_tid, nelems=64)  # hidden behind [450, 700]
    t.cpu_op("aten::linear", 450, 700)
    t.gloo("recv", 700, 900, tid=t.main_tid, nelems=64)  # the bubble: nothing computes
    t.gloo("all_reduce", 900, 950, nelems=16)
    kinds = _metrics(t, tmp_path)[3].kinds
    recv_send = kinds["send_recv"]
    assert (recv_send.count, recv_send.nbytes) == (3, 3 * 64 * 4)
    # comm [0, 100] + [400, 600] + [700, 900] = 500; exposed: [0, 100] + [400, 450] + [700, 900].
    assert recv_send.time_ms == pytest.approx(0.5)
    assert recv_send.exposed_ms == pytest.approx(0.35)
    assert kinds["all_reduce"].exposed_ms == pytest.approx(0.05)
    assert _metrics(t, tmp_path)[3].to_dict()["kinds"]["send_recv"]["exposed_ms"] == 0.35


def test_nccl_point_to_point_is_send_recv_and_its_all_to_all_stays_all_to_all(tmp_path):
    t = TraceBuilder()
    t.step(1, 0, 1000)
    for collective, at in (("send", 10), ("recv", 100), ("all_to_allv", 200)):
        t.kernel(
            "ncclDevKernel_SendRecv",
            at,
            at + 50,
            launch_at=at - 5,
            stream=20,
            collective=collective,
            nelems=8,
        )
    t.kernel("ncclDevKernel_SendRecv", 300, 310, launch_at=295, stream=20)  # no metadata
    kinds = _metrics(t, tmp_path)[1].kinds
    assert {k: v.count for k, v in kinds.items()} == {"all_to_all": 1, "send_recv": 3}
