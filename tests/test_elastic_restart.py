"""A worker SIGKILLed mid-run under ``launcher.max_restarts=1``: torch elastic restarts the job,
it resumes from the newest checkpoint every rank can use and ends with the parameters of an
uninterrupted run; a run none of whose checkpoints can be used stops with one line.

The kill comes from the tests' worker start-up hook ``tests.faults`` (``OVERLAPKIT_TEST_KILL``,
armed through ``launcher.worker_init``), and so does the damage to the newest checkpoint
(``OVERLAPKIT_TEST_DAMAGE_NEWEST``). Every uninterrupted run and every killed one is a job of one
multirun (``restarts``): a launch costs seconds of process start-up for a second of training.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.faults import (
    DAMAGE_ENV,
    KILL_ENV,
    RAN_MARKER,
    WORKER_INIT,
    damage_newest_checkpoint,
    install_kill_from_env,
    parse_kill_spec,
)
from tests.test_train_e2e import _finish, _losses, _start, _summary, kill_tree


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


TEST_CONF = Path(__file__).parent / "conf"
"""Test-only config options (``parallel=pp_zbv``), on Hydra's search path."""
COMMON = [
    f"hydra.searchpath=[file://{TEST_CONF}]",
    "model.config.n_layer=4",  # pp_zbv's 2 x 2 stages
    "train.steps=6",
    "train.checkpoint_every=2",
    "train.keep_checkpoints=0",
    "train.grad_accum=2",
    "launcher.max_restarts=1",
]
"""Checkpoints at steps 2 and 4; rank 1 dies in step 5's forward, so step 5 is lost and redone."""

# bucketer_overlap: per-bucket updates with train.clip_grad_norm=1.0 folded in; the kill counts
# steps with a global optimizer post-hook, which runs once per step there too. ddp: rank 1
# overwrites step 4's ``.metadata`` with a pickled callable (as a tampered checkpoint would hold)
# right before it kills itself. pp_zbv: the zero-bubble ZBVZeroBubble pipeline, its optimizer
# state saved per parameter, rank 1 holding the V's middle stages, rank 0 the first and last
# (the loss, both copies of the tied weight); it stands for the pipelines here (a 1F1B one
# saves and resumes through the same code, and a second pipeline cost the suite two launches).
PARALLEL = ["bucketer_overlap", "pp_zbv", "ddp"]
DAMAGED = "ddp"
KILLED = "rank 1 will SIGKILL itself in step 5"


@pytest.fixture(scope="module")
def restarts(tmp_path_factory) -> tuple[dict[str, tuple[Path, Path]], str]:
    """Per layout, the run directories of an uninterrupted run and of one whose rank 1 is
    SIGKILLed in step 5, and the multirun's output.

    Jobs 0 .. 2 run without a start-up hook; jobs 3 .. 5, the same layouts with ``tests.faults``
    armed (the sweep's first override varies slowest).
    """
    directory = tmp_path_factory.mktemp("restarts")
    sweep = directory / "sweep"
    runs = {p: (sweep / str(i), sweep / str(len(PARALLEL) + i)) for i, p in enumerate(PARALLEL)}
    args = [
        "-m",
        f"launcher.worker_init=[],[{WORKER_INIT}]",
        f"parallel={','.join(PARALLEL)}",
        *COMMON,
        f"hydra.sweep.dir={sweep}",
    ]
    env = {KILL_ENV: "1:5", DAMAGE_ENV: str(runs[DAMAGED][1])}
    output = _finish(_start(args, directory, env=env), timeout_s=560)
    for parallel, (whole, restarted) in runs.items():
        for run in (whole, restarted):
            overrides = (run / ".hydra" / "overrides.yaml").read_text()
            assert f"parallel={parallel}" in overrides, overrides
            assert ("tests.faults" in overrides) == (run == restarted), overrides
    assert output.count(KILLED) == len(PARALLEL)
    assert output.count(f"{KILLED}, after damaging the newest checkpoint") == 1
    return runs, output


def _assert_ends_as_the_uninterrupted_run(whole: Path, restarted: Path) -> None:
    _assert_same_training_state(_final_state(whole, 6), _final_state(restarted, 6))
    # The losses the restarted run logged (at least the restart's) are the uninterrupted run's.
    whole_losses, restarted_losses = _losses(whole), _losses(restarted)
    assert {5, 6} <= restarted_losses.keys()
    assert restarted_losses == {step: whole_losses[step] for step in restarted_losses}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("parallel", [p for p in PARALLEL if p != DAMAGED])
