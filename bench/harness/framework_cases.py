"""One timed training run per framework case, for ``bench.integrations_overlap``.

Each case trains the benchmark's model with AdamW and the framework's own global-norm clipping
(``max_norm``; the HF Trainer's default ``max_grad_norm`` is 1.0; 0 turns clipping off, and the
HF Trainer then still measures the norm) for ``total`` optimizer steps, and
calls ``clock.tick()`` when each optimizer step has returned (Lightning's ``on_train_batch_end``,
the HF Trainer's ``on_step_end``, the line after ``optimizer.step()`` in the Accelerate loop).
With per-bucket updates the last buckets' all-reduces and updates are then still pending, so the
interval between two ticks is the steady step: it contains what the next forward waits for.

Cases, per framework ``lightning``, ``accelerate`` and ``trainer`` (the HF Trainer):
    <fw>_ddp         the framework's DDP with its defaults (25 MiB buckets)
    <fw>_ddp_tuned   the same DDP with the bucketer's bucket size (and, where the framework
                     passes it, ``gradient_as_bucket_view=True``), as bench.ddp_overlap's ddp_opt
    <fw>_per_bucket  overlapkit's per-bucket mode: no DDP, ``ok.GradBucketer(optimizer=)``
"""

from __future__ import annotations

import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from overlapkit.ddp.bucket_size import default_bucket_mb

LR = 1e-4
FRAMEWORKS = ("lightning", "accelerate", "trainer")
FORMS = ("ddp", "ddp_tuned", "per_bucket")
CASES = tuple(f"{fw}_{form}" for fw in FRAMEWORKS for form in FORMS)


class StepClock:
    """Times of the optimizer steps' ends; also steps a profiler, when given one."""

    def __init__(self, prof: object | None = None):
        self.times: list[float] = []
        self.prof = prof

    def tick(self) -> None:
        self.times.append(time.perf_counter())
        if self.prof is not None:
            self.prof.step()

    def median_ms(self, warmup: int) -> float:
        """The median interval between consecutive step ends after ``warmup`` steps, in ms."""
        ends = self.times[warmup:]
        return 1e3 * statistics.median(b - a for a, b in itertools.pairwise(ends))


def _data(workload_model: nn.Module, batch: int, total: int, rank: int) -> TensorDataset:
    """Two ranks' rows for ``total`` steps: each rank's sampler takes its own half."""
    width = next(workload_model.parameters()).shape[1]
    g = torch.Generator().manual_seed(rank)
    n = 2 * batch * total
    return TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g))


def run_case(
    name: str,
    new_model: Callable[[], nn.Module],
    batch: int,
    total: int,
    clock: StepClock,
    max_norm: float,
) -> None:
    """Train case ``name`` for ``total`` optimizer steps of ``batch`` rows per rank."""
    framework, form = name.split("_", 1)
    model = new_model()
    data = _data(model, batch, total, torch.distributed.get_rank())
    bucket_mb = default_bucket_mb(list(model.parameters()))
    {"lightning": _lightning, "accelerate": _accelerate, "trainer": _trainer}[framework](
        form, model, data, batch, total, bucket_mb, clock, max_norm
    )


def _lightning(form, model, data, batch, total, bucket_mb, clock, max_norm) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy

    from overlapkit.integrations.lightning import OverlapDDPStrategy

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model

        def training_step(self, batch_, _index):
            x, y = batch_
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    class Tick(Callback):
        def on_train_batch_end(self, *_args):
            clock.tick()

    strategy = {
        "ddp": lambda: DDPStrategy(),
        "ddp_tuned": lambda: DDPStrategy(bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True),
        "per_bucket": lambda: OverlapDDPStrategy(optimizer_overlap=True),
    }[form]()
    environment = dict(os.environ)  # Lightning's teardown deletes WORLD_SIZE
    try:
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=2,
            max_steps=total,
            gradient_clip_val=max_norm or None,
            callbacks=[Tick()],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(Module(), DataLoader(data, batch_size=batch))
    finally:
        os.environ.clear()
        os.environ.update(environment)


def _accelerate(form, model, data, batch, total, bucket_mb, clock, max_norm) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from overlapkit.integrations.accelerate import use_ok_ddp

    handlers = []
    if form == "ddp_tuned":
        tuned = DistributedDataParallelKwargs(bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
        handlers = [tuned]
    accelerator = Accelerator(cpu=True, kwargs_handlers=handlers)
    if form == "per_bucket":
        use_ok_ddp(accelerator, optimizer_overlap=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(data, batch_size=batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        accelerator.backward(F.mse_loss(model(x), y))
        if max_norm:
            accelerator.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        clock.tick()


class _Regressor(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, labels):
        return {"loss": F.mse_loss(self.net(x), labels)}


def _trainer(form, model, data, batch, total, bucket_mb, clock, max_norm) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from overlapkit.integrations.hf_trainer import OverlapTrainer

    class Tick(TrainerCallback):
        def on_step_end(self, *_args, **_kwargs):
            clock.tick()

    x, y = data.tensors
    rows = [{"x": xi, "labels": yi} for xi, yi in zip(x, y, strict=True)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=batch,
            max_steps=total,
            learning_rate=LR,
            max_grad_norm=max_norm,
            ddp_bucket_cap_mb=bucket_mb if form == "ddp_tuned" else None,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        common = dict(model=_Regressor(model), args=args, train_dataset=rows, callbacks=[Tick()])
        if form == "per_bucket":
            trainer = OverlapTrainer(**common, overlapkit_options={"optimizer_overlap": True})
        else:
            trainer = Trainer(**common)
        trainer.train()
