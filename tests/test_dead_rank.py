"""A rank killed (SIGKILL) or stuck in the middle of backward: the survivor ends within the
collective timeout plus a short check-in grace period, with an error naming the collective, the
bucket/block and the missing rank."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

import overlapkit as ok
from overlapkit.fsdp.failed_step import FailedStep
from overlapkit.group.failures import CheckIn, check_in, describe_failure, grace_s
from tests.multiproc import RankFailure, run_on_ranks
from tests.reference import make_batches, make_mlp, shard
from tests.torch_version import requires_torch

FAULT_STEP = 2
TIMEOUT_S = 4.0
GRACE_S = 2.0
ENV = {"OVERLAPKIT_CHECKIN_GRACE_S": str(GRACE_S)}
LEFT_ENV = "OVERLAPKIT_TEST_SURVIVORS_LEFT"
"""A file a survivor creates once it has reported and left its group, so that a stalled rank
need not sleep out its whole stall (set by the tests that stall a rank)."""
# Spawn-free slack for a loaded 2-core machine: the survivor's own clock starts at its step.
MARGIN_S = 5.0
SMALL_BUCKET_MB = 0.004


def _fault(mode: str):
    """A gradient hook that kills this process, or stalls it far past the timeout, when armed."""
    armed = {"step": -1}

    def hook(_param):
        if armed["step"] != FAULT_STEP:
            return
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        # Well past the peer's timeout and grace period (so it cannot check in in time, even
        # on a loaded machine), or until the survivors have reported and left; then this rank
        # goes on and fails in turn.
        deadline = time.monotonic() + TIMEOUT_S + 2 * GRACE_S + 4
        left = os.environ.get(LEFT_ENV)
        while time.monotonic() < deadline and not (left and os.path.exists(left)):
            time.sleep(0.05)

    return armed, hook


def _report(error, start):
    return {
        "type": type(error).__name__,
        "message": str(error),
        "elapsed_s": time.monotonic() - start,
        "missing": getattr(error, "missing_ranks", None),
        "where": getattr(error, "where", None),
        "failed_elsewhere": getattr(error, "failed_elsewhere", None),
        "cause": type(error.__cause__).__name__,
    }


def _train_until_failure(rank, step_fn, mlp, mode, world_size=2, after_failure=None):
    """Run steps; rank 1 faults in the middle of backward at ``FAULT_STEP``; report the error.

    The fault fires when the gradient of the second-to-last layer's output arrives: the last
    layer's gradients (and their collectives) are done, the earlier layers' are not. Each rank
    trains on its slice of a batch split ``world_size`` ways. ``after_failure()`` runs on the
    survivors before the report's ``exit_s``: when the process group is destroyed, which waits
    for its pending work.
    """
    armed, hook = _fault(mode)
    if rank == 1:

        def watch_output(_module, _inputs, output):
            output.register_hook(hook)

        mlp[-3].register_forward_hook(watch_output)
    for step, batch in enumerate(make_batches(FAULT_STEP + 2, world_size)):
        armed["step"] = step
        start = time.monotonic()
        try:
            step_fn(shard(batch, rank % world_size, world_size))
        except Exception as error:  # what the user's loop would see
            report = _report(error, start) | {"step": step}
            if after_failure is not None:
                report |= after_failure()
            report |= {"exit_s": _destroy_group_after(start)}
            if os.environ.get(LEFT_ENV):
                open(os.environ[LEFT_ENV], "w").close()
            return report
    return None


def _destroy_group_after(start):
    gc.collect()  # a DDP reducer must go before its group (see overlapkit.workers.local_ranks)
    dist.destroy_process_group()
    return time.monotonic() - start


def _bucketer_run(rank, world_size, mode, process_group=None):
    # 8 buckets, all pending on rank 1's peer when rank 1 stalls.
    model = make_mlp(layers=9)
    bucketer = ok.GradBucketer(model, bucket_mb=SMALL_BUCKET_MB, process_group=process_group)

    def step(batch):
        x, y = batch
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        bucketer.wait()

    def grads_left():
        return {"grads_left": [n for n, p in model.named_parameters() if p.grad is not None]}

    report = _train_until_failure(rank, step, model, mode, after_failure=grads_left)
    return report and report | {"buckets": bucketer.num_buckets}


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _DDPRun:
    """``ok.ddp`` + SGD with momentum on its own group; steps as a user's loop would."""

    def __init__(self, rank, world_size, **ddp_kwargs):
        self.rank, self.world_size = rank, world_size
        self.mlp = make_mlp()
        group = dist.new_group(list(range(world_size)))
        self.model = ok.ddp(self.mlp, bucket_mb=SMALL_BUCKET_MB, process_group=group, **ddp_kwargs)
        self.opt = torch.optim.SGD(self.mlp.parameters(), lr=0.1, momentum=0.9)
        self.before = _params(self.mlp)

    def step(self, batch):
        x, y = batch
        self.before = _params(self.mlp)
        self.opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()

    def fail_then_step_and_retry(self, batch=None):
        """Run a step that fails (or report the one that just failed), then do what a retry loop
        or a framework's error handler may do: ``optimizer.step()``, and the next step."""
        report = {}
        if batch is not None:
            start = time.monotonic()
            try:
                self.step(batch)
                return {"type": None}  # it did not fail
            except Exception as error:
                report = _report(error, start)
        report["grads"] = [p.grad for p in self.mlp.parameters()]
        self.opt.step()  # the error was caught: must not apply this rank's own gradients
        report["params"] = _params(self.mlp)
        report["params_unchanged"] = all(
            torch.equal(report["params"][n], self.before[n]) for n in self.before
        )
        try:
            self.step(_shard_of(self.rank, self.world_size))
            report["retry"] = None
        except Exception as error:
            report["retry"] = f"{type(error).__name__}: {error}"
        return report