def test_worker_killed_mid_run_restarts_and_ends_bitwise_equal_to_an_uninterrupted_run(
    restarts, parallel
):
    runs, output = restarts
    whole, restarted = runs[parallel]
    summary = _summary(restarted)
    assert (summary["start_step"], summary["steps_run"], summary["final_step"]) == (4, 2, 6)
    assert f"resuming from {restarted / 'checkpoints'}" not in output  # its newest was usable
    # The first attempt died before step 5's checkpoint; the restart wrote steps 5 and 6 only.
    kept = sorted(p.name for p in (restarted / "checkpoints").iterdir())
    assert kept == ["step_00000002", "step_00000004", "step_00000006"], kept
    _assert_ends_as_the_uninterrupted_run(whole, restarted)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_restart_meeting_a_damaged_newest_checkpoint_resumes_from_the_previous_one(restarts):
    runs, output = restarts
    whole, restarted = runs[DAMAGED]
    checkpoints = restarted / "checkpoints"
    newest, previous = checkpoints / "step_00000004", checkpoints / "step_00000002"
    # One line per rank saying why (before: a traceback per rank and attempt, and the run
    # stopped), then rank 0's warning naming both; none in the other jobs.
    assert len(re.findall(r"checkpoint refused: ", output)) == 2, output[-5000:]
    for rank in (0, 1):
        refusals = re.findall(
            rf"^\[rank{rank}\] ERROR overlapkit\.train\.run\.resume: checkpoint refused: "
            rf"{re.escape(str(newest))}/\.metadata: not a readable DCP checkpoint metadata file: "
            r"checkpoint metadata refers to (io|builtins)\.open, .*$",
            output,
            re.MULTILINE,
        )
        assert len(refusals) == 1, output[-5000:]
    assert (
        f"resuming from {previous}, the newest checkpoint every rank can use, instead of the "
        f"newer {newest} (refused, see above)"
    ) in output
    assert not (restarted / RAN_MARKER).exists()  # the pickled callable never ran
    summary = _summary(restarted)
    assert (summary["start_step"], summary["steps_run"], summary["final_step"]) == (2, 4, 6)
    # The restart wrote steps 3..6; its step 4 replaced the damaged one.
    kept = sorted(p.name for p in checkpoints.iterdir())
    assert kept == ["step_00000002", "step_00000004", "step_00000006"], kept
    _assert_ends_as_the_uninterrupted_run(whole, restarted)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_whose_every_checkpoint_is_damaged_stops_with_one_line_and_no_traceback(
    restarts, tmp_path
):
    # The damaged restart's checkpoints, each damaged in another way: metadata naming a callable,
    # truncated metadata, a truncated data file (found only inside DCP's collective load).
    run = tmp_path / "run"
    shutil.copytree(restarts[0][DAMAGED][1] / "checkpoints", run / "checkpoints")
    checkpoints = run / "checkpoints"
    damage_newest_checkpoint(checkpoints)  # step 6
    _truncate(checkpoints / "step_00000004" / ".metadata")
    _truncate(checkpoints / "step_00000002" / "__0_0.distcp")
    proc = _start(["parallel=ddp", *COMMON, "train.steps=8", f"hydra.run.dir={run}"], tmp_path)
    try:
        out, err = proc.communicate(timeout=280)
    finally:
        kill_tree(proc.pid)  # nothing is left after an exit; all of it after a timeout
    output = out + err
    assert proc.returncode == 1, output[-5000:]
    assert "Traceback" not in output, output[-5000:]  # before: one per rank and attempt
    (line,) = [x for x in output.splitlines() if x.startswith("overlapkit-train: error:")]
    assert line.startswith(
        f"overlapkit-train: error: no usable checkpoint to resume from in "
        f"{checkpoints}: {checkpoints / 'step_00000006'}/.metadata: "
    ), line
    assert f"{checkpoints / 'step_00000004'}/.metadata: not a readable DCP" in line
    assert f"{checkpoints / 'step_00000002'}: RuntimeError: PytorchStreamReader failed" in line
    assert line.endswith("Move them away (or repair them), or start another run (name=...)")
    # Each rank said why for each checkpoint, once; no restart (the workers did not fail).
    refusal = r"^\[rank[01]\] ERROR overlapkit\.train\.run\.resume: checkpoint refused: "
    assert len(re.findall(refusal, output, re.MULTILINE)) == 6, output[-5000:]
    assert not (run / RAN_MARKER).exists()


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
    assert install_kill_from_env(1, attempt=0) is False
    monkeypatch.setenv(KILL_ENV, "1:5")
    assert install_kill_from_env(0, attempt=0) is False
    assert install_kill_from_env(1, attempt=1) is False
