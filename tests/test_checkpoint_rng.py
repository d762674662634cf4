"""Checkpointed RNG state on GPU hosts (issue 18), with CUDA's generator simulated on this CPU.

On a GPU host the saved RNG keys used to depend on whether CUDA happened to be initialised:
DCP's writer initialises it, so a checkpoint saved before and loaded after that expected a
``rng_rank0.cuda`` it did not hold. The CUDA generator is stood in for by a byte tensor behind
``torch.cuda.get_rng_state`` / ``set_rng_state``; a "GPU model" is a model for which the module's
device lookup answers ``cuda:0``.
"""

import pytest
import torch

from overlapkit.train.run import checkpoint
from overlapkit.train.run.checkpoint import TrainingState, step_dir
from overlapkit.train.run.data import BatchStream, SyntheticRegression
from overlapkit.train.run.lr_schedule import warmup_cosine
from tests.cuda import requires_cuda

WIDTH = 8


def _state() -> TrainingState:
    model = torch.nn.Linear(WIDTH, WIDTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = warmup_cosine(optimizer, total_steps=10, warmup_steps=0)
    stream = BatchStream(SyntheticRegression(width=WIDTH), rank=0, batch_size=1)
    return TrainingState(model, optimizer, scheduler, stream, rank=0)


class _FakeCudaRng:
    """CUDA's generator state of one device, as ``torch.cuda.get/set_rng_state`` see it."""

    def __init__(self, monkeypatch):
        self.state = torch.arange(16, dtype=torch.uint8)
        self.set_calls: list[tuple[torch.Tensor, torch.device]] = []
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.state.clone())
        monkeypatch.setattr(
            torch.cuda, "set_rng_state", lambda s, device="cuda": self.set_calls.append((s, device))
        )


def _run_on_gpu(monkeypatch) -> None:
    monkeypatch.setattr(checkpoint, "_cuda_device", lambda model: torch.device("cuda", 0))


def _save(path, step=1) -> None:
    torch.distributed.checkpoint.save(_state().state_dict(step), checkpoint_id=path)


def test_cpu_model_checkpoint_loads_after_cuda_got_initialised(tmp_path, monkeypatch):
    """The GPU-host failure: saved with CUDA idle, loaded after something initialised it."""
    path = step_dir(tmp_path, 1)
    _save(path)
    _FakeCudaRng(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert _state().load(path) == 1


def test_gpu_checkpoint_resumes_on_a_gpu_run_with_its_cuda_rng_state(tmp_path, monkeypatch):
    cuda = _FakeCudaRng(monkeypatch)
    _run_on_gpu(monkeypatch)
    path = step_dir(tmp_path, 3)
    torch.manual_seed(7)
    state = _state()
    cpu_saved = torch.get_rng_state()
    torch.distributed.checkpoint.save(state.state_dict(3), checkpoint_id=path)
    saved = cuda.state.clone()
    cuda.state = torch.zeros(16, dtype=torch.uint8)  # the resumed run's fresh generator
    torch.manual_seed(8)
    assert _state().load(path) == 3
    [(restored, device)] = cuda.set_calls
    assert torch.equal(restored, saved) and device == torch.device("cuda", 0)
    assert torch.equal(torch.get_rng_state(), cpu_saved)


def test_gpu_checkpoint_on_a_cpu_run_is_a_clear_error(tmp_path, monkeypatch):
    _FakeCudaRng(monkeypatch)
    with monkeypatch.context() as gpu:
        _run_on_gpu(gpu)
        _save(step_dir(tmp_path, 1))
    with pytest.raises(
        ValueError,
        match=r"step_00000001: rank 0's RNG state was saved by a GPU run \(CPU and CUDA RNG\), "
        r"but this run is a CPU run \(CPU RNG\): its model is on the CPU",
    ):
        _state().load(step_dir(tmp_path, 1))


def test_cpu_checkpoint_on_a_gpu_run_is_a_clear_error(tmp_path, monkeypatch):
    _save(step_dir(tmp_path, 1))
    _FakeCudaRng(monkeypatch)
    _run_on_gpu(monkeypatch)
    with pytest.raises(
        ValueError,
        match=r"saved by a CPU run \(CPU RNG\), but this run is a GPU run \(CPU and CUDA RNG\): "
        r"its model is on a CUDA device",
    ):
        _state().load(step_dir(tmp_path, 1))


@requires_cuda
def test_real_gpu_checkpoint_resumes_the_cuda_random_stream(tmp_path):
    state = _state()
    state.model.to("cuda")
    torch.manual_seed(3)
    path = step_dir(tmp_path, 1)
    torch.distributed.checkpoint.save(state.state_dict(1), checkpoint_id=path)
    expected = torch.rand(8, device="cuda")  # what the run draws next after the save
    torch.manual_seed(4)
    resumed = _state()
    resumed.model.to("cuda")
    assert resumed.load(path) == 1
    assert torch.equal(torch.rand(8, device="cuda"), expected)