def _shard_of(rank, world_size):
    return shard(make_batches(1, world_size, seed=7)[0], rank, world_size)


def _ddp_run(rank, world_size, mode):
    """Three ``ok.ddp`` models on groups of their own; rank 1 dies in the first one's backward.

    The survivors then run the first step of the others: ``find_unused_parameters=True`` (DDP
    also waits for its own all-reduce of the used-parameter map) and ``static_graph=True`` (the
    first step's hooks run inside DDP's own end-of-backward callback).
    """
    default = _DDPRun(rank, world_size)
    unused = _DDPRun(rank, world_size, find_unused_parameters=True)
    static = _DDPRun(rank, world_size, static_graph=True)

    def after_failure():
        # Five more failures, each waiting the grace period for the dead rank, must end within
        # the harness's patience (one collective timeout after the death); the survivors meet
        # each failure within milliseconds of each other.
        os.environ["OVERLAPKIT_CHECKIN_GRACE_S"] = "0.5"
        return {
            "default": default.fail_then_step_and_retry(),
            "find_unused": unused.fail_then_step_and_retry(_shard_of(rank, world_size)),
            "static_first_step": static.fail_then_step_and_retry(_shard_of(rank, world_size)),
        }

    return _train_until_failure(rank, default.step, default.mlp, mode, world_size, after_failure)


class _FSDPRun:
    """``ok.fsdp`` + SGD with momentum; steps as a user's loop would; rank 1 faults."""

    def __init__(self, rank, world_size, **fsdp_kwargs):
        self.rank, self.world_size = rank, world_size
        self.model = ok.fsdp(make_mlp(), blocks=nn.Linear, **fsdp_kwargs)
        self.params = list(self.model.parameters())  # the sharded ones, as the optimizer holds
        self.opt = torch.optim.SGD(self.params, lr=0.1, momentum=0.9)
        self.before = self._shards()

    def _shards(self):
        """This rank's shards of the parameters and of the momentum buffers."""
        momentum = [self.opt.state[p]["momentum_buffer"] for p in self.params if self.opt.state[p]]
        return [t.to_local().detach().clone() for t in self.params + momentum]

    def _unchanged(self):
        now = self._shards()
        return len(now) == len(self.before) and all(map(torch.equal, now, self.before))

    def step(self, batch):
        x, y = batch
        self.before = self._shards()
        self.opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()

    def after_failure(self):
        """What a retry loop may do after catching the error: ``optimizer.step()``, which must
        apply nothing, then the next step, which must fail again, and ``optimizer.step()``."""
        report = {"grads_left": [i for i, p in enumerate(self.params) if p.grad is not None]}
        self.opt.step()
        report["unchanged"] = self._unchanged()
        report["params"] = [p.to_local().detach().clone() for p in self.params]
        os.environ["OVERLAPKIT_CHECKIN_GRACE_S"] = "0.5"  # each retry's check-in waits too
        try:
            self.step(_shard_of(self.rank % 2, 2))
            report["retry"] = None  # the step "succeeded" with a rank dead
        except Exception as error:
            report["retry"] = f"{type(error).__name__}: {error}"
        self.opt.step()
        report["unchanged_after_retry"] = self._unchanged()
        return report

    def run(self, mode):
        return _train_until_failure(
            self.rank, self.step, self.model, mode, after_failure=self.after_failure
        )


