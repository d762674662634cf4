"""Auto-tuning of bucket_mb (ok.ddp, GradBucketer) and prefetch (ok.fsdp): rules and glue."""

from __future__ import annotations

import logging
import random
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlapkit as ok
from overlapkit.ddp.comm_stats import BucketCommRecord
from overlapkit.ddp.tuning import BUCKETER_DISCARD_STEPS, DDP_DISCARD_STEPS, exposed_tails
from overlapkit.ddp.tuning import MEASURE_STEPS as DDP_MEASURE_STEPS
from overlapkit.fsdp.tuning import FSDP_DISCARD_STEPS
from overlapkit.fsdp.tuning import MEASURE_STEPS as FSDP_MEASURE_STEPS
from overlapkit.tuning import decide
from overlapkit.tuning.report import Trial, TuningReport
from overlapkit.tuning.search import WARMUP_STEPS
from tests.multiproc import run_on_ranks
from tests.reference import batch_grads, grads_of, make_batches, make_mlp, params_of, shard

MiB = 1024 * 1024


def _trials(pairs):
    return [Trial(value=v, step_ms=ms, exposed_ms=None) for v, ms in pairs]


# -- pure rules ---------------------------------------------------------------------------------


def test_bucket_layout_matches_torch_bucket_assignment():
    rng = random.Random(0)
    for _ in range(30):
        numels = [rng.choice([1, 7, 256, 4096, 65536, 300_000]) for _ in range(rng.randint(1, 12))]
        cap = rng.choice([1_000, 100_000, 1 << 20, 4 << 20])
        tensors = [torch.empty(n) for n in numels]
        groups, _ = dist._compute_bucket_assignment_by_size(tensors, [cap], [False] * len(numels))
        expected = tuple(sum(numels[i] * 4 for i in g) for g in groups)
        assert decide.bucket_layout([n * 4 for n in numels], cap) == expected


def test_bucket_ladder_keeps_one_size_per_distinct_layout_up_to_one_bucket():
    # 8 layers of Linear(1024): weight 4 MiB + bias 4 KiB, reverse registration order.
    layers = [4096, 4 * MiB] * 8
    assert decide.bucket_ladder(layers) == [0.25, 8.0, 16.0, 32.0]
    layouts = [decide.bucket_layout(layers, mb * MiB) for mb in decide.bucket_ladder(layers)]
    assert len(set(layouts)) == len(layouts) and len(layouts[-1]) == 1


def test_bucket_ladder_thins_long_ladders_keeping_both_ends():
    many = [64 * 1024] * 4096  # 256 MiB in small tensors: every power of two is distinct
    ladder = decide.bucket_ladder(many, max_candidates=4)
    assert len(ladder) <= 4
    assert ladder[0] == 0.25 and ladder[-1] == 256.0


def test_ladder_tries_every_candidate_in_order_then_confirms_best_and_close_runner_up():
    candidates = [1, 2, 4, 8]
    assert decide.next_trial(candidates, []) == 1
    assert decide.next_trial(candidates, _trials([(1, 50.0), (2, 40.0)])) == 4
    done = _trials([(1, 50.0), (2, 40.0), (4, 41.0), (8, 60.0)])
    assert decide.next_trial(candidates, done) == 2  # one lucky trial must not decide
    assert decide.next_trial(candidates, done + _trials([(2, 40.5)])) == 4  # within 5 %
    final = done + _trials([(2, 40.5), (4, 41.5)])
    assert decide.next_trial(candidates, final) is None
    assert decide.decide(final)[0] == 2


def test_long_ladder_goes_coarse_first_then_refines_around_the_best():
    candidates = [0.25, 0.5, 1, 2, 4, 8, 16]
    trials = []
    times = {0.25: 90.0, 0.5: 80.0, 1: 60.0, 2: 50.0, 4: 55.0, 8: 70.0, 16: 95.0}
    while (value := decide.next_trial(candidates, trials, confirm_within=0)) is not None:
        trials += _trials([(value, times[value])])
    assert [t.value for t in trials] == [0.25, 1, 4, 16, 2]  # 8 lies beyond the slower 4
    assert decide.decide(trials)[0] == 2


def test_confirmation_repeats_at_most_two_trials_on_a_flat_curve():
    candidates = [1, 2, 4, 8]
    trials = _trials([(1, 100.0), (2, 101.0), (4, 102.0), (8, 103.0)])
    noisy = iter([104.0, 99.0, 105.0, 98.0])
    while (value := decide.next_trial(candidates, trials)) is not None:
        trials += _trials([(value, next(noisy))])
    assert len(trials) == 4 + decide.MAX_REPEATS


