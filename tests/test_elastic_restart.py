"""A worker SIGKILLed mid-run under ``launcher.max_restarts=1``: torch elastic restarts the job,
it resumes from the newest checkpoint and ends with the parameters of an uninterrupted run.

The kill comes from the test-only hook ``overlapkit.train.faults`` (``OVERLAPKIT_TEST_KILL``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from overlapkit.train.faults import KILL_ENV, install_kill_from_env, parse_kill_spec
from tests.test_train_e2e import _finish, _losses, _start, _summary


def _final_state(run_dir: Path, step: int) -> dict:
    target = run_dir / f"step{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step_{step:08d}", target)
    return torch.load(target, weights_only=True)


def _assert_same_training_state(a: dict, b: dict) -> None:
    assert a["progress"] == b["progress"]
    assert a["scheduler"] == b["scheduler"]
    assert a["model"].keys() == b["model"].keys()
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    if "state" not in a["optim"]:  # flattened per parameter (pipeline stages)
        assert a["optim"].keys() == b["optim"].keys()
        for key, value in a["optim"].items():
            other = b["optim"][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, key
        return
    assert a["optim"]["state"].keys() == b["optim"]["state"].keys()
    for name, moments in a["optim"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, b["optim"]["state"][name][key]), (name, key)


@pytest.mark.slow
@pytest.mark.timeout(600)
# bucketer_overlap: per-bucket updates with train.clip_grad_norm=1.0 folded in; the kill counts
# steps with a global optimizer post-hook, which runs once per step there too. pp_dp: a 1F1B
# pipeline of 2 stages (rank 1, the one killed, is the last stage: it computes the loss), its
# optimizer state saved per parameter, the tied head's copy on rank 1.
@pytest.mark.parametrize("parallel", ["ddp", "bucketer_overlap", "pp_dp"])
def test_worker_killed_mid_run_restarts_and_ends_bitwise_equal_to_an_uninterrupted_run(
    tmp_path, parallel
):
    # Checkpoints at steps 2 and 4; rank 1 dies in step 5's forward, so step 5 is lost and redone.
    common = [
        f"parallel={parallel}",
        "train.steps=6",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=0",
        "train.grad_accum=2",
        "launcher.max_restarts=1",
    ]
    whole, restarted = tmp_path / "whole", tmp_path / "restarted"
    _finish(_start([*common, f"hydra.run.dir={whole}"], tmp_path), timeout_s=280)
    output = _finish(
        _start([*common, f"hydra.run.dir={restarted}"], tmp_path, env={KILL_ENV: "1:5"}),
        timeout_s=280,
    )
    assert "rank 1 will SIGKILL itself in step 5" in output
    assert "resumed from step 4" in output
    summary = _summary(restarted)
    assert (summary["start_step"], summary["steps_run"], summary["final_step"]) == (4, 2, 6)
    # The first attempt died before step 5's checkpoint; the restart wrote steps 5 and 6 only.
    kept = sorted(p.name for p in (restarted / "checkpoints").iterdir())
    assert kept == ["step_00000002", "step_00000004", "step_00000006"], kept

    _assert_same_training_state(_final_state(whole, 6), _final_state(restarted, 6))
    # The losses the restarted run logged (at least the restart's) are the uninterrupted run's.
    whole_losses, restarted_losses = _losses(whole), _losses(restarted)
    assert {5, 6} <= restarted_losses.keys()
    assert restarted_losses == {step: whole_losses[step] for step in restarted_losses}


def test_kill_spec_is_rank_and_step():
    assert parse_kill_spec("1:5") == (1, 5)
    assert parse_kill_spec(" 0:1 ") == (0, 1)


@pytest.mark.parametrize("spec", ["1", "1:0", "a:2", "-1:2", "1:2:3", ":", "1:"])
def test_kill_spec_rejects_a_malformed_value_naming_the_variable(spec):
    with pytest.raises(ValueError, match=rf"{KILL_ENV} must be RANK:STEP.*got {spec!r}"):
        parse_kill_spec(spec)


def test_kill_is_armed_only_for_its_rank_on_the_first_attempt(monkeypatch):
    # Arming installs process-wide hooks, so only the cases that must not arm run here; the
    # armed case runs in the workers of the end-to-end test above.
    monkeypatch.delenv(KILL_ENV, raising=False)
    assert install_kill_from_env(1) is False
    monkeypatch.setenv(KILL_ENV, "1:5")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert install_kill_from_env(0) is False
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert install_kill_from_env(1) is False