def _fsdp_run(rank, world_size, mode):
    return _FSDPRun(rank, world_size, prefetch=1).run(mode)


def _fsdp_own_reduce_scatter_run(rank, world_size, mode):
    # Not resharded after forward: backward's only collectives are the reduce-scatters.
    run = _FSDPRun(
        rank, world_size, prefetch=1, overlap_reduce_scatter=False, reshard_after_forward=False
    )
    return run.run(mode)


def _hsdp_run(rank, world_size, mode):
    """HSDP on a planned 2x2 (dp_replicate x dp_shard) mesh with FSDP2's own reduce-scatter."""
    placement = ok.plan(ok.load_topology("cpu-gloox2"), dp_shard=2)
    mesh = placement.device_mesh("cpu")["dp_replicate", "dp_shard"]
    run = _FSDPRun(rank, world_size, prefetch=0, mesh=mesh, reshard_after_forward=False)
    return {
        "report": run.run(mode),
        "replicas": placement.groups("dp_replicate"),
        "shards": placement.groups("dp_shard"),
    }


def _planned_mesh_run(rank, world_size, mode):
    """GradBucketer over the dp group of a planned 2x2 (dp x tp) mesh; rank 1 faults."""
    placement = ok.plan(ok.load_topology("cpu-gloox2"), tp=2)
    mesh = placement.device_mesh("cpu")
    report = _bucketer_run(rank, world_size, mode, process_group=mesh["dp"].get_group())
    return {"report": report, "dp_groups": placement.groups("dp")}


def _survivor_report(fn):
    """Rank 0's report after rank 1 of two was killed; the harness must report the death."""
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(fn, 2, "kill", collective_timeout_s=TIMEOUT_S, env=ENV)
    assert "rank 1 returned nothing: killed by signal 9" in str(failure.value)
    assert 0 in failure.value.results, str(failure.value)
    report = failure.value.results[0]
    assert report is not None and report["step"] == FAULT_STEP, report
    return report


@contextlib.contextmanager
def _stall_env():
    """``ENV`` with a fresh path for the survivors' file (``LEFT_ENV``), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="ovk-dead-rank-") as scratch:
        yield ENV | {LEFT_ENV: os.path.join(scratch, "left")}


@pytest.fixture(scope="module")
def planned_mesh_stall():
    """Rank 1's peer in the dp group of a planned 2x2 (dp x tp) mesh of four ranks, after rank
    1 stalled in the bucketer's backward: the peer, its report and the group."""
    # Without the planner setting it, the dp group of the mesh waits torch's 30 minutes.
    with _stall_env() as env:
        results = run_on_ranks(
            _planned_mesh_run,
            4,
            "stall",
            collective_timeout_s=TIMEOUT_S,
            env=env,
            total_timeout_s=60,
        )
    (group,) = [g for g in results[0]["dp_groups"] if 1 in g]
    (peer,) = set(group) - {1}
    return peer, results[peer]["report"], list(group)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_bucketer_survivor_names_all_reduce_bucket_and_missing_rank(request, mode):
    if mode == "kill":
        peer, report, group = 0, _survivor_report(_bucketer_run), [0, 1]
    else:  # the planned mesh's launch: its dp group is a group of the mesh, not the default
        peer, report, group = request.getfixturevalue("planned_mesh_stall")
    assert report is not None and report["step"] == FAULT_STEP, report
    assert report["type"] == "CollectiveFailure"
    assert re.search(
        rf"ok\.GradBucketer: all_reduce of bucket \d+ \(step {FAULT_STEP}\) failed on rank "
        rf"{peer}: rank\(s\) \[1\] of the group {re.escape(str(group))} never checked in",
        report["message"],
    ), report["message"]
    assert report["missing"] == (1,)
    # No un-averaged local gradient is left for a caller who catches the error and steps.
    assert report["grads_left"] == []
    assert report["elapsed_s"] < TIMEOUT_S + GRACE_S + MARGIN_S
    # The other pending buckets do not each wait a timeout: the process can exit at once.
    assert report["buckets"] >= 8
    assert report["exit_s"] < TIMEOUT_S + GRACE_S + MARGIN_S
    if mode == "stall":
        # A stuck peer is only noticed at the collective timeout.
        assert report["elapsed_s"] >= TIMEOUT_S * 0.9


