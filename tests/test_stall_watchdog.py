"""A rank stuck before its collective is named by the ranks waiting for it within the stall limit.

One 2-rank gloo launch runs every path of overlapkit-train's layouts with the real wrappers and
torch's own parallel APIs: ``ok.ddp``, ``ok.fsdp``, tensor parallelism (DTensor), expert-parallel
``all_to_all_single`` and a 1F1B-free GPipe pipeline (send/recv, which gloo's Flight Recorder does
not see). In each, rank 1 stops in its forward at step ``STUCK_STEP`` until rank 0's watchdog has
named it; ``on_stall`` records the line and releases rank 1 through the store, so the next case
runs in the same processes. The diagnosis rule itself is checked on hand-built states.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlapkit as ok
from overlapkit.group.failures import default_store
from overlapkit.group.stall_diagnosis import Op, RankState, holding_back, stall_line
from overlapkit.group.stall_watchdog import (
    FLIGHT_RECORDER_ENTRIES,
    STALL_FLOOR_S,
    StallError,
    StallWatchdog,
    auto_limit_s,
    stall_message,
)
from overlapkit.train.launch.elastic import LauncherConfig
from tests.multiproc import run_on_ranks

LIMIT_S = 0.4
TIMEOUT_S = 30.0
STUCK_STEP = 3
STEPS = 4
WIDTH = 8
CASES = ("ddp", "fsdp", "tp", "ep", "pp")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` as ``train/models/moe.py`` dispatches: backward sends back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _AllToAll.apply(grad)


class _Experts(nn.Module):
    """An expert-parallel layer: tokens dispatched to the expert's rank and back."""

    def __init__(self):
        super().__init__()
        self.expert = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AllToAll.apply(self.expert(_AllToAll.apply(x)))


def _data_parallel_step(case: str, rank: int):
    """A step function for ddp, fsdp, tp and ep: forward, backward, SGD."""
    if case == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (2,))
        model = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    elif case == "fsdp":
        model = _mlp()
        model = ok.fsdp(model, blocks=[model[0], model[2]])
    else:
        model = ok.ddp(_mlp()) if case == "ddp" else _Experts()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch: torch.Tensor) -> None:
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, model


def _pipeline_step(rank: int):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage_module = _mlp()
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, _: out.square().mean())

    def step(batch: torch.Tensor) -> None:
        if rank == 0:
            schedule.step(batch)
        else:
            schedule.step(target=torch.zeros(batch.shape[0], WIDTH))

    return step, stage_module


def _stuck_until_released(store: dist.Store, key: str) -> None:
    deadline = time.monotonic() + 30
    while not store.check([key]) and time.monotonic() < deadline:
        time.sleep(0.02)


def _every_path(rank: int, world_size: int) -> list[dict]:
    store = default_store()
    found = []
    for case in CASES:
        step, model = _pipeline_step(rank) if case == "pp" else _data_parallel_step(case, rank)
        release = f"test/release/{case}"
        stuck = {"now": False}
        if rank == 1:

            def stop_here(*_, stuck=stuck, release=release) -> None:
                if stuck["now"]:
                    _stuck_until_released(store, release)

            model.register_forward_pre_hook(stop_here)
        stalls: list[StallError] = []

        def on_stall(error: StallError, stalls=stalls, release=release) -> None:
            stalls.append(error)
            store.set(release, "1")

        started = time.monotonic()
        with StallWatchdog(LIMIT_S, collective_timeout_s=TIMEOUT_S, on_stall=on_stall) as watchdog:
            for number in range(1, STEPS + 1):
                stuck["now"] = number == STUCK_STEP
                step(torch.ones(4, WIDTH) * (rank + number))
                watchdog.step(number)
        dist.barrier()
        found.append(
            {
                "case": case,
                "lines": [str(e) for e in stalls],
                "missing": [e.missing_ranks for e in stalls],
                "first": [e.first for e in stalls],
                "seconds": time.monotonic() - started,
            }
        )
    return found