def test_ladder_stops_early_after_two_clearly_slower_candidates():
    trials = _trials([(1, 30.0), (2, 50.0), (4, 60.0)])
    assert decide.next_trial([1, 2, 4, 8], trials) == 1  # 8 is skipped; the best is confirmed
    assert decide.next_trial([1, 2, 4, 8], trials + _trials([(1, 31.0)])) is None
    assert decide.decide(trials)[0] == 1


def test_decision_is_the_lowest_mean_and_breaks_ties_by_trial_order():
    chosen, reason = decide.decide(
        _trials([(2, 40.0), (1, 40.0), (4, 39.0), (4, 42.0)]), unit="MiB"
    )
    assert chosen == 2
    assert "runner-up 1MiB" in reason


def test_prefetch_memory_bound_counts_computing_plus_prefetched_blocks():
    blocks = [100, 300, 200, 50]
    assert decide.prefetch_memory_bound(blocks, 0) == 500  # backward holds 2 even at depth 0
    assert decide.prefetch_memory_bound(blocks, 1) == 500
    assert decide.prefetch_memory_bound(blocks, 2) == 600
    assert decide.prefetch_memory_bound(blocks, 1, reshard_after_forward=False) == 650
    assert decide.prefetch_candidates(blocks, None) == [0, 1, 2]
    assert decide.prefetch_candidates(blocks, 599) == [0, 1]


def test_max_memory_below_any_prefetch_names_the_value_and_the_need():
    with pytest.raises(ValueError, match=r"max_memory=499 bytes is below the 500 bytes"):
        decide.prefetch_candidates([100, 300, 200, 50], 499)


def test_exposed_tail_is_last_completion_after_last_launch_per_step():
    def rec(step, launch, done):
        return BucketCommRecord(
            step=step,
            layout=0,
            bucket_index=0,
            nbytes=4,
            wire_bytes=4,
            launch_ms=launch,
            done_ms=done,
        )

    records = [rec(3, 0.0, 5.0), rec(3, 8.0, 20.0), rec(3, 9.0, 15.0), rec(4, 1.0, None)]
    assert exposed_tails(records, [3, 4]) == [11.0, 0.0]


def test_report_json_and_table_show_every_trial_and_the_choice():
    report = TuningReport(
        knob="bucket_mb",
        trials=[Trial(2.0, 41.25, 3.5), Trial(8.0, 55.0, 12.0)],
        chosen=2.0,
        settled=True,
        settled_at_step=10,
        reason="fastest",
    )
    data = report.to_json()
    assert data["knob"] == "bucket_mb" and data["chosen"] == 2.0 and data["settled_at_step"] == 10
    assert data["trials"][1] == {
        "value": 8.0,
        "step_ms": 55.0,
        "exposed_ms": 12.0,
        "peak_bytes": None,
    }
    table = str(report)
    assert "settled at step 10: bucket_mb=2 MiB" in table
    assert "41.2" in table and "55.0" in table and "<- chosen" in table
    assert "still tuning" in str(TuningReport(knob="prefetch"))


# -- bad input ----------------------------------------------------------------------------------


def test_unknown_bucket_mb_string_is_rejected_with_its_value():
    with pytest.raises(ValueError, match="bucket_mb='fast'"):
        ok.ddp(make_mlp(), bucket_mb="fast")
    with pytest.raises(ValueError, match="bucket_mb='fast'"):
        ok.GradBucketer(make_mlp(), bucket_mb="fast")


def test_auto_bucket_mb_with_powersgd_is_refused():
    with pytest.raises(ValueError, match="compress='powersgd'"):
        ok.ddp(make_mlp(), bucket_mb="auto", compress="powersgd")


def test_fsdp_prefetch_and_max_memory_bad_values_name_the_value():
    with pytest.raises(ValueError, match="max_memory must be >= 0 bytes, got -1"):
        ok.fsdp(make_mlp(), prefetch="auto", max_memory=-1)
    with pytest.raises(TypeError, match="prefetch must be an int in .* or 'auto', got 'fastest'"):
        ok.fsdp(make_mlp(), prefetch="fastest")
    with pytest.raises(ValueError, match="max_memory=1000000"):
        ok.fsdp(make_mlp(), prefetch=1, max_memory=1_000_000)
    with pytest.raises(TypeError, match="max_memory must be an int"):
        ok.fsdp(make_mlp(), prefetch="auto", max_memory=1.5)


def test_tuning_report_of_an_object_not_tuned_is_a_value_error():
    with pytest.raises(ValueError, match="Sequential was not wrapped with 'auto'"):
        ok.tuning_report(make_mlp())


# -- on two gloo ranks ----------------------------------------------------------------------------