@pytest.fixture(scope="module")
def ddp_survivors():
    """Ranks 0 and 2 of three, after rank 1 was SIGKILLed in the middle of ``ok.ddp``'s backward."""
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_ddp_run, 3, "kill", collective_timeout_s=TIMEOUT_S, env=ENV)
    assert "rank 1 returned nothing: killed by signal 9" in str(failure.value)
    assert sorted(failure.value.results) == [0, 2], str(failure.value)
    for report in failure.value.results.values():
        assert report is not None and report["step"] == FAULT_STEP, report
    return failure.value.results


@pytest.mark.slow
def test_ddp_survivor_names_every_failed_bucket_and_the_missing_rank(ddp_survivors):
    for rank, report in ddp_survivors.items():
        # The same type as the other wrappers', not DDP's RuntimeError holding its text.
        assert report["type"] == "CollectiveFailure", report["message"]
        assert report["missing"] == (1,)
        assert report["cause"] == "RuntimeError"  # the backend's error
        # Rank 1 died before its first bucket was ready: both of the step's buckets failed.
        assert report["where"] == "buckets 0, 1"
        assert re.search(
            rf"ok\.ddp: all_reduce of buckets 0, 1 \(step {FAULT_STEP}\) failed on rank {rank}: "
            r"rank\(s\) \[1\] of the group \[0, 1, 2\] never checked in within 2 s",
            report["message"],
        ), report["message"]
        assert report["elapsed_s"] < TIMEOUT_S + GRACE_S + MARGIN_S


