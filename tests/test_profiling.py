"""``ok.profile`` in one process: schedule, files per cycle, outputs on exit, argument errors."""

from __future__ import annotations

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import overlapkit as ok
from overlapkit.profiling.tensorboard import TAGS, scalar_dir


def _train(prof, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    x = torch.randn(16, 32)
    for _ in range(steps):
        model(x).sum().backward()
        prof.step()


def _profiler_enabled() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


def test_one_cycle_writes_one_rank_file_and_summarises_the_active_steps(tmp_path):
    with ok.profile(tmp_path, wait=1, warmup=1, active=2) as prof:
        _train(prof, 6)
    [trace] = prof.files
    assert trace.parent == tmp_path
    assert trace.name.startswith("rank0.") and trace.name.endswith(".pt.trace.json")
    rows = prof.summary()
    assert [r.step for r in rows] == [2, 3]
    for r in rows:
        assert r.rank == 0 and r.compute_ms > 0 and r.step_ms >= r.compute_ms
        assert (r.comm_ms, r.exposed_comm_ms, r.overlap_ratio) == (0, 0, None)
    assert (tmp_path / "overlap_trace" / trace.name).exists()


def test_the_profiler_is_off_once_the_schedule_is_done(tmp_path):
    with ok.profile(tmp_path, wait=0, warmup=1, active=1) as prof:
        _train(prof, 1)
        assert _profiler_enabled()
        _train(prof, 1)  # the cycle's last step: saved, then stopped
        assert not _profiler_enabled()
        _train(prof, 3)
        assert not _profiler_enabled()
    assert prof.step_num == 5
    assert len(prof.files) == 1


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")  # one file per cycle
def test_repeated_cycles_each_get_their_own_file(tmp_path):
    with ok.profile(tmp_path, wait=1, warmup=1, active=2, repeat=2, use_gzip=True) as prof:
        _train(prof, 10)
    assert len(prof.files) == 2
    assert all(p.name.endswith(".pt.trace.json.gz") for p in prof.files)
    assert [r.step for r in prof.summary()] == [2, 3, 6, 7]


def test_scalars_are_written_per_rank_with_the_overlap_tags(tmp_path):
    with ok.profile(tmp_path, wait=0, warmup=1, active=3) as prof:
        _train(prof, 4)
    events = EventAccumulator(str(scalar_dir(tmp_path, 0)))
    events.Reload()
    # overlap/ratio is undefined without communication, so it is left out here.
    assert set(events.Tags()["scalars"]) == set(TAGS) - {"overlap/ratio"}
    compute = events.Scalars("overlap/compute_ms")
    assert [e.step for e in compute] == [1, 2, 3]
    assert [e.value for e in compute] == pytest.approx([r.compute_ms for r in prof.summary()])


def test_too_few_steps_say_how_many_the_schedule_needs(tmp_path, caplog):
    with ok.profile(tmp_path, wait=2, warmup=1, active=1) as prof:
        _train(prof, 1)
        with pytest.raises(RuntimeError, match=r"no trace yet.*wait \+ warmup \+ active = 4"):
            prof.summary()
    assert "rank 0 recorded no trace: 1 steps ran, the schedule needs" in caplog.text
    assert prof.files == []


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_an_exception_in_the_loop_propagates_and_skips_the_analysis(tmp_path):
    with pytest.raises(ZeroDivisionError), ok.profile(tmp_path, wait=0, warmup=0, active=2) as p:
        _train(p, 1)
        raise ZeroDivisionError
    assert not _profiler_enabled()
    assert len(p.files) == 1  # torch still saves the cycle it was recording
    assert not (tmp_path / "overlap").exists()
    assert not (tmp_path / "overlap_trace").exists()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"active": 0}, ValueError, r"active must be >= 1 steps, got 0"),
        ({"wait": -1}, ValueError, r"wait must be >= 0 steps, got -1"),
        ({"warmup": "1"}, TypeError, r"warmup must be an int number of steps, got '1'"),
        ({"repeat": 1.5}, TypeError, r"repeat must be an int"),
        ({"active": True}, TypeError, r"active must be an int"),
    ],
)
def test_bad_schedule_arguments_name_the_value(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        ok.profile(tmp_path, **kwargs)


def test_a_bad_logdir_is_rejected():
    with pytest.raises(TypeError, match=r"logdir must be a non-empty path, got 3"):
        ok.profile(3)