# make_mlp(hidden=512, layers=4): ladder [0.25, 2, 4] MiB (3, 2 and 1 buckets).
HIDDEN, LAYERS = 512, 4
STEPS = 24
SLOW_ON = {0: 4.0, 1: 0.25}  # rank -> bucket size (MiB) at which only that rank is slow
SLOW_S = 0.08


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _train_one(rank: int, world_size: int, kind: str) -> dict:
    lines = _Lines()
    logging.getLogger("overlapkit.tuning").addHandler(lines)
    logging.getLogger("overlapkit.tuning").setLevel(logging.INFO)
    model = make_mlp(hidden=HIDDEN, layers=LAYERS)
    if kind.startswith("ddp"):
        model = ok.ddp(
            model,
            bucket_mb="auto",
            gradient_as_bucket_view=kind == "ddp_view",
            static_graph=kind == "ddp_static",
        )
        owner, current_mb = model, lambda: model.bucket_bytes_cap / MiB
    else:
        owner = ok.GradBucketer(model, bucket_mb="auto")
        current_mb = lambda: owner.bucket_mb  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads, params, early = [], [], None
    for step, batch in enumerate(make_batches(STEPS, world_size)):
        x, y = shard(batch, rank, world_size)
        params.append(params_of(model))
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        if current_mb() == SLOW_ON[rank]:
            time.sleep(SLOW_S)
        loss.backward()
        if kind == "bucketer":
            owner.wait()
        grads.append(grads_of(model))
        opt.step()
        if step == 3:
            early = ok.tuning_report(owner)
    report = ok.tuning_report(owner)
    idle = owner._reducer._step_end_hooks if kind == "bucketer" else owner._forward_pre_hooks
    return {
        "grads": grads,
        "params": params,
        "report": report.to_json(),
        "early": early.to_json(),
        "current_mb": current_mb(),
        "left_behind": len(idle),
        "log": lines.lines,
    }


def _train_bucket_auto(rank: int, world_size: int) -> dict:
    """ok.ddp and GradBucketer, one after the other in one spawn (a spawn costs seconds)."""
    runs = {}
    for kind in ("ddp", "ddp_view", "ddp_static", "bucketer"):
        runs[kind] = _train_one(rank, world_size, kind)
        logging.getLogger("overlapkit.tuning").handlers.clear()
    return runs


@pytest.fixture(scope="module")
def bucket_runs():
    return run_on_ranks(_train_bucket_auto, 2, total_timeout_s=170)


def _check_bucket_auto(runs, kind: str, steps_per_trial: int, first_step: int) -> None:
    per_rank = [r[kind] for r in runs]
    reports = [r["report"] for r in per_rank]
    # Local timings differed (each rank was slow at another size) yet every rank saw the same
    # combined trials and made the same choice: the size that was fast on both.
    assert reports[0] == reports[1]
    report = reports[0]
    assert report["settled"] and report["chosen"] == 2.0
    # The ladder, then the best measured once more (it had a single trial).
    assert [t["value"] for t in report["trials"]] == [0.25, 2.0, 4.0, 2.0]
    for t in report["trials"]:
        assert (t["step_ms"] > SLOW_S * 1e3) == (t["value"] in SLOW_ON.values())
        assert t["exposed_ms"] is not None and t["exposed_ms"] >= 0
    assert report["settled_at_step"] == first_step + WARMUP_STEPS + 4 * steps_per_trial
    assert per_rank[0]["early"]["settled"] is False and per_rank[0]["early"]["chosen"] is None
    for r in per_rank:
        assert r["current_mb"] == 2.0
        assert not r["left_behind"]  # no hook or tuner left once settled
    assert len(per_rank[0]["log"]) == 1 and "bucket_mb=2 MiB" in per_rank[0]["log"][0]
    assert per_rank[1]["log"] == []
    # Every step, during tuning and after it, averaged gradients exactly like one process on the
    # same parameters (not along a 24-step trajectory of its own, whose rounding differs).
    one_process = make_mlp(hidden=HIDDEN, layers=LAYERS)
    batches = make_batches(STEPS, 2)
    for r in per_rank:
        for step, (got, params, batch) in enumerate(
            zip(r["grads"], r["params"], batches, strict=True)
        ):
            want = batch_grads(one_process, params, batch, world_size=2)
            for name, g in want.items():
                torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-7, msg=f"{step} {name}")


@pytest.mark.slow
def test_ddp_auto_bucket_mb_agrees_across_ranks_settles_and_keeps_gradients_exact(bucket_runs):
    _check_bucket_auto(bucket_runs, "ddp", DDP_DISCARD_STEPS + DDP_MEASURE_STEPS, first_step=0)


