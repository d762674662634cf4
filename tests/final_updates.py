"""Weights read right after training, with per-bucket updates: nothing may still be pending.

Run on every rank of ``tests/test_integration_accelerate.py``'s 2-rank launch (``scenarios``),
last: Accelerate's ``end_training`` destroys the process group. A tiny GPT-2 (built here from a
``GPT2Config``, nothing downloaded) trains with per-bucket updates (``OverlapTrainer(...,
overlapkit_options={"optimizer_overlap": True})``, ``use_ok_ddp(accelerator,
optimizer_overlap=True)``) and with the plain Trainer / Accelerate DDP; the parameters are read
directly (``named_parameters``), as a user computing weight statistics or copying to an EMA
does, and must be equal bitwise:

- right after ``Trainer.train()`` returns (no checkpoint at the end, no logging, so nothing else
  reads the model first);
- in an Accelerate loop, after a warm-up and one more step each, right after each call where
  its users read weights: ``unwrap_model``, ``get_state_dict``, ``save_state``,
  ``save_model`` and, last, ``end_training``.

Whether an update is still pending when ``step()`` returns is a race on CPU (``step()`` lands
every bucket whose all-reduce has completed), so the per-bucket Accelerate run orders the ranks:
per call one rank leads and reads its parameters before its peer starts that step's backward,
which holds every all-reduce of the leader's step open. The leader's "still pending" control is
then certain; the follower's is not asserted.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from torch import distributed as dist
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from overlapkit.integrations.accelerate import use_ok_ddp
from overlapkit.integrations.hf_trainer import OverlapTrainer

VOCAB, SEQ, PER_RANK, STEPS = 64, 16, 2, 6
WARMUP = 2
"""Accelerate steps before the first call (the bucketer's first step lands every update)."""
BUCKET_MB = 1e-6
"""Accelerate's run: one parameter per bucket, so updates land bucket by bucket and some are
still pending after ``step()`` (with the default size this tiny model is one bucket)."""
QUIET_CPU_TRAINER = dict(
    use_cpu=True,
    report_to=[],
    save_strategy="no",
    logging_strategy="no",
    disable_tqdm=True,
    dataloader_num_workers=0,
)
"""``TrainingArguments`` of a Trainer on the CPU that saves, logs and reports nothing."""
ACCELERATE_CALLS = ("unwrap_model", "get_state_dict", "save_state", "save_model", "end_training")
"""In this order: ``end_training`` destroys the process group."""


def tiny_gpt2() -> GPT2LMHeadModel:
    """Two layers of width 16, no dropout (the two forms must draw no random numbers)."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def _tokens(count: int, seed: int = 11) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (count, SEQ), generator=g)


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): p.detach().clone() for n, p in module.named_parameters()}


def trainer_final(form: str, root: str) -> dict[str, torch.Tensor]:
    """The parameters read right after ``train()`` returns; ``form`` is ``"plain"`` (Trainer)
    or ``"per_bucket"`` (OverlapTrainer with ``optimizer_overlap``)."""
    tokens = _tokens(2 * PER_RANK * STEPS)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(
        output_dir=os.path.join(root, form),
        per_device_train_batch_size=PER_RANK,
        max_steps=STEPS,
        learning_rate=1e-2,
        seed=3,
        **QUIET_CPU_TRAINER,
    )
    model = tiny_gpt2()
    if form == "per_bucket":
        options = {"optimizer_overlap": True}
        trainer = OverlapTrainer(
            model=model, args=args, train_dataset=data, overlapkit_options=options
        )
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return _params(model)


def _read_after(call: str, accelerator: Accelerator, model: nn.Module, root: str) -> nn.Module:
    """Call ``call`` as a user does, and return the module the user then reads weights from."""
    if call == "unwrap_model":
        return accelerator.unwrap_model(model)
    if call == "get_state_dict":
        accelerator.get_state_dict(model)
    elif call == "save_state":
        accelerator.save_state(os.path.join(root, "state"))
    elif call == "save_model":
        accelerator.save_model(model, os.path.join(root, "model"))
    else:
        accelerator.end_training()
    return model


def leader_of(call: str) -> int:
    """The rank that leads ``call``'s step in the per-bucket run (the ranks take turns)."""
    return ACCELERATE_CALLS.index(call) % 2


def accelerate_final(form: str, root: str) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """After ``WARMUP`` steps, per call of ``ACCELERATE_CALLS``: one more step, the parameters
    read directly before the call (``"stepped"``) and right after it (``"read"``).

    In the per-bucket form ``leader_of(call)`` reads ``"stepped"`` before its peer's backward
    starts (a barrier on a group of its own), so the leader's step is certainly still pending.
    The plain form (Accelerate's DDP, whose backward waits for its peer and whose parameters are
    final when ``step()`` returns) is not ordered and makes no ``end_training`` call: it would
    destroy the process group the per-bucket form needs.
    """
    accelerator = Accelerator(cpu=True)
    if form == "per_bucket":
        use_ok_ddp(accelerator, optimizer_overlap=True, bucket_mb=BUCKET_MB)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    steps = WARMUP + len(ACCELERATE_CALLS)
    batches = _tokens(steps * PER_RANK, seed=13 + accelerator.process_index).split(PER_RANK)
    root = os.path.join(root, form)
    turns = dist.new_group(backend="gloo") if form == "per_bucket" else None
    out = {}
    for step, batch in enumerate(batches):
        call = ACCELERATE_CALLS[step - WARMUP] if step >= WARMUP else None
        follows = turns is not None and call is not None and leader_of(call) != dist.get_rank()
        if follows:
            dist.barrier(group=turns)
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        if call is None:
            continue
        stepped = _params(model)
        if turns is not None and not follows:
            dist.barrier(group=turns)
        read = model if form == "plain" and call == "end_training" else None
        read = read or _read_after(call, accelerator, model, root)
        out[call] = {"stepped": stepped, "read": _params(read)}
    return out


def scenarios(root: str) -> dict:
    """Both forms of both frameworks on this rank; the per-bucket Accelerate run last."""
    out = {
        "trainer": {form: trainer_final(form, root) for form in ("plain", "per_bucket")},
        "accelerate": {"plain": accelerate_final("plain", os.path.join(root, "accelerate"))},
    }
    out["accelerate"]["per_bucket"] = accelerate_final(
        "per_bucket", os.path.join(root, "accelerate")
    )
    return out
