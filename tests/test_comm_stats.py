"""CommRecorder: the ring buffer, completion callbacks and the layout change of DDP's rebuild."""

from __future__ import annotations

import pytest
import torch

from overlapkit.ddp.comm_stats import CommRecorder, comm_stats, register_recorder


def _step(recorder: CommRecorder, sizes: list[int], complete: bool = True):
    futures = []
    for index, nbytes in enumerate(sizes):
        future = torch.futures.Future()
        recorder.watch(recorder.launch(index, nbytes, nbytes), future)
        futures.append(future)
    recorder.end_step()
    if complete:
        for future in futures:
            future.set_result(None)
    return futures


def test_completion_is_timestamped_by_the_future_callback():
    recorder = CommRecorder()
    (future,) = _step(recorder, [100], complete=False)
    (record,) = recorder.snapshot().records
    assert record.done_ms is None and record.comm_ms is None
    future.set_result(None)
    (record,) = recorder.snapshot().records
    assert record.comm_ms is not None and record.comm_ms >= 0
    assert (record.step, record.bucket_index, record.nbytes) == (0, 0, 100)


def test_ring_buffer_keeps_the_newest_records_in_order():
    recorder = CommRecorder(capacity=5)
    for _ in range(4):
        _step(recorder, [10, 20])
    records = recorder.snapshot().records
    assert len(records) == 5
    assert [(r.step, r.bucket_index) for r in records] == [(1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]


def test_a_change_of_bucket_sizes_starts_a_new_layout_including_its_first_step():
    recorder = CommRecorder()
    _step(recorder, [300])  # DDP's iteration 0: one bucket
    for _ in range(3):
        _step(recorder, [100, 200])  # rebuilt
    stats = recorder.snapshot()
    assert [r.layout for r in stats.records] == [0, 1, 1, 1, 1, 1, 1]
    summary = stats.by_bucket()
    assert [(b.bucket_index, b.nbytes, b.steps) for b in summary] == [(0, 100, 3), (1, 200, 3)]
    assert summary[0].median_launch_offset_ms == 0
    assert summary[1].median_launch_offset_ms >= 0


def test_by_bucket_is_empty_before_anything_completes():
    recorder = CommRecorder()
    _step(recorder, [10], complete=False)
    assert recorder.snapshot().by_bucket() == []


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        CommRecorder(capacity=0)


def test_a_compiled_module_reads_the_recorder_of_the_module_it_compiles():
    # torch.compile only wraps here (OptimizedModule._orig_mod); nothing is compiled until called.
    module = torch.nn.Linear(2, 2)
    recorder = CommRecorder()
    _step(recorder, [8])
    register_recorder(module, recorder)
    assert comm_stats(torch.compile(module)) == comm_stats(module) == recorder.snapshot()
    compiled_first = torch.compile(torch.nn.Linear(2, 2))
    register_recorder(compiled_first, recorder)  # ok.ddp(torch.compile(model)) registers this
    assert comm_stats(compiled_first._orig_mod) == recorder.snapshot()


def test_comm_stats_of_anything_else_is_a_type_error_naming_what_it_takes():
    for other in (torch.nn.Linear(2, 2), [], "model"):
        with pytest.raises(TypeError, match=r"ok\.ddp\(\) \(or the module it wraps, compiled or "):
            comm_stats(other)
