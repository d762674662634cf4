"""The live monitor (``overlapkit.live``) on real steps: one 2-rank gloo launch runs
overlapkit-train's own step (``train_step``, ok.ddp on the trainer's MLP) under ``ok.LiveMonitor``
while the test fault hook (``bench.harness.slow_rank``, torch's global hooks: from outside the
loop) slows rank 1 by a sleep (a host gap), then rank 0's data loading, then rank 1's compute,
each for 15 steps (100 ms: several times the noise the monitor measures), with clean steps
between; it checks the naming, the cause, the onset and the recovery of each, and that nothing
else is named (no false positive over the clean steps). The same launch then runs
overlapkit-train's tp (``parallel=tp_dp``, ``tp_comm=sync``: functional collectives, waited in
``wait_tensor`` inside ``comm_wait``) with rank 1 late to each step, and a ``Work.wait`` inside a
``comm_wait`` block (chunked ep's form): both are counted, under their kind, once. Plus the rule
on an asymmetric layout, the device path's queue (on CPU, with stand-in events) and the config's
refusals, without a process group.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from overlapkit.live import LiveConfig, StragglerRule
from overlapkit.live.steps import BUSY, FIELDS, STEP, WAIT, WAIT_KINDS, WALL
from tests.cuda import NCCL_ONE_HOST_ENV, requires_cuda
from tests.multiproc import run_on_ranks
from tests.train_steps import TRAIN_SMALL

EVERY = 5
STEPS = 110
DELAY_MS = 100.0
TP_STEPS, TP_LATE_MS = 4, 40.0
"""The tp run: rank 1 arrives this late to each of its steps."""
TP_SMALL = [
    "parallel=tp_dp",
    "model.config.n_layer=1",
    "model.config.n_embd=32",
    "model.config.block_size=16",
    "train.batch_size=2",
    f"train.steps={TP_STEPS}",
]
SLOWED = [  # (rank, mode, first step, last step, the cause the monitor should name)
    (1, "sleep", 21, 35, "host_gap"),
    (0, "data", 51, 65, "data_loading"),
    (1, "compute", 81, 95, "compute"),
]
JITTER_MULTIPLE = 3.0
"""The delay is at least this many times the per-step noise the monitor measured itself."""


def _slowed_steps(rank: int, world_size: int, spec: str) -> dict | None:
    import torch

    from bench.harness.slow_rank import SLOW_ENV, install_slow_from_env
    from overlapkit.live import LiveMonitor
    from overlapkit.train.run.step import train_step
    from tests.train_steps import build_step

    os.environ[SLOW_ENV] = spec
    install_slow_from_env(rank)
    built = build_step(rank, *TRAIN_SMALL, "train.grad_accum=1", f"train.steps={STEPS}")
    live = LiveMonitor(LiveConfig(every=EVERY))
    exposed = []
    for step in range(1, STEPS + 1):
        train_step(
            built["par"],
            built["optimizer"],
            built["stream"],
            built["source"],
            built["train_cfg"],
            torch.device("cpu"),
            phases=live,
        )
        live.end_step(step)
        exposed.append(live.exposed_ms(1))
    live.close()
    # The slow spells are over (last step 95); the tp run's lateness is its own.
    tp, nested = _tp_waits(rank), _nested_wait(rank)
    if rank != 0:
        return None
    return {"summary": live.summary(), "exposed": exposed, "tp": tp, "nested": nested}


def _waits_by_kind(live) -> dict[str, float]:
    """The monitor's closed steps' waits per kind, ms in all."""
    from overlapkit.live.waits import KINDS

    rows = live.clock.last(live.clock.closed)
    return dict(zip(KINDS, rows[:, WAIT_KINDS].sum(axis=0).tolist(), strict=True))


def _tp_waits(rank: int) -> dict[str, float]:
    """overlapkit-train's tp=2 (sync) steps under a monitor, rank 1 late to each step."""
    import time

    import torch
    import torch.distributed as dist

    from overlapkit.live import LiveMonitor
    from overlapkit.train.run.step import train_step
    from tests.train_steps import build_step

    built = build_step(rank, *TP_SMALL, topology="cpu-gloo")
    live = LiveMonitor(LiveConfig(every=TP_STEPS))
    for step in range(1, TP_STEPS + 1):
        dist.barrier()
        if rank == 1:
            time.sleep(TP_LATE_MS / 1e3)  # outside the phases: rank 0 waits in its first tp wait
        train_step(
            built["par"],
            built["optimizer"],
            built["stream"],
            built["source"],
            built["train_cfg"],
            torch.device("cpu"),
            phases=live,
        )
        live.end_step(step)
    live.close()
    return _waits_by_kind(live)


