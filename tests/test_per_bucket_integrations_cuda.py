"""The fp16 overflow path of per-bucket Accelerate and HF Trainer runs, on CUDA, against plain DDP.

Accelerate makes a GradScaler only on an accelerator (``mixed_precision="fp16"`` on CPU has
none), so this path is tested here: two NCCL ranks share GPU 0 (each its own ``NCCL_HOSTID``,
docs/emulation.md; both told ``LOCAL_RANK=0``, so that Accelerate and the Trainer put both on
``cuda:0``). Rank 1's loss is made inf at one step: the GradScaler must skip that step on both
ranks, ``optimizer_step_was_skipped`` must say so (``PerBucketOptimizer.step_was_skipped``), the
LR scheduler must not step, and everything else must be bitwise the plain run's (the same path
in fp32 on CPU: tests/test_integration_accelerate.py). Run on a GPU host, offline:

    python -m pytest -q -m cuda tests/test_per_bucket_integrations_cuda.py
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.cuda import requires_cuda
from tests.multiproc import run_on_ranks
from tests.reference import assert_bitwise

pytest.importorskip("accelerate", reason="the integrations extra is not installed")
pytest.importorskip("transformers", reason="the integrations extra is not installed")

STEPS = 6
INF_STEP = 3
"""The optimizer step (1-based) whose micro-batch on rank 1 has an inf loss."""
WIDTH = 64
PER_RANK = 8
NCCL_ENV = {
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "NCCL_DEBUG": "WARN",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


class _Regressor(torch.nn.Module):
    """An MLP returning its loss; rank 1's ``inf_call``-th training forward returns inf."""

    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 256), torch.nn.ReLU(), torch.nn.Linear(256, WIDTH)
        )
        self.rank = rank
        self.calls = 0

    def forward(self, x, labels):
        loss = torch.nn.functional.mse_loss(self.net(x).float(), labels)
        if self.training:
            self.calls += 1
            if self.rank == 1 and self.calls == INF_STEP:
                loss = loss * math.inf
        return {"loss": loss}


def _data(device=None):
    g = torch.Generator().manual_seed(5)
    n = 2 * PER_RANK * STEPS
    x, y = torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)
    return (x, y) if device is None else (x.to(device), y.to(device))


def _cpu(state: dict) -> dict:
    return {
        str(k): {f: v.cpu() for f, v in s.items() if isinstance(v, torch.Tensor)}
        for k, s in state.items()
    }


def _accelerate(form: str, rank: int) -> dict:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    from overlapkit.integrations.accelerate import use_ok_ddp

    accelerator = Accelerator(mixed_precision="fp16")
    if form == "per_bucket":
        use_ok_ddp(accelerator, optimizer_overlap=True)
    model = _Regressor(rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.3 * s))
    loader = DataLoader(TensorDataset(*_data()), batch_size=PER_RANK)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    skipped, lrs, norms, scales = [], [], [], []
    for x, y in loader:
        accelerator.backward(model(x, y)["loss"])
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        skipped.append(accelerator.optimizer_step_was_skipped)
        lrs.append(schedule.get_last_lr()[0])
        norms.append(norm.detach().cpu().clone())  # a tensor: NaN equals NaN in the check
        scales.append(accelerator.scaler.get_scale())
    torch.cuda.synchronize()
    params = {n.removeprefix("module."): p.detach().cpu() for n, p in model.named_parameters()}
    return {
        "params": params,
        "optim": _cpu(optimizer.optimizer.state_dict()["state"]),
        "skipped": skipped,
        "lrs": lrs,
        "norms": norms,
        "scales": scales,
    }


def _trainer(form: str, rank: int, root: str) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from overlapkit.integrations.hf_trainer import OverlapTrainer

    class Record(TrainerCallback):
        def __init__(self):
            self.skipped, self.lrs, self.trainer = [], [], None

        def on_step_end(self, args, state, control, **kwargs):
            self.skipped.append(self.trainer.accelerator.optimizer_step_was_skipped)
            self.lrs.append(self.trainer.lr_scheduler.get_last_lr()[0])

    x, y = _data()
    rows = [{"x": xi, "labels": yi} for xi, yi in zip(x, y, strict=True)]
    args = TrainingArguments(
        output_dir=os.path.join(root, form),
        per_device_train_batch_size=PER_RANK,
        max_steps=STEPS,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        fp16=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    record = Record()
    common = dict(model=_Regressor(rank), args=args, train_dataset=rows, callbacks=[record])
    if form == "per_bucket":
        trainer = OverlapTrainer(**common, overlapkit_options={"optimizer_overlap": True})
    else:
        trainer = Trainer(**common)
    record.trainer = trainer
    trainer.train()
    torch.cuda.synchronize()
    logs = trainer.state.log_history
    return {
        "params": {n: p.detach().cpu() for n, p in trainer.model.named_parameters()},
        "optim": _cpu(trainer.optimizer.state_dict()["state"]),
        "skipped": record.skipped,
        "lrs": record.lrs,
        "grad_norms": [torch.tensor(e["grad_norm"]) for e in logs if "grad_norm" in e],
    }


def _all(rank: int, world_size: int, root: str) -> dict:
    os.environ["NCCL_HOSTID"] = f"host{rank}"  # before the first collective: NCCL's "hosts"
    os.environ["LOCAL_RANK"] = "0"  # Accelerate and the Trainer: both ranks on cuda:0
    torch.cuda.set_device(0)
    return {
        "accelerate": {form: _accelerate(form, rank) for form in ("plain", "per_bucket")},
        "trainer": {form: _trainer(form, rank, root) for form in ("plain", "per_bucket")},
    }


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cuda_integrations"))
    return run_on_ranks(
        _all, 2, root, backend="nccl", env=NCCL_ENV, collective_timeout_s=60, total_timeout_s=600
    )


@requires_cuda
@pytest.mark.parametrize("framework", ["accelerate", "trainer"])
def test_fp16_overflow_step_is_skipped_with_the_scheduler_as_plain_ddp(cuda_runs, framework):
    for rank, result in enumerate(cuda_runs):
        plain, overlap = result[framework]["plain"], result[framework]["per_bucket"]
        assert_bitwise(overlap, plain, f"rank {rank} {framework}")
        # The inf step was skipped on both ranks, others were not, and the LR stayed there.
        assert overlap["skipped"][INF_STEP - 1] and not all(overlap["skipped"]), overlap
        assert overlap["lrs"][INF_STEP - 1] == overlap["lrs"][INF_STEP - 2]
