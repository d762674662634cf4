"""``OverlapDDPStrategy(optimizer_overlap=True)`` against Lightning's own ``DDPStrategy``.

Run on every rank of ``tests/test_integration_lightning.py``'s 2-rank launch (``scenarios``).
Each fit uses the same seed, data and Trainer settings as its reference: AdamW with two param
groups listed in another order than the module's parameters (Lightning clips over the groups'
order), a LambdaLR stepped per optimizer step, ``gradient_clip_val`` active on some steps only,
``accumulate_grad_batches=2``, validation in the middle of the epoch (under
``torch.inference_mode``, right after the first step that updates ``extra``, so that its optimizer
state is created there), a checkpoint every ``CHECKPOINT_EVERY`` steps, resumed in the other form;
a parameter read by ``training_step`` itself (``scale``), other initial weights on rank 1 (both
forms must broadcast rank 0's), and 16-mixed through an explicit
``MixedPrecision("16-mixed", "cpu")`` plugin (the default turns it into bf16 on CPU) whose
GradScaler starts high enough to skip steps.
"""

from __future__ import annotations

import os

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import overlapkit as ok
from overlapkit.integrations.lightning import OverlapDDPStrategy

WIDTH = 16
PER_RANK = 4
ACCUMULATE = 2
STEPS = 8
CHECKPOINT_EVERY = 3
SNAPSHOT_STEP = 3
INFERENCE_STEP = 2
"""The first optimizer step that updates ``extra`` (used from the second on)."""
"""The optimizer step after which parameters are read directly (a control)."""
# The norms over these batches lie between about 0.65 and 1.35: clipping at 0.9 is active on
# some steps and not on others (asserted from the norms).
MAX_NORM = 0.9
FP16_INIT_SCALE = 2.0**21
BUCKET_MB = 1e-6
"""One parameter per bucket: updates land bucket by bucket (the default would make one)."""


class Net(L.LightningModule):
    """An MLP, a head used from the second optimizer step on, and a parameter of its own."""

    def __init__(self, batch_norm: bool = False, manual: bool = False):
        super().__init__()
        # Rank 1 starts from other weights: both forms must broadcast rank 0's (DDP does).
        torch.manual_seed(int(os.environ["RANK"]))
        self.net = nn.Sequential(
            nn.Linear(WIDTH, 32),
            nn.BatchNorm1d(32) if batch_norm else nn.LayerNorm(32),
            nn.ReLU(),
            nn.Linear(32, WIDTH),
        )
        self.extra = nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.automatic_optimization = not manual

    def training_step(self, batch, _batch_idx):
        x, y = batch
        out = self.net(x)
        if self.global_step >= 1:
            out = out + self.extra(x)
        return F.mse_loss(out * self.scale, y)

    def forward(self, x):
        return (self.net(x) + self.extra(x)) * self.scale

    def validation_step(self, batch, _batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        optimizer = torch.optim.AdamW(
            [{"params": rest, "weight_decay": 0.0}, {"params": decay}], lr=0.02, weight_decay=0.1
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.3 * s))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Record(Callback):
    """Per optimizer step: the clipped norm (as each form offers it), the GradScaler's scale,
    whether the trained model is a DDP; after ``SNAPSHOT_STEP``, the parameters read directly
    (per-bucket: first without synchronizing, the control, then after ``synchronize()``)."""

    def __init__(self):
        self.norms, self.scales, self.ddp, self.snapshots = [], [], [], {}
        self.inference = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # Plain DDP: the gradients are reduced here; this is the norm clip_grad_norm_ returns.
        if not isinstance(trainer.strategy, OverlapDDPStrategy):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            grads = [p.grad for p in params if p.grad is not None]
            self.norms.append(torch.nn.utils.get_total_norm(grads).clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % ACCUMULATE:
            return
        self.ddp.append(isinstance(trainer.strategy.model, DistributedDataParallel))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scales.append(scaler.get_scale())
        per_bucket = isinstance(trainer.strategy, OverlapDDPStrategy)
        if trainer.global_step == INFERENCE_STEP:
            # A callback's sample under inference_mode, right after the first step that updates
            # `extra`: per-bucket, that update (and its new optimizer state) runs in here.
            with torch.inference_mode():
                self.inference = pl_module(batch[0]).clone()
        if trainer.global_step == SNAPSHOT_STEP:
            if per_bucket:
                self.snapshots["unsynchronized"] = _params(pl_module)
                trainer.strategy.bucketer.synchronize()  # before reading parameters directly
            self.snapshots["synchronized"] = _params(pl_module)
        if per_bucket and trainer.gradient_clip_val:
            norm = trainer.strategy.bucketer.total_norm()  # the clipped step's norm, to log
            self.norms.append(norm.clone())


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    n = 2 * PER_RANK * ACCUMULATE * STEPS
    return TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g))


