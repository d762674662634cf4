"""The training loop's parts without a launcher: schedule, data, config checks, checkpoint files.

The checkpoint round trip runs on 2 gloo ranks (DCP is collective) and compares every tensor.
"""

from __future__ import annotations

import itertools
import logging
import math
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

import overlapkit as ok
from overlapkit.train.models import GPT, GPTConfig, MLPConfig
from overlapkit.train.parallel.wrappers import apply_parallel
from overlapkit.train.run.checkpoint import (
    TrainingState,
    committed_checkpoints,
    latest_checkpoint,
    remove_pending,
    step_dir,
)
from overlapkit.train.run.data import (
    BatchStream,
    SyntheticRegression,
    SyntheticTokens,
    TextCorpus,
    check_compatible,
)
from overlapkit.train.run.loop import TrainConfig, resolve_device
from overlapkit.train.run.lr_schedule import warmup_cosine, warmup_cosine_factor
from overlapkit.train.run.progress import Monitor, RunSummary
from tests.multiproc import run_on_ranks


def test_warmup_is_linear_then_cosine_reaches_the_floor():
    f = [
        warmup_cosine_factor(s, total_steps=14, warmup_steps=4, min_lr_ratio=0.1) for s in range(16)
    ]
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f[4] == pytest.approx(1.0)  # the cosine starts at the top
    assert f[9] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way: the mean of top and floor
    assert f[14] == f[15] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(f[4:]))


def test_scheduler_applies_the_factor_per_optimizer_step():
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=2.0)
    scheduler = warmup_cosine(optimizer, total_steps=6, warmup_steps=2, min_lr_ratio=0.0)
    assert isinstance(scheduler, LambdaLR)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [
        2.0 * warmup_cosine_factor(s, total_steps=6, warmup_steps=2, min_lr_ratio=0.0)
        for s in range(6)
    ]
    assert seen == pytest.approx(expected)
    assert seen[1] == 2.0 and seen[-1] == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 3 / 4)))


def test_warmup_longer_than_the_run_is_shortened_with_a_warning(caplog):
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = warmup_cosine(optimizer, total_steps=3, warmup_steps=10)
    assert "warmup_steps (10) exceeds train.steps (3)" in caplog.text
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="warmup_steps must be >= 0, got -1"):
        warmup_cosine(optimizer, total_steps=3, warmup_steps=-1)
    del scheduler


def test_synthetic_tokens_follow_the_successor_table_and_depend_only_on_position():
    data = SyntheticTokens(seq_len=12, vocab_size=50, successors=3, seed=7)
    x, y = data.batch(5, rank=1, batch_size=4)
    assert x.shape == y.shape == (4, 12) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    for prev, nxt in zip(x.flatten().tolist(), y.flatten().tolist(), strict=True):
        assert nxt in data.table[prev].tolist()
    again = SyntheticTokens(seq_len=12, vocab_size=50, successors=3, seed=7)
    assert torch.equal(again.batch(5, rank=1, batch_size=4)[0], x)
    assert not torch.equal(data.batch(5, rank=0, batch_size=4)[0], x)
    assert not torch.equal(data.batch(6, rank=1, batch_size=4)[0], x)
    with pytest.raises(ValueError, match=r"data.successors \(60\) must be <= data.vocab_size"):
        SyntheticTokens(seq_len=4, vocab_size=50, successors=60)


def test_text_corpus_windows_are_contiguous_bytes_of_the_file(tmp_path):
    text = b"the quick brown fox jumps over the lazy dog. " * 20
    path = tmp_path / "t.txt"
    path.write_bytes(text)
    data = TextCorpus(path=path, seq_len=16, seed=3)
    x, y = data.batch(0, rank=0, batch_size=5)
    for row_x, row_y in zip(x, y, strict=True):
        window = bytes(row_x.tolist()) + bytes(row_y[-1:].tolist())
        assert window in text and torch.equal(row_x[1:], row_y[:-1])
    short = tmp_path / "short.txt"
    short.write_bytes(b"abc")
    with pytest.raises(ValueError, match=r"has 3 bytes, fewer than data.seq_len \+ 1 \(17\)"):
        TextCorpus(path=short, seq_len=16)


def test_shipped_corpus_is_english_text():
    data = TextCorpus(seq_len=64)
    text = bytes(data.data.tolist()).decode("utf-8")
    assert "THE MILLER AND THE RIVER" in text and len(text) > 20_000


def test_regression_targets_are_the_teacher_of_the_inputs():
    data = SyntheticRegression(width=8, seed=1)
    x, y = data.batch(3, rank=0, batch_size=5)
    assert torch.allclose(y, torch.tanh(x @ data.teacher))
    assert data.loss(y, y).item() == 0.0