@pytest.mark.timeout(120)
def test_a_stuck_rank_is_named_on_every_path_within_the_stall_limit():
    env = {"TORCH_FR_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES)}
    results = run_on_ranks(
        _every_path, 2, collective_timeout_s=TIMEOUT_S, total_timeout_s=110, env=env
    )
    waiting, stuck = results
    for case in stuck:
        assert case["lines"] == [], case  # the stuck rank waits for nobody
    for case in waiting:
        (line,) = case["lines"]
        assert case["missing"] == [(1,)] and case["first"] == [True], case
        assert line.startswith("stall: rank 0 made no progress for "), line
        assert f"after step {STUCK_STEP - 1}; rank(s) [1] never arrived: rank 1 " in line, line
        assert "now at tests/test_stall_watchdog.py:" in line and "_stuck_until_released" in line
        if case["case"] == "pp":
            assert "waiting in send/recv" in line, line
        else:
            assert " on the group [0, 1]" in line and "last seen in " in line, line
        # Named within the limit plus a poll and the answers (0.5-0.9 s on a quiet machine),
        # long before the collective timeout.
        assert case["seconds"] < TIMEOUT_S / 3, case


def _state(rank, groups=None, *, in_p2p=False, paused=False, where="train.py:1 in f"):
    return RankState(
        rank=rank, step=4, where=where, in_p2p=in_p2p, paused=paused, groups=groups or {}
    )


def _op(seq, ranks=(0, 1, 2, 3), age_s=1.0):
    return Op(name="all_reduce", ranks=ranks, seq=seq, age_s=age_s)


def test_the_chain_of_waits_is_followed_to_the_rank_that_waits_for_nobody():
    # tp groups [0,1], [2,3]; dp groups [0,2], [1,3]. Rank 3 is stuck before its tp
    # all-reduce #5; rank 2 waits there; ranks 0 and 1 finished their step and wait in the dp
    # all-reduce #3 (rank 1 on rank 3, rank 0 on rank 2, which waits in tp).
    states = {
        0: _state(0, {"tp0": _op(5, (0, 1)), "dp0": _op(3, (0, 2))}),
        1: _state(1, {"tp0": _op(5, (0, 1)), "dp1": _op(3, (1, 3))}),
        2: _state(2, {"tp1": _op(5, (2, 3)), "dp0": _op(2, (0, 2))}),
        3: _state(
            3, {"tp1": _op(4, (2, 3), age_s=2.5), "dp1": _op(2, (1, 3))}, where="x.py:9 in g"
        ),
    }
    for rank in (0, 1, 2):
        assert holding_back(states[rank], states) == [3]
    assert holding_back(states[3], states) == []
    line = stall_line(states[0], states, stalled_s=2.0, answer_s=1.2)
    assert line == (
        "stall: rank 0 made no progress for 2.0 s, waiting in all_reduce #3 on the group [0, 2] "
        "after step 4; rank(s) [3] never arrived: rank 3 last seen in all_reduce #2 on the "
        "group [1, 3] 1.0 s ago after step 4, now at x.py:9 in g"
    )


def test_silent_paused_and_arrived_ranks():
    two = (0, 1)
    me = _state(0, {"g": _op(7, two)})
    # Silent: named as such.
    line = stall_line(me, {0: me, 1: None}, stalled_s=3.0, answer_s=1.2)
    assert line is not None and line.endswith(
        "rank(s) [1] never arrived: rank 1 did not answer within 1.2 s (frozen, or its process "
        "is gone)"
    )
    # Paused (a checkpoint): not a stall yet.
    paused = _state(1, {"g": _op(6, two)}, paused=True)
    assert stall_line(me, {0: me, 1: paused}, stalled_s=3.0, answer_s=1.2) is None
    # Every rank arrived: the transport is stuck, nobody to name.
    arrived = _state(1, {"g": _op(7, two)})
    assert stall_line(me, {0: me, 1: arrived}, stalled_s=3.0, answer_s=1.2) is None
    # A send/recv waits for the ranks that wait for nobody, not for those also in a send/recv.
    p2p = {r: _state(r, in_p2p=r != 2) for r in range(3)}
    assert holding_back(p2p[0], p2p) == [2]
    assert RankState.from_json(me.to_json()) == me


def test_limit_rule_and_refusals():
    assert auto_limit_s(None, 300) == 150  # before the first step: half the timeout
    assert auto_limit_s(0.2, 300) == STALL_FLOOR_S
    assert auto_limit_s(6.0, 300) == 60
    assert auto_limit_s(9.0, 300) == 90
    assert auto_limit_s(100.0, 300) == 150
    assert auto_limit_s(1.0, 40) == 20  # the cap wins over the floor
    assert stall_message("StallError: stall: rank 0 ...") == "stall: rank 0 ..."
    assert stall_message({"message": "StallError: stall: x", "extraInfo": {}}) == "stall: x"
    assert stall_message("RuntimeError: boom") is None
    for bad in (300.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"launcher.stall_limit_s must be null .* got "):
            LauncherConfig(stall_limit_s=bad)
    assert LauncherConfig(stall_limit_s=0).stall_limit_s == 0  # off


@pytest.mark.timeout(240)
def test_overlapkit_train_ends_with_the_stall_line_and_a_non_zero_exit(tmp_path):
    """The real ``overlapkit-train`` on pp_dp (1F1B send/recv): rank 1 stops in step 3's
    forward, stopped from outside the loop by ``tests.faults``; rank 0 names it after
    ``launcher.stall_limit_s`` and the run ends with that one line, long before the timeout."""
    from tests.faults import STALL_ENV, WORKER_INIT
    from tests.test_train_e2e import _start, kill_tree

    args = [
        "parallel=pp_dp",
        "train.steps=4",
        "train.grad_accum=2",
        "train.checkpoint_every=0",
        "launcher.stall_limit_s=1",
        "launcher.collective_timeout_s=120",
        f"launcher.worker_init=[{WORKER_INIT}]",
    ]
    proc = _start(args, tmp_path, env={STALL_ENV: "1:3"})
    try:
        out, err = proc.communicate(timeout=200)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode != 0, out + err
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("overlapkit-train: error: stall: rank 0 made no progress for "), err
    assert "waiting in send/recv after step 2; rank(s) [1] never arrived: rank 1 last seen " in last
    assert "now at tests/faults.py:" in last, last