def _nested_wait(rank: int) -> dict[str, float]:
    """One all-to-all waited as chunked ep waits (``Work.wait`` in ``comm_wait``), rank 1 late."""
    import time

    import torch
    import torch.distributed as dist

    from overlapkit.group.dim_labels import comm_wait
    from overlapkit.live import LiveMonitor

    live = LiveMonitor(LiveConfig(every=2))
    dist.barrier()
    with live.phase("forward"):
        if rank == 1:
            time.sleep(TP_LATE_MS / 1e3)
        out = torch.empty(2)
        work = dist.all_to_all_single(out, torch.ones(2), async_op=True)
        with comm_wait("all_to_all"):
            work.wait()
    live.end_step(1)
    live.stop()
    return _waits_by_kind(live)


@pytest.fixture(scope="module")
def slowed_run():
    spec = ",".join(f"{r}:{DELAY_MS:g}:{m}:{a}:{b}" for r, m, a, b, _ in SLOWED)
    return run_on_ranks(_slowed_steps, 2, spec, total_timeout_s=240)[0]


def test_each_slowed_rank_is_named_with_cause_onset_cost_and_recovery_and_nothing_else(
    slowed_run,
):
    live = slowed_run["summary"]
    named = live["stragglers"]
    print(f"noise {live['noise_ms']:.2f} ms/step, threshold {live['threshold_ms']:.2f}", named)
    assert JITTER_MULTIPLE * live["noise_ms"] <= DELAY_MS, live
    # Zero false positives: only the three slow spells are named, each once.
    assert len(named) == len(SLOWED), named
    by_onset = sorted(named, key=lambda s: s["step"])
    for s, (rank, _, first, last, cause) in zip(by_onset, SLOWED, strict=True):
        assert (s["rank"], s["cause"], s["collective"]) == (rank, cause, "all_reduce"), s
        # The change point: the first slow step (a noisy step just before it can pass for it).
        assert first - 1 <= s["step"] <= first + 2, s
        assert s["named_at"] <= first + 3 * EVERY, s  # within a few windows
        # Recovered within two windows (below the threshold for two windows in a row).
        assert s["last_step"] is not None and last - EVERY <= s["last_step"] <= last + 2 * EVERY, s
        # The others waited about the delay per step, for it.
        assert 0.5 * DELAY_MS <= s["cost_ms"] <= 1.5 * DELAY_MS, s
    assert [r["steps"] for r in live["per_rank"]] == [STEPS, STEPS]


def test_rank_0s_exposed_comm_is_its_wait_for_the_slowed_rank_every_step(slowed_run):
    # Rank 0 waits for rank 1's sleep (steps 21-35) at the all-reduce; not in clean steps.
    exposed = np.array(slowed_run["exposed"])
    slow, clean = exposed[20:35], exposed[5:20]
    assert np.median(slow) >= np.median(clean) + 0.5 * DELAY_MS, (slow, clean)


def test_tp_waits_in_wait_tensor_are_seen_under_their_kind(slowed_run):
    tp = slowed_run["tp"]
    print("tp waits (ms)", {k: round(v, 1) for k, v in tp.items()})
    # Without comm_wait in the tp collectives these would be 0: wait_tensor is a C++ op.
    assert tp["all_gather"] > 0 and tp["reduce_scatter"] > 0, tp
    # Rank 0 waits for late rank 1 in tp's collectives, about the lateness per step.
    in_tp = tp["all_gather"] + tp["reduce_scatter"]
    assert 0.5 * TP_LATE_MS * TP_STEPS <= in_tp <= 1.5 * TP_LATE_MS * TP_STEPS + 50.0, tp


