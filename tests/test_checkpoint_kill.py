"""Checkpoints survive a SIGKILL at any moment of a save, and untrusted checkpoints run no code.

A victim process (this file run as a script) saves a ``TrainingState`` whose parameters all equal
the step number, step after step, with ``TrainingState.save``; the test kills it (or it kills
itself at a chosen point) and then resumes as the training loop does: ``remove_pending``,
``latest_checkpoint``, ``TrainingState.load``. Whatever the moment of the kill, every committed
checkpoint must load completely with its own step's values, and resuming must pick the newest
of them and drop the partial one.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from overlapkit.train.run.checkpoint import (
    TrainingState,
    committed_checkpoints,
    latest_checkpoint,
    remove_pending,
    step_dir,
)
from overlapkit.train.run.data import BatchStream, SyntheticRegression
from overlapkit.train.run.lr_schedule import warmup_cosine
from overlapkit.train.run.resume import NoUsableCheckpoint, resume_from_newest_usable

WIDTH = 1024  # 4 layers of 1024 x 1024: 16 MB of parameters, 48 MB per checkpoint with AdamW
SMALL_WIDTH = 64  # where the size of a checkpoint does not matter


def _training_state(width: int = WIDTH) -> TrainingState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # one step, so that the optimizer has moments to save
        p.grad = torch.ones_like(p)
    optimizer.step()
    scheduler = warmup_cosine(optimizer, total_steps=1000, warmup_steps=0)
    stream = BatchStream(SyntheticRegression(width=width), rank=0, batch_size=1)
    return TrainingState(model, optimizer, scheduler, stream, rank=0)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _victim(root: str, mode: str) -> None:
    """Save steps 1, 2, ... under ``root`` until killed (``mode`` says where, if by itself)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    state = _training_state()
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def replace_then_die(src, dst):  # DCP has written everything; the rename never happens
        if str(src).endswith(".tmp"):
            _kill_self()
        real_replace(src, dst)

    def rmtree_then_die(path, *args, **kwargs):  # one file of a pruned checkpoint gone, then die
        shards = sorted(Path(path).glob("*.distcp")) if Path(path).is_dir() else []
        if shards:
            shards[0].unlink()
            _kill_self()
        real_rmtree(path, *args, **kwargs)

    keep = 0 if mode == "before_rename" else 2
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in state.model.parameters():
                p.fill_(step)
        state.stream.position = step
        if step == 3 and mode == "before_rename":
            os.replace = replace_then_die
        if step == 3 and mode == "mid_prune":
            shutil.rmtree = rmtree_then_die
        started = time.perf_counter()
        state.save(root, step, keep=keep)
        print(f"saved {step} {time.perf_counter() - started:.3f}", flush=True)


