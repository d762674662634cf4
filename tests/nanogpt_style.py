"""karpathy/nanoGPT's ``train.py`` loop, adopted to ``GradBucketer(optimizer=)`` with four edits.

    torchrun --standalone --nproc-per-node 2 -m tests.nanogpt_style OUT_DIR

(``tests/test_nanogpt_style.py`` runs it.) For ``grad_clip`` 1.0 and 0.0 it trains a tiny GPT
with tied weights twice: the synchronous form (``GradBucketer(model)``, ``wait()``, then
nanoGPT's own unscale / clip / ``scaler.step`` lines) and the overlap form. The loop keeps what
nanoGPT does: gradient accumulation (4 micro-steps, all but the last without communication),
LR writes into ``param_groups``, an evaluation under ``no_grad`` in eval mode every
``EVAL_INTERVAL`` iterations, a checkpoint of ``raw_model.state_dict()`` and
``optimizer.state_dict()`` written by rank 0, a disabled ``GradScaler`` (float32), and
``optimizer.zero_grad(set_to_none=True)`` after the step. The process then destroys the
group and exits right after the overlap form's last ``step()``. Rank 0 writes the losses,
checkpoints and final parameters of both forms to ``OUT_DIR``.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import sys

import torch
import torch.distributed as dist

saved: dict[str, object] = {}


def _save() -> None:
    """At exit, after overlapkit's exit hooks (registered later, so run earlier): the pending
    last step must be applied by the time the parameters are read here, directly."""
    if saved:
        params = {
            key: {n: p.detach().clone() for n, p in m.named_parameters()}
            for key, m in saved["models"].items()
        }
        path = os.path.join(saved["out_dir"], f"rank{saved['rank']}.pt")
        torch.save({"runs": saved["runs"], "params": params}, path)


atexit.register(_save)

import overlapkit as ok  # noqa: E402 (after the atexit registration, on purpose)
from overlapkit.train.models import GPT, GPTConfig  # noqa: E402

GRADIENT_ACCUMULATION_STEPS = 4
MAX_ITERS = 8
EVAL_INTERVAL = 4
EVAL_ITERS = 2
BATCH_SIZE, BLOCK_SIZE = 4, 16
LEARNING_RATE, MIN_LR, WARMUP_ITERS, LR_DECAY_ITERS = 6e-3, 6e-4, 2, 8


def get_lr(it: int) -> float:
    """nanoGPT's schedule: linear warmup, cosine decay to ``MIN_LR``."""
    if it < WARMUP_ITERS:
        return LEARNING_RATE * (it + 1) / (WARMUP_ITERS + 1)
    if it > LR_DECAY_ITERS:
        return MIN_LR
    ratio = (it - WARMUP_ITERS) / (LR_DECAY_ITERS - WARMUP_ITERS)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LEARNING_RATE - MIN_LR)


def get_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, 64, (BATCH_SIZE, BLOCK_SIZE + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def configure_optimizers(model: GPT) -> torch.optim.AdamW:
    """nanoGPT's: weight decay on the 2-D parameters only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=(0.9, 0.95))


def train(form: str, grad_clip: float, rank: int, out_dir: str) -> dict:
    torch.manual_seed(1337)
    model = GPT(GPTConfig(vocab_size=64, block_size=BLOCK_SIZE, n_layer=2, n_head=2, n_embd=32))
    optimizer = configure_optimizers(model)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT: enabled for float16 only
    ctx = contextlib.nullcontext()  # nanoGPT: torch.amp.autocast on GPUs
    if form == "overlap":
        # --- the adoption (docs/optimizer-overlap.md) -------------------------------------
        bucketer = ok.GradBucketer(model, optimizer=optimizer)  # edit 1: instead of DDP(model)
        raw_model = model  # edit 2: no .module to unwrap
        # -------------------------------------------------------------------------------------
    else:
        bucketer = ok.GradBucketer(model)
        raw_model = model
    data = torch.Generator().manual_seed(rank)
    evals = torch.Generator().manual_seed(100 + rank)
    losses, checkpoints = [], []

    @torch.no_grad()
    def estimate_loss() -> float:
        model.eval()
        losses = torch.zeros(EVAL_ITERS)
        for k in range(EVAL_ITERS):
            x, y = get_batch(evals)
            losses[k] = GPT.loss(model(x), y).item()
        model.train()
        return losses.mean().item()

    X, Y = get_batch(data)
    iter_num = 0
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % EVAL_INTERVAL == 0:
            losses.append(("val", iter_num, estimate_loss()))
            if iter_num > 0 and rank == 0:
                checkpoint = {
                    "model": raw_model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "iter_num": iter_num,
                }
                path = os.path.join(out_dir, f"ckpt-{form}-{grad_clip}-{iter_num}.pt")
                torch.save(checkpoint, path)
                checkpoints.append(path)
        for micro_step in range(GRADIENT_ACCUMULATION_STEPS):
            last = micro_step == GRADIENT_ACCUMULATION_STEPS - 1
            # edit 3: instead of model.require_backward_grad_sync = last
            with contextlib.nullcontext() if last else bucketer.no_sync():
                with ctx:
                    loss = GPT.loss(model(X), Y) / GRADIENT_ACCUMULATION_STEPS
                X, Y = get_batch(data)
                scaler.scale(loss).backward()
        if form == "overlap":
            # edit 4: instead of unscale_ / clip_grad_norm_ / scaler.step(optimizer)
            bucketer.step(clip_grad_norm=grad_clip if grad_clip != 0.0 else None, scaler=scaler)
            scaler.update()
        else:
            bucketer.wait()
            if grad_clip != 0.0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(("train", iter_num, loss.item() * GRADIENT_ACCUMULATION_STEPS))
        iter_num += 1
        if iter_num > MAX_ITERS:
            break
    return {"model": model, "losses": losses, "checkpoints": checkpoints}


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    runs = {}
    for grad_clip in (1.0, 0.0):
        for form in ("sync", "overlap"):  # the overlap form goes last: the loop ends in step()
            runs[form, grad_clip] = train(form, grad_clip, rank, out_dir)
    models = {key: run.pop("model") for key, run in runs.items()}
    saved.update(models=models, runs=runs, rank=rank, out_dir=out_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