def test_a_work_wait_inside_comm_wait_counts_once(slowed_run):
    nested = slowed_run["nested"]
    assert 0.5 * TP_LATE_MS <= nested["all_to_all"] <= 1.5 * TP_LATE_MS, nested
    assert sum(nested.values()) == nested["all_to_all"], nested


def _window(start: int, offsets: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Four ranks of a pipeline-like layout: each waits ``offsets`` more than rank 0 by
    structure, plus 1 ms of noise; nobody is slow."""
    rows = np.zeros((4, EVERY, len(FIELDS)))
    rows[..., STEP] = np.arange(start, start + EVERY)
    rows[..., BUSY] = 20.0 + rng.normal(0.0, 1.0, (4, EVERY))
    rows[..., WAIT] = 5.0 + offsets[:, None] + rng.normal(0.0, 1.0, (4, EVERY)).clip(-4, None)
    rows[..., WAIT_KINDS.start] = rows[..., WAIT]
    rows[..., WALL] = rows[..., BUSY] + rows[..., WAIT]
    return rows


def test_an_asymmetric_layout_is_its_own_baseline_and_a_later_delay_is_named():
    rng = np.random.default_rng(0)
    offsets = np.array([0.0, 12.0, 3.0, 25.0])  # stages that wait differently by design
    rule = StragglerRule()
    for start in range(1, 200, EVERY):
        assert rule.observe(_window(start, offsets, rng)) == [], start
    late = offsets.copy()
    late[[0, 1, 3]] += 15.0  # rank 2 arrives 15 ms late: the others wait that much more
    named = [s for start in range(200, 230, EVERY) for s in rule.observe(_window(start, late, rng))]
    assert [(s.rank, s.step) for s in named] == [(2, 200)]
    assert named[0].cost_ms == pytest.approx(15.0, abs=2.0)


class _StandInEvent:
    """A CUDA timing event on the CPU: recorded at ``now`` ms, done once ``done_until`` has
    passed it (what the device path reads of an event: ``record``, ``query``, ``elapsed_time``)."""

    now = 0.0
    done_until = float("-inf")
    created = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        type(self).created += 1
        self.at = float("nan")

    def record(self) -> None:
        self.at = type(self).now

    def query(self) -> bool:
        return self.at <= type(self).done_until

    def elapsed_time(self, end: _StandInEvent) -> float:
        assert self.query() and end.query(), "read before done: a real one would raise"
        return end.at - self.at


def _stream_wait(kind: str, stall_ms: float, nested: bool = False) -> None:
    """A ``comm_wait`` whose stream-wait stalls the (stand-in) stream ``stall_ms``."""
    from overlapkit.group.dim_labels import comm_wait

    with comm_wait(kind):
        if nested:  # a Work.wait inside chunked ep's comm_wait: the outer block counts
            with comm_wait("other"):
                pass
        _StandInEvent.now += stall_ms


def test_the_device_path_reads_done_pairs_into_their_steps_and_carries_the_rest(monkeypatch):
    """The CUDA path's bookkeeping, dry-run on the CPU with stand-in events (the device itself
    is checked by the cuda test below)."""
    import torch

    from overlapkit.live.device_waits import DeviceWaits
    from overlapkit.live.steps import StepClock
    from overlapkit.live.waits import KINDS, WaitTimer

    monkeypatch.setattr(torch.cuda, "Event", _StandInEvent)
    monkeypatch.setattr(_StandInEvent, "now", 0.0)
    monkeypatch.setattr(_StandInEvent, "done_until", float("-inf"))
    monkeypatch.setattr(_StandInEvent, "created", 0)
    timer = WaitTimer(torch.device("cuda"))
    timer.install()
    try:
        clock = StepClock(timer, 4)
        with clock.phase("forward"):
            _stream_wait("all_gather", 5.0, nested=True)  # step index 0: t 0 -> 5
        clock.close_step(1)
        _StandInEvent.now = 10.0
        with clock.phase("backward"):
            _stream_wait("reduce_scatter", 7.0)  # step index 1: t 10 -> 17
        clock.close_step(2)
        assert clock.last(2)[:, WAIT].tolist() == [0.0, 0.0]  # nothing read yet
        _StandInEvent.done_until = 6.0  # the device has passed the first pair only
        clock.settle_device_waits(since=0)
        first, second = clock.last(2)
        assert first[WAIT] == 5.0 and first[WAIT_KINDS.start + KINDS.index("all_gather")] == 5.0
        assert second[WAIT] == 0.0 and len(timer.device_waits.pending) == 1  # carried forward
        _StandInEvent.done_until = float("inf")
        clock.settle_device_waits(since=2)  # both steps gathered already: late, not lost
        third = clock.close_step(3)
        assert third[WAIT] == 7.0 and third[WAIT_KINDS.start + KINDS.index("reduce_scatter")] == 7
        assert _StandInEvent.created == 4  # two pairs; the nested wait recorded none
        with clock.phase("forward"):
            _stream_wait("all_reduce", 1.0)
        assert _StandInEvent.created == 4  # read events are recorded again
    finally:
        timer.uninstall()
    bounded = DeviceWaits(capacity=2)
    for _ in range(3):
        bounded.end(bounded.begin(0), 0)
    assert len(bounded.pending) == 2 and bounded.dropped == 1


CUDA_LATE_MS = 200.0


def _cuda_stream_wait(rank: int, world_size: int) -> dict:
    import time

    import torch
    import torch.distributed as dist

    from overlapkit.live import LiveMonitor
    from overlapkit.live.waits import KINDS
    from tests.cuda import nccl_rank_device

    device = nccl_rank_device(rank, world_size)
    live = LiveMonitor(LiveConfig(every=10), device=device)  # windows over its gloo group
    x = torch.ones(1 << 20, device=device)
    dist.all_reduce(x)  # NCCL's communicator set up, outside the timed step
    torch.cuda.synchronize()
    dist.barrier(group=live.gather_group)
    if rank == 1:
        time.sleep(CUDA_LATE_MS / 1e3)  # rank 0's all-reduce waits for this one on the GPU
    torch.cuda.set_sync_debug_mode("error")  # any host sync in here raises
    try:
        start = time.perf_counter()
        with live.phase("backward"):
            dist.all_reduce(x, async_op=True).wait()
            x.mul_(0.5)
        host_ms = (time.perf_counter() - start) * 1e3
        live.end_step(1)
        live.exposed_ms(1)  # reads what is done by now, without waiting
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    wait_ms = live.exposed_ms(1)
    by_kind = dict(zip(KINDS, live.clock.last(1)[0, WAIT_KINDS].tolist(), strict=True))
    live.close()
    return {"host_ms": host_ms, "wait_ms": wait_ms, "by_kind": by_kind}


@requires_cuda
@pytest.mark.timeout(300)
def test_on_cuda_the_stream_wait_is_timed_on_the_device_without_a_host_sync():
    first, second = run_on_ranks(
        _cuda_stream_wait,
        2,
        collective_timeout_s=60,
        total_timeout_s=240,
        env=NCCL_ONE_HOST_ENV,
        backend="nccl",
    )
    print(first, second)
    # Rank 0's host went on (the wait only made its stream wait); its stream stood still
    # until late rank 1 joined the all-reduce, and that stall is what the monitor counts.
    assert first["host_ms"] < 0.5 * CUDA_LATE_MS, first
    assert 0.5 * CUDA_LATE_MS <= first["wait_ms"] <= 2.0 * CUDA_LATE_MS, first
    assert first["by_kind"]["all_reduce"] == first["wait_ms"], first
    assert second["wait_ms"] < 0.5 * CUDA_LATE_MS, second


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("every", 1, "live.every must be >= 2"),
        ("capacity", 4, r"live.capacity \(4\) must be >= live.every \(10\)"),
        ("noise_factor", 0.0, "live.noise_factor must be > 0"),
        ("floor_ms", -1.0, "live.floor_ms must be >= 0 ms"),
    ],
)
def test_bad_live_settings_are_refused_by_name(key, value, message):
    with pytest.raises(ValueError, match=message):
        LiveConfig(**{key: value})