def test_data_and_model_mismatches_name_the_keys():
    tokens = SyntheticTokens(seq_len=100, vocab_size=256)
    with pytest.raises(ValueError, match=r"data.seq_len \(100\) exceeds model.config.block_size"):
        check_compatible(tokens, GPTConfig(block_size=64))
    with pytest.raises(ValueError, match=r"has 256 token ids but model.config.vocab_size is 100"):
        check_compatible(SyntheticTokens(seq_len=8, vocab_size=256), GPTConfig(vocab_size=100))
    with pytest.raises(ValueError, match=r"yields float features, but the model \(GPTConfig\)"):
        check_compatible(SyntheticRegression(width=8), GPTConfig())
    with pytest.raises(ValueError, match=r"data.width \(8\) must equal model.config.width \(16\)"):
        check_compatible(SyntheticRegression(width=8), MLPConfig(width=16))


def test_batch_stream_resumes_at_its_position():
    data = SyntheticTokens(seq_len=4, vocab_size=16)
    stream = BatchStream(data, rank=0, batch_size=2)
    batches = [stream.next()[0] for _ in range(3)]
    resumed = BatchStream(data, rank=0, batch_size=2)
    resumed.load_state_dict({"position": 2})
    assert torch.equal(resumed.next()[0], batches[2]) and resumed.state_dict() == {"position": 3}
    with pytest.raises(ValueError, match="data position must be an int >= 0, got -1"):
        resumed.load_state_dict({"position": -1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, r"train.batch_size must be >= 1, got 0"),
        ({"grad_accum": 1.5}, r"train.grad_accum must be an int, got 1.5"),
        ({"clip_grad_norm": 0.0}, r"train.clip_grad_norm must be > 0 or null"),
        ({"stop_after": 3, "checkpoint_every": 0}, r"train.stop_after needs checkpoints"),
    ],
)
def test_train_config_names_the_bad_field(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        TrainConfig(**kwargs)


@pytest.mark.parametrize(
    ("gpus", "name", "expected"),
    [(0, "auto", "cpu"), (1, "auto", "cpu"), (2, "auto", "cuda:1"), (2, "cpu", "cpu")],
)
def test_auto_device_is_cuda_only_with_a_gpu_per_local_rank(monkeypatch, gpus, name, expected):
    """Local rank 1 of 2: on a 1-GPU host ``auto`` used to give it ``cuda:1``, which is absent."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert resolve_device(name, 1, local_world_size=2) == torch.device(expected)


def test_cuda_device_with_fewer_gpus_than_local_ranks_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"2 rank\(s\) on this node, 1 GPU\(s\) here"):
        resolve_device("cuda", 1, local_world_size=2)


def test_only_committed_checkpoints_are_found(tmp_path):
    for step, committed in [(3, True), (6, True), (9, False)]:
        path = step_dir(tmp_path, step)
        if not committed:
            path = path.with_name(path.name + ".tmp")  # an interrupted save
        path.mkdir()
        (path / ".metadata").write_bytes(b"x")
    (tmp_path / "step_00000012").mkdir()  # no metadata: not a checkpoint
    assert [s for s, _ in committed_checkpoints(tmp_path)] == [3, 6]
    assert latest_checkpoint(tmp_path) == (6, step_dir(tmp_path, 6))
    assert [p.name for p in remove_pending(tmp_path)] == ["step_00000009.tmp"]
    assert latest_checkpoint(tmp_path / "absent") is None


def test_summary_reads_as_a_report():
    summary = RunSummary(
        name="demo",
        world_size=2,
        nodes=1,
        parallel="ok.ddp",
        unit="tok",
        start_step=10,
        final_step=30,
        steps_run=20,
        seconds=4.0,
        steps_per_s=5.0,
        items_per_s=5120.0,
        median_step_ms=200.0,
        loss_first=5.5,
        loss_last=3.25,
        exposed_comm_share=0.125,
        profiled_steps=6,
        tensorboard_dir="runs/demo/tb",
        profile_dir="runs/demo/tb/x/profile",
    )
    text = summary.format()
    for part in (
        "2 ranks on 1 node",
        "steps 11..30",
        "resumed from step 10",
        "5.00 steps/s",
        "5,120 tok/s",
        "loss 5.5000 -> 3.2500",
        "exposed comm: 12.5% of step time",
        "tensorboard --logdir runs/demo/tb",
    ):
        assert part in text, part


def test_progress_bar_labels_exposed_comm_as_the_profiled_steps_median(tmp_path, capsys):
    console = logging.StreamHandler(sys.stderr)  # as the training workers log
    root = logging.getLogger()
    root.addHandler(console)
    monitor = Monitor(
        enabled=True,
        tb_dir=tmp_path,
        start_step=0,
        end_step=8,
        items_per_step=64,
        unit="tok",
        progress=True,
    )
    try:
        for step in range(1, 9):
            if step == 5:
                time.sleep(0.15)  # past tqdm's mininterval: the bar is drawn at step 5
            monitor.step(step, loss=1.0, lr=0.1, grad_norm=None, step_s=0.01)
            if step == 6:  # what the loop does when the profiler has saved steps 4-6
                logging.getLogger("overlapkit.profiling.profiler").warning("wrote rank0.json")
                monitor.set_exposed_comm(7.04, range(4, 7))
    finally:
        monitor.close()
        root.removeHandler(console)
    err = capsys.readouterr().err
    bars = [line.strip() for line in err.replace("\n", "\r").split("\r")]
    shown = {int(b.split("|")[2].split("/")[0]): b for b in bars if b.startswith("train:")}
    assert {5, 8} <= set(shown), bars
    label = "exposed_comm=7.0ms (median of steps 4-6)"
    for step, bar in shown.items():
        assert (label in bar) == (step > 6), bar
        assert "exposed_comm" not in bar.replace(label, ""), bar
    # The log line is printed above the bar, on a line of its own, not after the bar's text.
    assert "wrote rank0.json" in bars


def _state(seed: int, parallel: str):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8))
    factory = {"ddp": lambda m: ok.ddp(m), "fsdp": lambda m: ok.fsdp(m)}[parallel]
    par = apply_parallel(model, factory)
    optimizer = torch.optim.AdamW(par.model.parameters(), lr=1e-2)
    scheduler = warmup_cosine(optimizer, total_steps=10, warmup_steps=2)
    data = SyntheticTokens(seq_len=8, vocab_size=256, seed=seed)
    stream = BatchStream(data, rank=dist.get_rank(), batch_size=2)
    return par, TrainingState(par.model, optimizer, scheduler, stream, dist.get_rank())


def _steps(par, state, n):
    for _ in range(n):
        x, y = state.stream.next()
        state.optimizer.zero_grad()
        state.stream.source.loss(par.model(x), y).backward()
        state.optimizer.step()
        state.scheduler.step()


def _full_params(model) -> dict[str, torch.Tensor]:
    return {  # names without DDP's "module." prefix, FSDP shards gathered
        name.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p)
        .detach()
        .clone()
        for name, p in model.named_parameters()
    }


def _checkpoint_round_trip(rank, world_size, root, load_as):
    par, state = _state(seed=1, parallel="ddp")
    _steps(par, state, 3)
    state.save(root, 3, keep=1)
    _steps(par, state, 2)
    torch.manual_seed(1000 + rank)  # a per-rank RNG state for the checkpoint to carry
    path = state.save(root, 5, keep=1)
    expected_draw = torch.rand(3)
    saved = _full_params(par.model)
    fresh_par, fresh = _state(seed=1, parallel=load_as)
    torch.manual_seed(5)
    step = fresh.load(path)
    drawn = torch.rand(3)
    loaded = _full_params(fresh_par.model)
    _steps(par, state, 1)  # one more step from the original and from the loaded state
    _steps(fresh_par, fresh, 1)
    original, resumed = _full_params(par.model), _full_params(fresh_par.model)
    return {
        "step": step,
        "position": fresh.stream.position,
        "lr": [fresh.optimizer.param_groups[0]["lr"], state.optimizer.param_groups[0]["lr"]],
        "rng_restored": torch.equal(drawn, expected_draw),
        "same_after_load": all(torch.equal(saved[k], loaded[k]) for k in saved),
        "next_step_max_diff": max((original[k] - resumed[k]).abs().max().item() for k in original),
        "committed": [s for s, _ in committed_checkpoints(root)],
    }


@pytest.mark.slow
def test_checkpoint_of_ok_ddp_loads_into_ok_fsdp(tmp_path):
    # Bitwise resume with the same wrapper is checked end to end in test_train_e2e.py.
    results = run_on_ranks(_checkpoint_round_trip, 2, str(tmp_path), "fsdp")
    for result in results:
        assert result["step"] == 5 and result["position"] == 6  # 5 loaded + 1 more
        assert result["lr"][0] == result["lr"][1]
        assert result["rng_restored"] and result["same_after_load"], result
        assert result["committed"] == [5]  # keep=1 removed step 3
        # The next step reduces by reduce-scatter instead of all-reduce: it may round apart.
        assert result["next_step_max_diff"] < 1e-6