def fit(
    form: str,
    root: str,
    *,
    clip: float | None = MAX_NORM,
    fp16: bool = False,
    resume: str | None = None,
    model: Net | None = None,
    accumulate: int = ACCUMULATE,
    clip_algorithm: str | None = None,
) -> dict:
    """One fit of ``form`` ("plain" or "per_bucket"); checkpoints go to ``root/form``."""
    model = model or Net()
    record = Record()
    plugins = []
    if fp16:
        scaler = torch.amp.GradScaler("cpu", init_scale=FP16_INIT_SCALE, growth_interval=2)
        plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    if form == "per_bucket":
        strategy = OverlapDDPStrategy(optimizer_overlap=True, bucket_mb=BUCKET_MB)
    else:
        strategy = DDPStrategy(find_unused_parameters=True)  # `extra` is unused in step 1
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        gradient_clip_val=clip,
        gradient_clip_algorithm=clip_algorithm,
        accumulate_grad_batches=accumulate,
        val_check_interval=2 * ACCUMULATE,
        limit_val_batches=2,
        plugins=plugins,
        callbacks=[
            record,
            ModelCheckpoint(
                dirpath=os.path.join(root, form),
                every_n_train_steps=CHECKPOINT_EVERY,
                save_top_k=-1,
            ),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(_data(), batch_size=PER_RANK)
    trainer.fit(model, loader, loader, ckpt_path=resume)
    optimizer = trainer.optimizers[0]
    out = {
        "params": _params(model),
        "optim": {str(k): v for k, v in optimizer.state_dict()["state"].items()},
        "norms": record.norms,
        "scales": record.scales,
        "ddp": record.ddp,
        "snapshots": record.snapshots,
        "inference": record.inference,
        "global_step": trainer.global_step,
        "inference_state": any(
            t.is_inference() for s in optimizer.state.values() for t in s.values()
        ),
    }
    bucketer = getattr(trainer.strategy, "bucketer", None)
    if bucketer is not None:
        out["bucketer_steps"] = sorted({r.step for r in ok.comm_stats(bucketer).records})
    return out


def checkpoint(root: str, form: str) -> str:
    return os.path.join(root, form, f"epoch=0-step={CHECKPOINT_EVERY}.ckpt")


def checkpoint_contents(path: str) -> dict:
    saved = torch.load(path, weights_only=False)
    return {"state_dict": saved["state_dict"], "optim": saved["optimizer_states"][0]["state"]}


def refusal(case: str, root: str) -> str:
    """The error a setup per-bucket updates refuse raises (from ``fit`` on every rank)."""
    options = {
        "value_clip": dict(clip_algorithm="value"),
        "manual": dict(model=Net(manual=True), clip=None, accumulate=1),
        "batch_norm": dict(model=Net(batch_norm=True)),
    }[case]
    try:
        fit("per_bucket", os.path.join(root, case), **options)
    except ValueError as error:
        return str(error)
    return "not refused"


def scenarios(root: str) -> dict:
    """Every per-bucket fit and its reference, on this rank."""
    out = {form: fit(form, os.path.join(root, "run")) for form in ("plain", "per_bucket")}
    out["per_bucket_unclipped"] = fit("per_bucket", os.path.join(root, "unclipped"), clip=None)
    out["checkpoints"] = {
        form: checkpoint_contents(checkpoint(os.path.join(root, "run"), form))
        for form in ("plain", "per_bucket")
    }
    out["resumed"] = {
        (form, by): fit(
            form,
            os.path.join(root, f"resume-{form}-{by}"),
            resume=checkpoint(os.path.join(root, "run"), by),
        )
        for form, by in (("plain", "plain"), ("per_bucket", "plain"), ("plain", "per_bucket"))
    }
    out["fp16"] = {
        form: fit(form, os.path.join(root, "fp16"), fp16=True) for form in ("plain", "per_bucket")
    }
    try:
        OverlapDDPStrategy(optimizer_overlap=True, compress="bf16")
        out["compress_refused"] = "not refused"
    except ValueError as error:
        out["compress_refused"] = str(error)
    out["refused"] = {case: refusal(case, root) for case in ("value_clip", "manual", "batch_norm")}
    return out