def _run_victim(root: Path, mode: str, kill_after_s=None) -> list[str]:
    """Run the victim; kill it ``kill_after_s()`` s after its second save (if given)."""
    proc = subprocess.Popen(
        [sys.executable, __file__, str(root), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    try:
        if kill_after_s is None:
            proc.wait(timeout=120)
        else:
            while len(lines) < 2:
                line = proc.stdout.readline()
                assert line, f"the victim ended early: {proc.stderr.read()[-3000:]}"
                lines.append(line.strip())
            time.sleep(kill_after_s([float(line.split()[2]) for line in lines]))
            proc.kill()
            proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines += [line.strip() for line in proc.stdout.read().splitlines()]
    stderr = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, f"exit {proc.returncode}: {stderr[-3000:]}"
    return lines


def _load(path: Path, width: int = WIDTH) -> tuple[int, TrainingState]:
    state = _training_state(width)
    for p in state.model.parameters():
        p.detach().zero_()
    return state.load(path), state


def _assert_holds_step(path: Path, step: int) -> None:
    loaded_step, state = _load(path)
    assert loaded_step == step and state.stream.position == step, (path, loaded_step)
    for name, p in state.model.named_parameters():
        assert torch.equal(p, torch.full_like(p, step)), (path, name)


def _resume(root: Path) -> tuple[list[str], int]:
    """What the training loop does at start: drop partial saves, load the newest checkpoint."""
    removed = sorted(p.name for p in remove_pending(root))
    step, path = latest_checkpoint(root)
    _assert_holds_step(path, step)
    return removed, step


@pytest.mark.slow
def test_kill_between_dcp_write_and_rename_resumes_from_the_previous_checkpoint(tmp_path):
    _run_victim(tmp_path, "before_rename")
    # The third save wrote everything, metadata included, but was never committed.
    assert (tmp_path / "step_00000003.tmp" / ".metadata").is_file()
    assert [s for s, _ in committed_checkpoints(tmp_path)] == [1, 2]
    assert _resume(tmp_path) == (["step_00000003.tmp"], 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]


@pytest.mark.slow
def test_kill_while_pruning_an_old_checkpoint_leaves_no_damaged_committed_one(tmp_path):
    # The kill lands inside the deletion of step 1 (keep=2 after step 3 is committed), after
    # one of its files is gone: no directory with a committed name may be missing files.
    _run_victim(tmp_path, "mid_prune")
    committed = committed_checkpoints(tmp_path)
    assert [s for s, _ in committed] == [2, 3], committed
    for step, path in committed:
        _assert_holds_step(path, step)
    removed, step = _resume(tmp_path)
    assert removed == ["step_00000001.old.tmp"] and step == 3


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_kill_at_a_random_moment_of_saving_loses_only_the_save_in_flight(tmp_path, seed):
    # A kill within one save's duration after the second save: inside the third save's write,
    # rename or pruning, or just after it.
    rng = random.Random(seed)
    lines = _run_victim(tmp_path, "loop", kill_after_s=lambda took: rng.uniform(0, 1.5 * max(took)))
    reported = int(lines[-1].split()[1])  # the last save that returned before the kill
    committed = committed_checkpoints(tmp_path)
    for step, path in committed:
        _assert_holds_step(path, step)
    removed, step = _resume(tmp_path)
    assert step in (reported, reported + 1), (lines, committed, removed)
    assert not list(tmp_path.glob("*.tmp"))


class _WritesAFile:
    """A pickle payload with a side effect we can see: unpickling it creates ``path``."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_checkpoint_value_holding_a_pickled_callable_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    path = step_dir(tmp_path, 1)
    state = _training_state()
    saved = state.state_dict(1)
    saved["progress"]["data"] = {"position": _WritesAFile(marker)}
    dcp.save(saved, checkpoint_id=path)
    with pytest.raises(
        ValueError,
        match=r"step_00000001: checkpoint value 'progress.data.position' is not plain data",
    ):
        _load(path)
    assert not marker.exists()
    # The payload is live: DCP's own loader (weights_only=False) runs it.
    dcp.load({"progress": {"data": {"position": 0}}}, checkpoint_id=path)
    assert marker.exists()


def test_checkpoint_metadata_naming_a_callable_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    path = step_dir(tmp_path, 1)
    dcp.save(_training_state().state_dict(1), checkpoint_id=path)
    (path / ".metadata").write_bytes(pickle.dumps(_WritesAFile(marker)))
    with pytest.raises(ValueError, match=r"\.metadata: .* refers to (io|builtins)\.open"):
        _load(path)
    assert not marker.exists()


def test_truncated_checkpoint_metadata_is_a_clear_error(tmp_path):
    path = step_dir(tmp_path, 1)
    dcp.save(_training_state().state_dict(1), checkpoint_id=path)
    data = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"\.metadata: not a readable DCP checkpoint metadata"):
        _load(path)


def test_resume_passes_over_refused_checkpoints_to_the_newest_usable_one(tmp_path, caplog):
    marker = tmp_path / "ran"
    state = _training_state(SMALL_WIDTH)
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in state.model.parameters():
                p.fill_(step)
        state.stream.position = step
        dcp.save(state.state_dict(step), checkpoint_id=step_dir(tmp_path, step))
    (step_dir(tmp_path, 3) / ".metadata").write_bytes(pickle.dumps(_WritesAFile(marker)))
    _, fresh = _load(step_dir(tmp_path, 1), SMALL_WIDTH)
    assert resume_from_newest_usable(fresh, committed_checkpoints(tmp_path)) == (
        2,
        step_dir(tmp_path, 2),
    )
    assert all(torch.equal(p, torch.full_like(p, 2)) for p in fresh.model.parameters())
    assert fresh.stream.position == 2 and not marker.exists()
    logged = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.endswith("resume")]
    assert logged[0][0] == "ERROR" and logged[0][1].startswith(
        f"checkpoint refused: {step_dir(tmp_path, 3)}/.metadata: not a readable DCP checkpoint"
    ), logged
    assert logged[1] == (
        "WARNING",
        f"resuming from {step_dir(tmp_path, 2)}, the newest checkpoint every rank can use, "
        f"instead of the newer {step_dir(tmp_path, 3)} (refused, see above)",
    )
    for step in (1, 2):
        (shard,) = step_dir(tmp_path, step).glob("*.distcp")
        shard.write_bytes(shard.read_bytes()[:1000])  # a pickle that ends early: EOFError()
    with pytest.raises(NoUsableCheckpoint) as refusal:
        resume_from_newest_usable(fresh, committed_checkpoints(tmp_path))
    assert str(refusal.value) == (
        f"no usable checkpoint to resume from in {tmp_path}: {step_dir(tmp_path, 3)}/.metadata: "
        "not a readable DCP checkpoint metadata file: checkpoint metadata refers to io.open, "
        "which DCP metadata never holds; refusing to unpickle it (it could run code); "
        f"{step_dir(tmp_path, 2)}: EOFError while reading it; "
        f"{step_dir(tmp_path, 1)}: EOFError while reading it. "
        "Move them away (or repair them), or start another run (name=...)"
    )


def test_no_checkpoint_is_a_fresh_start_not_a_refusal(tmp_path):
    assert (
        resume_from_newest_usable(_training_state(SMALL_WIDTH), committed_checkpoints(tmp_path))
        is None
    )


if __name__ == "__main__":
    _victim(sys.argv[1], sys.argv[2])