@pytest.mark.slow
@pytest.mark.parametrize("model", ["default", "find_unused", "static_first_step"])
def test_ddp_failure_drops_the_gradients_so_a_caught_step_keeps_the_replicas_equal(
    ddp_survivors, model
):
    reports = [ddp_survivors[rank][model] for rank in (0, 2)]
    for report in reports:
        assert "grads" in report, report  # the step failed
        assert all(g is None for g in report["grads"])
        assert report["params_unchanged"]  # optimizer.step() after the error changed nothing
    # Each rank's own un-averaged gradients would have moved the replicas apart.
    for name, value in reports[0]["params"].items():
        assert torch.equal(value, reports[1]["params"][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("model", ["default", "find_unused", "static_first_step"])
def test_ddp_step_after_a_failure_raises_collective_failure_again(ddp_survivors, model):
    for rank in (0, 2):
        report = ddp_survivors[rank][model]
        if model != "default":  # the survivors' first step on that group, after the death
            assert report["type"] == "CollectiveFailure", report["message"]
            assert 1 in report["missing"]
            assert re.search(
                rf"ok\.ddp: all_reduce of (buckets 0, 1|bucket 0) \(step 0\) failed on rank "
                rf"{rank}: rank\(s\) \[[\d, ]+\] of the group \[0, 1, 2\] never checked in",
                report["message"],
            ), report["message"]
        # Not DDP's "Expected to have finished reduction in the prior iteration".
        retry_step = FAULT_STEP + 1 if model == "default" else 1
        assert report["retry"].startswith("CollectiveFailure: ok.ddp: all_reduce of "), report
        assert f"(step {retry_step}) failed on rank {rank}" in report["retry"], report["retry"]


@pytest.fixture(scope="module")
def fsdp_survivors():
    """Rank 0 of two, after rank 1 was SIGKILLed in the middle of ``ok.fsdp``'s backward."""
    return {0: _survivor_report(_fsdp_run)}


@pytest.fixture(scope="module")
def fsdp_own_reduce_scatter_survivors():
    """The same with FSDP2's own reduce-scatter (``overlap_reduce_scatter=False``)."""
    return {0: _survivor_report(_fsdp_own_reduce_scatter_run)}


@pytest.fixture(scope="module")
def hsdp_survivors():
    """Ranks 0, 2 and 3 of an HSDP 2x2 mesh, after rank 1 was SIGKILLed in backward."""
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(
            _hsdp_run, 4, "kill", collective_timeout_s=TIMEOUT_S, env=ENV, total_timeout_s=90
        )
    results = failure.value.results
    assert sorted(results) == [0, 2, 3], str(failure.value)
    return results


@pytest.mark.slow
def test_fsdp_survivor_names_collective_block_and_missing_rank(fsdp_survivors):
    report = fsdp_survivors[0]
    assert report["type"] == "CollectiveFailure"
    assert re.search(
        rf"ok\.fsdp: (all_gather|reduce_scatter) of (block \d \('\d'\)|the root) "
        rf"\(step {FAULT_STEP}\) failed on rank 0: rank\(s\) \[1\] of the group \[0, 1\] "
        "never checked in",
        report["message"],
    ), report["message"]
    assert report["missing"] == (1,)
    assert report["elapsed_s"] < TIMEOUT_S + GRACE_S + MARGIN_S


def _assert_fsdp_failure(report, collective, group):
    assert report is not None and report["step"] == FAULT_STEP, report
    assert report["type"] == "CollectiveFailure", report["message"]
    assert re.search(
        rf"ok\.fsdp: {collective} of block \d \('\d'\) \(step {FAULT_STEP}\) failed on rank "
        rf"\d: rank\(s\) \[1\] of the group {re.escape(str(list(group)))} never checked in",
        report["message"],
    ), report["message"]
    assert report["missing"] == (1,)
    assert report["elapsed_s"] < TIMEOUT_S + GRACE_S + MARGIN_S


@pytest.mark.slow
def test_fsdp_with_its_own_reduce_scatter_names_the_block_and_step(
    fsdp_own_reduce_scatter_survivors,
):
    # overlap_reduce_scatter=False (like prefetch=0): FSDP2's reduce-scatter, explained.
    _assert_fsdp_failure(fsdp_own_reduce_scatter_survivors[0], "reduce_scatter", [0, 1])


@pytest.mark.slow
def test_hsdp_reduce_scatter_and_all_reduce_across_replicas_name_the_block_and_step(
    hsdp_survivors,
):
    results = hsdp_survivors
    (shards,) = [g for g in results[0]["shards"] if 1 in g]
    (replicas,) = [g for g in results[0]["replicas"] if 1 in g]
    (shard_peer,) = set(shards) - {1}
    (replica_peer,) = set(replicas) - {1}
    _assert_fsdp_failure(results[shard_peer]["report"], "reduce_scatter", shards)
    _assert_fsdp_failure(results[replica_peer]["report"], "all_reduce", replicas)
    # The fourth rank shares no group with the dead one. Its all-reduce across replicas failed
    # because its replica peer (the dead rank's shard peer) stopped at its own reduce-scatter:
    # that peer is alive and is named so, not as "dead or stuck".
    (other,) = set(results) - {shard_peer, replica_peer}
    report = results[other]["report"]
    assert report is not None and report["type"] == "CollectiveFailure", report
    assert report["missing"] == ()
    assert list(report["failed_elsewhere"]) == [shard_peer]
    what = rf"reduce_scatter of block \d \('\d'\) on the group {re.escape(str(list(shards)))}"
    assert re.fullmatch(what, report["failed_elsewhere"][shard_peer]), report["failed_elsewhere"]
    assert "never checked in" not in report["message"] and "dead" not in report["message"]
    assert re.search(
        rf"ok\.fsdp: all_reduce of block \d \('\d'\) \(step {FAULT_STEP}\) failed on rank "
        rf"{other}: no rank of the group {re.escape(str(sorted([other, shard_peer])))} is "
        rf"missing: rank\(s\) \[{shard_peer}\] are alive but never reached this collective, "
        rf"because one of theirs failed first \(rank {shard_peer} failed first in {what}\)",
        report["message"],
    ), report["message"]


FSDP_RUNS = ["fsdp_survivors", "fsdp_own_reduce_scatter_survivors", "hsdp_survivors"]


def _fsdp_reports(request, run):
    survivors = request.getfixturevalue(run)
    return {rank: r.get("report", r) for rank, r in survivors.items()}


@pytest.mark.slow
@pytest.mark.parametrize("run", FSDP_RUNS)
def test_fsdp_failure_drops_the_gradients_so_a_caught_step_changes_nothing(request, run):
    reports = _fsdp_reports(request, run)
    for rank, report in reports.items():
        assert report["type"] == "CollectiveFailure", report["message"]
        # Before: the blocks whose reduction finished kept averaged gradients, and the block
        # whose asynchronous reduce-scatter failed a view of a buffer it never filled.
        assert report["grads_left"] == [], (rank, report["grads_left"])
        # optimizer.step() after the error left parameters and momentum as before the step.
        assert report["unchanged"], rank
    if run == "hsdp_survivors":
        # The replicas of a shard that both survived still hold the same parameters.
        (pair,) = [g for g in request.getfixturevalue(run)[0]["replicas"] if 1 not in g]
        for a, b in zip(reports[pair[0]]["params"], reports[pair[1]]["params"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.slow
@requires_torch("2.13", "FSDPModule.reset_iter_state; before it the retry is refused")
@pytest.mark.parametrize("run", FSDP_RUNS)
def test_fsdp_step_after_a_failure_resets_fsdp2_and_fails_again(request, run):
    for rank, report in _fsdp_reports(request, run).items():
        # Before: FSDP2's modules stayed in PRE_BACKWARD, so the HSDP survivors' retry ran a
        # step that reduced nothing and raised nothing.
        assert report["retry"] is not None, rank
        assert report["retry"].startswith("CollectiveFailure: ok.fsdp: "), report["retry"]
        # The retry's own collectives (step 3) or, when one was still in flight, the failed
        # step's prefetched all-gather, which the reset waits for (step 2).
        assert re.search(
            rf"\(step ({FAULT_STEP}|{FAULT_STEP + 1})\) failed on rank {rank}:", report["retry"]
        ), report["retry"]
        assert report["unchanged_after_retry"], rank


@pytest.mark.slow
def test_planned_mesh_groups_time_out_like_the_default_group_not_after_30_min(
    planned_mesh_stall,
):
    _, report, _ = planned_mesh_stall
    assert report is not None and report["step"] == FAULT_STEP, report
    assert report["type"] == "CollectiveFailure"
    assert report["missing"] == (1,), report["message"]
    assert TIMEOUT_S * 0.9 <= report["elapsed_s"] < TIMEOUT_S + GRACE_S + MARGIN_S


# -- the check-in and the message, without processes ------------------------------------------
def _store():
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)


def test_check_in_names_the_ranks_that_never_checked_in_after_the_grace_period():
    store = _store()
    store.set("t/1", "1")
    start = time.monotonic()
    assert check_in(store, "t", 0, [0, 1, 2], grace=0.3) == CheckIn((2,))
    assert time.monotonic() - start >= 0.3
    # Once everyone has checked in there is nothing to wait for.
    store.set("t/2", "1")
    start = time.monotonic()
    assert check_in(store, "t", 0, [0, 1, 2], grace=30) == CheckIn(())
    assert time.monotonic() - start < 5


def test_check_in_counts_a_rank_that_failed_on_another_group_as_alive_not_missing():
    store = _store()
    # Rank 0 failed on its shard group and checked in there; rank 2's collective with rank 0,
    # on their replica group, failed in turn. Rank 3 is dead.
    store.set("shard/0", "1")
    store.set("failed/0", "reduce_scatter of block 1 on the group [0, 1]")
    start = time.monotonic()
    found = check_in(
        store, "replica", 2, [0, 2], grace=30, failed_prefix="failed", what="all_reduce"
    )
    assert found == CheckIn((), ((0, "reduce_scatter of block 1 on the group [0, 1]"),))
    assert time.monotonic() - start < 5  # nobody left to wait for
    assert store.get("failed/2") == b"all_reduce"
    found = check_in(store, "replica", 2, [0, 2, 3], grace=0.1, failed_prefix="failed")
    assert found.missing == (3,) and [r for r, _ in found.elsewhere] == [0]


def test_check_in_reports_an_unreachable_store_instead_of_ranks():
    master = _store()
    client = dist.TCPStore("127.0.0.1", master.port, 1, is_master=False)
    del master  # the store's host is gone
    found = check_in(client, "t", 0, [0, 1], grace=0.1)
    assert found.missing is None
    assert found.store_error


def test_failure_message_names_collective_bucket_step_and_missing_ranks():
    common = dict(
        caller="ok.ddp",
        collective="all_reduce",
        where="bucket 3",
        step=7,
        rank=0,
        group_ranks=[0, 1, 2],
        error=RuntimeError("Connection reset by peer\nmore"),
        grace=2.0,
    )
    text = describe_failure(missing=(2,), store_error=None, **common)
    assert text == (
        "ok.ddp: all_reduce of bucket 3 (step 7) failed on rank 0: rank(s) [2] of the group "
        "[0, 1, 2] never checked in within 2 s of the failure: dead or stuck (see their logs). "
        "Backend error: Connection reset by peer"
    )
    assert "no rank is missing" in describe_failure(missing=(), store_error=None, **common)
    elsewhere = ((1, "reduce_scatter of block 0 on the group [1, 3]"),)
    alive = describe_failure(missing=(), store_error=None, elsewhere=elsewhere, **common)
    assert "never checked in" not in alive and "dead" not in alive
    assert (
        "no rank of the group [0, 1, 2] is missing: rank(s) [1] are alive but never reached "
        "this collective, because one of theirs failed first (rank 1 failed first in "
        "reduce_scatter of block 0 on the group [1, 3])"
    ) in alive
    both = describe_failure(missing=(2,), store_error=None, elsewhere=elsewhere, **common)
    assert "rank(s) [2] of the group [0, 1, 2] never checked in" in both
    assert "; alive, but stopped at their own failure: rank 1 failed first in" in both
    gone = describe_failure(missing=None, store_error="DistNetworkError: refused", **common)
    assert "rendezvous store is unreachable (DistNetworkError: refused)" in gone


def test_grace_period_env_must_be_a_non_negative_number(monkeypatch):
    monkeypatch.setenv("OVERLAPKIT_CHECKIN_GRACE_S", "1.5")
    assert grace_s() == 1.5
    for bad in ("soon", "-1"):
        monkeypatch.setenv("OVERLAPKIT_CHECKIN_GRACE_S", bad)
        with pytest.raises(ValueError, match=f"OVERLAPKIT_CHECKIN_GRACE_S .* got '{bad}'"):
            grace_s()


@contextlib.contextmanager
def _failed_fsdp_step():
    """A one-rank ``ok.fsdp`` model after a backward, its ``FailedStep`` called: (model, step,
    batch)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = ok.fsdp(make_mlp(), blocks=nn.Linear)
        failed = FailedStep(model)
        x, y = make_batches(1, 1)[0]
        nn.functional.mse_loss(model(x), y).backward()
        assert all(p.grad is not None for p in model.parameters())
        failed()
        assert all(p.grad is None for p in model.parameters())
        yield model, failed, (x, y)
    finally:
        dist.destroy_process_group()


def test_fsdp_failed_step_drops_gradients_and_refuses_a_retry_torch_cannot_reset(monkeypatch):
    with _failed_fsdp_step() as (_model, failed, _batch):
        # As in a torch without it (2.11 has none): the retry is refused, again and again.
        monkeypatch.delattr(FSDPModule, "reset_iter_state", raising=False)
        with pytest.raises(RuntimeError, match=r"has no FSDPModule\.reset_iter_state\(\)"):
            failed.reset_if_failed()
        assert failed.reset_pending  # and the next forward refuses again


@requires_torch("2.13", "FSDPModule.reset_iter_state")
def test_fsdp_failed_step_is_reset_by_the_next_forward_where_torch_can():
    with _failed_fsdp_step() as (model, failed, (x, y)):
        failed.reset_if_failed()
        assert not failed.reset_pending
        nn.functional.mse_loss(model(x), y).backward()  # a normal step after the reset
        assert all(p.grad is not None for p in model.parameters())
