"""``use_ok_ddp(optimizer_overlap=True)`` and ``OverlapTrainer`` against plain Accelerate / Trainer.

Run on every rank of ``tests/test_integration_accelerate.py``'s 2-rank launch (``scenarios``).
Each run and its reference share the seed, data and settings: AdamW with two param groups (the
Trainer's default ``create_optimizer`` or one made here), an LR schedule, global-norm clipping
active on some steps only, accumulation over 2 micro-batches, an evaluation in the middle, a
checkpoint that the other form resumes. Rank 1 starts from other weights than rank 0, so both
forms must broadcast rank 0's (DDP does when built). Nothing is downloaded: the model is built
here.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from transformers import Trainer, TrainerCallback, TrainingArguments

import overlapkit as ok
from overlapkit.integrations.accelerate import use_ok_ddp
from overlapkit.integrations.hf_trainer import OverlapTrainer

WIDTH = 16
PER_RANK = 4
ACCUMULATE = 2
STEPS = 8
CHECKPOINT_AT = 3
SNAPSHOT_STEP = 2
# The gradient norms lie between about 0.58 and 0.81 in the Accelerate loop and 0.58 and 0.66
# on the Trainer's logged steps: clipping at these is active on some steps and not on others
# (asserted from the norms).
ACCELERATE_MAX_NORM = 0.7
TRAINER_MAX_NORM = 0.62
BUCKET_MB = 1e-6
"""One parameter per bucket: updates land bucket by bucket (the default would make one)."""


class Regressor(nn.Module):
    """A LayerNorm MLP; returns the loss when given labels, as Hugging Face models do."""

    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(rank)  # rank 1 differs: the forms must broadcast rank 0's weights
        self.net = nn.Sequential(
            nn.Linear(WIDTH, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, WIDTH)
        )

    def forward(self, x, labels=None):
        out = self.net(x)
        return out if labels is None else {"loss": F.mse_loss(out, labels), "logits": out}


def _tensors(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = 2 * PER_RANK * ACCUMULATE * STEPS
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): p.detach().clone() for n, p in module.named_parameters()}


def _state(optimizer: torch.optim.Optimizer) -> dict:
    return {str(k): v for k, v in optimizer.state_dict()["state"].items()}


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW(
        [{"params": rest, "weight_decay": 0.0}, {"params": decay}], lr=0.02, weight_decay=0.1
    )


def accelerate_run(
    form: str,
    root: str,
    *,
    max_norm: float | None = ACCELERATE_MAX_NORM,
    two_calls: bool = False,
    resume: str | None = None,
    scaled: bool = False,
) -> dict:
    """An Accelerate loop; per-bucket when ``form == "per_bucket"``; checkpoints in ``root``.

    ``scaled``: Accelerate's fp16 loss-scaling path in fp32 on CPU (where Accelerate makes no
    GradScaler, so the accelerator is given one through its ``scaler`` attribute), with an inf
    target in the middle of the data: the step it falls in must be skipped on both ranks.
    """
    rank = torch.distributed.get_rank()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    if scaled:
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    overlap = None
    if form == "per_bucket":
        overlap = use_ok_ddp(accelerator, optimizer_overlap=True, bucket_mb=BUCKET_MB)
    model = Regressor(rank)
    optimizer = _adamw(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.3 * s))
    x_train, y_train = _tensors()
    if scaled:
        y_train[len(y_train) // 2] = math.inf
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=PER_RANK)
    if two_calls:
        model = accelerator.prepare(model)
        optimizer, loader, schedule = accelerator.prepare(optimizer, loader, schedule)
    else:
        model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    x_eval = _tensors(seed=7)[0][:PER_RANK]
    norms, evals, ddp, snapshots, skipped, lrs = [], [], [], {}, [], []
    step = 0
    if resume is not None:
        accelerator.load_state(resume)
        step = CHECKPOINT_AT
        loader = accelerator.skip_first_batches(loader, CHECKPOINT_AT * ACCUMULATE)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x), y))
            if accelerator.sync_gradients and max_norm is not None:
                norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        step += 1
        skipped.append(accelerator.optimizer_step_was_skipped)
        lrs.append(schedule.get_last_lr())
        if max_norm is not None:
            norms.append(norm.item())  # right after the step: the norm is final
        ddp.append(isinstance(model, DistributedDataParallel))
        if step == SNAPSHOT_STEP:
            if overlap is not None:
                snapshots["unsynchronized"] = _params(model)
                overlap.bucketer.synchronize()  # before reading parameters directly
            snapshots["synchronized"] = _params(model)
        if step == CHECKPOINT_AT and resume is None:
            accelerator.save_state(os.path.join(root, form))
        with torch.inference_mode():
            evals.append(model(x_eval).clone())  # right after the step, updates pending
    out = {
        "params": _params(model),
        "optim": _state(optimizer),
        "norms": norms,
        "evals": evals,
        "ddp": ddp,
        "snapshots": snapshots,
        "skipped": skipped,
        "lrs": lrs,
    }
    if overlap is not None:
        out["bucketer_steps"] = sorted({r.step for r in ok.comm_stats(overlap.bucketer).records})
    return out


class _Record(TrainerCallback):
    """Per optimizer step: whether the trained model is a DDP, and one snapshot (a control)."""

    def __init__(self):
        self.ddp, self.snapshots, self.trainer = [], {}, None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.ddp.append(isinstance(self.trainer.model_wrapped, DistributedDataParallel))
        if state.global_step == SNAPSHOT_STEP:
            if isinstance(self.trainer, OverlapTrainer):
                self.snapshots["unsynchronized"] = _params(model)
                self.trainer.overlap.bucketer.synchronize()  # before reading parameters
            self.snapshots["synchronized"] = _params(model)


class _LogEveryStep(TrainerCallback):
    """Added after the Trainer was built: logs every step, so the norm is read on every step."""

    def on_step_end(self, args, state, control, **kwargs):
        control.should_log = True


def trainer_run(
    form: str,
    root: str,
    *,
    max_grad_norm: float = TRAINER_MAX_NORM,
    own_optimizer: bool = False,
    resume: str | None = None,
    late_callback: bool = False,
) -> dict:
    """``Trainer`` (plain) or ``OverlapTrainer`` (per-bucket); checkpoints in ``root``;
    ``late_callback``: a ``_LogEveryStep`` added with ``add_callback`` before ``train()``."""
    x, y = _tensors()
    data = [{"x": xi, "labels": yi} for xi, yi in zip(x, y, strict=True)]
    evaluation = [{"x": xi, "labels": yi} for xi, yi in zip(*_tensors(seed=7), strict=True)][:16]
    args = TrainingArguments(
        output_dir=os.path.join(root, form),
        per_device_train_batch_size=PER_RANK,
        per_device_eval_batch_size=PER_RANK,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        learning_rate=0.02,
        weight_decay=0.1,
        lr_scheduler_type="linear",
        max_grad_norm=max_grad_norm,
        eval_strategy="steps",
        eval_steps=CHECKPOINT_AT,
        save_strategy="steps",
        save_steps=CHECKPOINT_AT,
        logging_steps=2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=3,
    )
    model = Regressor(torch.distributed.get_rank())
    record = _Record()
    optimizers = (_adamw(model), None) if own_optimizer else (None, None)
    if form == "per_bucket":
        trainer = OverlapTrainer(
            model=model,
            args=args,
            train_dataset=data,
            eval_dataset=evaluation,
            callbacks=[record],
            optimizers=optimizers,
            overlapkit_options={"optimizer_overlap": True, "bucket_mb": BUCKET_MB},
        )
    else:
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=data,
            eval_dataset=evaluation,
            callbacks=[record],
            optimizers=optimizers,
        )
    record.trainer = trainer
    if late_callback:
        trainer.add_callback(_LogEveryStep())
    trainer.train(resume_from_checkpoint=resume)
    logs = trainer.state.log_history
    out = {
        "params": _params(model),
        "optim": _state(trainer.optimizer),
        "grad_norms": [(e["step"], e["grad_norm"]) for e in logs if "grad_norm" in e],
        "eval_losses": [(e["step"], e["eval_loss"]) for e in logs if "eval_loss" in e],
        "ddp": record.ddp,
        "snapshots": record.snapshots,
        "param_groups": len(trainer.optimizer.param_groups),
    }
    if form == "per_bucket":
        records = ok.comm_stats(trainer.overlap.bucketer).records
        out["bucketer_steps"] = sorted({r.step for r in records})
    return out


def _refused(run) -> str:
    try:
        run()
    except ValueError as error:
        return str(error)
    return "not refused"


def scenarios(root: str) -> dict:
    """Every per-bucket run and its reference, on this rank."""
    acc = os.path.join(root, "accelerate")
    out = {"accelerate": {form: accelerate_run(form, acc) for form in ("plain", "per_bucket")}}
    out["accelerate"]["two_calls"] = accelerate_run("per_bucket", acc + "-two", two_calls=True)
    out["accelerate"]["unclipped"] = accelerate_run("per_bucket", acc + "-free", max_norm=None)
    out["accelerate"]["scaled"] = {
        form: accelerate_run(form, acc + "-scaled", max_norm=None, scaled=True)
        for form in ("plain", "per_bucket")
    }
    out["accelerate"]["resumed"] = {
        (form, by): accelerate_run(form, acc, resume=os.path.join(acc, by))
        for form, by in (("per_bucket", "plain"), ("plain", "per_bucket"))
    }
    hf = os.path.join(root, "trainer")
    out["trainer"] = {form: trainer_run(form, hf) for form in ("plain", "per_bucket")}
    checkpoint = f"checkpoint-{CHECKPOINT_AT}"
    out["trainer"]["resumed"] = {
        (form, by): trainer_run(
            form,
            os.path.join(root, f"trainer-{form}-{by}"),
            resume=os.path.join(hf, by, checkpoint),
        )
        for form, by in (("per_bucket", "plain"), ("plain", "per_bucket"))
    }
    # max_grad_norm=0: no clipping, the norm still logged.
    out["trainer"]["no_clip"] = {
        form: trainer_run(form, os.path.join(root, "noclip"), max_grad_norm=0.0)
        for form in ("plain", "per_bucket")
    }
    out["trainer"]["late_callback"] = {
        form: trainer_run(form, os.path.join(root, "late"), late_callback=True)
        for form in ("plain", "per_bucket")
    }
    out["trainer"]["own_optimizer"] = {
        form: trainer_run(form, os.path.join(root, "own"), own_optimizer=True)
        for form in ("plain", "per_bucket")
    }
    out["refused"] = {
        "sync_each_batch": _refused(
            lambda: use_ok_ddp(
                Accelerator(
                    cpu=True,
                    gradient_accumulation_plugin=_sync_each_batch_plugin(),
                ),
                optimizer_overlap=True,
            )
        ),
        "compress": _refused(
            lambda: use_ok_ddp(Accelerator(cpu=True), optimizer_overlap=True, compress="bf16")
        ),
        "clip_value": _refused(_clip_value_after_prepare),
        "trainer_sync_each_batch": _refused(lambda: _trainer_syncing_each_batch(root)),
    }
    return out


def _trainer_syncing_each_batch(root: str) -> None:
    sync_each_batch = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    args = TrainingArguments(
        output_dir=os.path.join(root, "sync_each_batch"),
        use_cpu=True,
        report_to=[],
        accelerator_config=sync_each_batch,
    )
    OverlapTrainer(model=Regressor(0), args=args, overlapkit_options={"optimizer_overlap": True})


def _sync_each_batch_plugin():
    from accelerate.utils import GradientAccumulationPlugin

    return GradientAccumulationPlugin(num_steps=ACCUMULATE, sync_each_batch=True)


def _clip_value_after_prepare() -> None:
    accelerator = Accelerator(cpu=True)
    use_ok_ddp(accelerator, optimizer_overlap=True)
    model = Regressor(0)
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.clip_grad_value_(model.parameters(), 0.1)