@pytest.mark.slow
def test_ddp_auto_bucket_mb_with_gradients_as_bucket_views_keeps_gradients_exact(bucket_runs):
    # Each new reducer must adopt the gradients that live in the previous reducer's buckets.
    _check_bucket_auto(bucket_runs, "ddp_view", DDP_DISCARD_STEPS + DDP_MEASURE_STEPS, first_step=0)


@pytest.mark.slow
def test_ddp_auto_bucket_mb_with_static_graph_keeps_gradients_exact(bucket_runs):
    # Each new reducer's first step is static_graph's delayed all-reduce of every gradient;
    # before DDP's Python side was told so, no gradient was reduced after the first switch.
    _check_bucket_auto(
        bucket_runs, "ddp_static", DDP_DISCARD_STEPS + DDP_MEASURE_STEPS, first_step=0
    )


@pytest.mark.slow
def test_bucketer_auto_bucket_mb_agrees_across_ranks_settles_and_keeps_gradients_exact(
    bucket_runs,
):
    _check_bucket_auto(
        bucket_runs, "bucketer", BUCKETER_DISCARD_STEPS + DDP_MEASURE_STEPS, first_step=1
    )


FSDP_WIDTH, FSDP_BLOCKS, FSDP_STEPS = 64, 4, 16
# How much slower depth 0 is made on rank 0. An FSDP step issues a collective per block and
# direction, each waiting for both ranks to be scheduled: under load the depth-1 trial's median
# step was once more than SLOW_S (80 ms) above depth 0's, so the tuner kept depth 0 ([0, 1, 0]).
FSDP_SLOW_S = 0.4
BLOCK_BYTES = FSDP_WIDTH * (FSDP_WIDTH + 1) * 4
MAX_MEMORY = 2 * BLOCK_BYTES + BLOCK_BYTES // 2  # fits prefetch 0 and 1, not 2


def _blocks_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(FSDP_WIDTH, FSDP_WIDTH), nn.Tanh()) for _ in range(FSDP_BLOCKS)]
    )


def _fsdp_batches(world_size: int):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4 * world_size, FSDP_WIDTH, generator=g) for _ in range(FSDP_STEPS)]


def _train_fsdp_auto(rank: int, world_size: int) -> dict:
    model = ok.fsdp(_blocks_model(), prefetch="auto", max_memory=MAX_MEMORY)
    hooks_while_tuning = len(model._forward_pre_hooks)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in _fsdp_batches(world_size):
        x = batch[rank * 4 : (rank + 1) * 4]
        loss = model(x).pow(2).mean()
        if rank == 0 and ok.fsdp_stats(model).prefetch == 0:
            time.sleep(FSDP_SLOW_S)  # only rank 0 finds depth 0 slow
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    stats = ok.fsdp_stats(model)
    return {
        "report": ok.tuning_report(model).to_json(),
        "prefetch": stats.prefetch,
        "peaks": [s.peak_bytes for s in stats.steps],
        "hooks_removed": hooks_while_tuning - len(model._forward_pre_hooks),
        "params": {n: p.full_tensor() for n, p in model.named_parameters()},
    }


@pytest.mark.slow
@pytest.mark.timeout(480)  # over 180 s once beside two busy processes and other jobs (load 11)
def test_fsdp_auto_prefetch_respects_max_memory_agrees_and_matches_unsharded_training():
    per_rank = run_on_ranks(_train_fsdp_auto, 2, total_timeout_s=420)
    assert per_rank[0]["report"] == per_rank[1]["report"]
    report = per_rank[0]["report"]
    assert [t["value"] for t in report["trials"]] == [0, 1, 1], report  # 2 exceeds max_memory
    assert report["settled"] and report["chosen"] == 1
    # Every rank's step of the depth-0 trials took the slow rank's time: combined by MAX.
    assert all(t["step_ms"] > FSDP_SLOW_S * 1e3 for t in report["trials"] if t["value"] == 0)
    assert report["settled_at_step"] == WARMUP_STEPS + 3 * (FSDP_DISCARD_STEPS + FSDP_MEASURE_STEPS)
    for r in per_rank:
        assert r["prefetch"] == 1 and r["hooks_removed"] == 1
        assert max(r["peaks"]) <= MAX_MEMORY
        assert all(t["peak_bytes"] <= MAX_MEMORY for t in report["trials"])
    reference = _blocks_model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in _fsdp_batches(2):
        # Each rank's loss is the mean over its half; FSDP averages the two gradients.
        loss = sum(reference(batch[r * 4 : (r + 1) * 4]).pow(2).mean() for r in range(2)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for name, want in reference.named_parameters():
        for r in per_rank:
            torch.testing.assert_close(r["params"][name], want.detach(), rtol=1e-5, atol=1e-6)
