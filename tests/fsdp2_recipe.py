"""The standard FSDP2 recipe, as pytorch/examples' ``distributed/FSDP2/example.py`` runs it.

Build the model on the meta device, shard it (there: ``fully_shard`` on each layer, then on the
model, with the script's ``fsdp_kwargs``), optionally set explicit prefetch two layers ahead
(``--explicit-prefetching``, with ``model.unshard()`` before each forward), ``to_empty`` onto
the device, initialise, train with Adam and global-norm clipping, and checkpoint. ``run`` takes
the sharding as a function, so the same recipe runs with plain ``fully_shard`` and with
``ok.fsdp``; ``tests/test_fsdp_scripts.py`` compares them. The model is a small GPT written
here (the example's is the same kind: embeddings, pre-norm attention and MLP layers, a head).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

LAYERS, VOCAB, DIM, HEADS, SEQ, BATCH = 4, 64, 16, 4, 16, 4
STEPS = 3
RESUMED_STEPS = 2
PREFETCH_AHEAD = 2  # the example's num_to_forward_prefetch / num_to_backward_prefetch
FULL = StateDictOptions(full_state_dict=True)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, head dim)
        return self.wo(y.transpose(1, 2).reshape(b, t, DIM))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attention = Attention()
        self.feed_forward = nn.Sequential(
            nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings, self.pos_embeddings = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()

    def reset_parameters(self) -> None:
        """Every sub-module's own initialisation, on the (sharded) parameters."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
                module.reset_parameters()


def set_explicit_prefetching(model: Transformer, ahead: int = PREFETCH_AHEAD) -> None:
    """The example's ``--explicit-prefetching``: each layer gathers the next (forward) or the
    previous (backward) ``ahead`` layers; layers with fewer than ``ahead`` left keep theirs."""
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        if i + ahead < len(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + ahead])
        if i >= ahead:
            layer.set_modules_to_backward_prefetch(layers[i - ahead : i][::-1])


def _tokens(step: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)


def _train(
    model: nn.Module, optim: torch.optim.Optimizer, steps: range, explicit: bool, device: str
) -> list:
    losses = []
    for step in steps:
        if explicit:
            model.unshard()
        loss = model(_tokens(step, device)).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def _build(shard: Callable[[nn.Module], nn.Module], explicit: bool) -> nn.Module:
    with torch.device("meta"):
        model = Transformer()
    model = shard(model)
    if explicit:
        set_explicit_prefetching(model)
    return model


def run(
    shard: Callable[[nn.Module], nn.Module],
    root: str,
    *,
    explicit: bool = False,
    resume: bool = True,
    device: str = "cpu",
    materialize_on: str = "cpu",
) -> dict:
    """The recipe with ``shard`` (a meta model in, the sharded model out); checkpoints in
    ``root``. Returns the initial and trained parameters, the losses, the parameters after
    each resumed run (with ``resume``; else the checkpoint is saved only), and the trained model
    (for ``ok.fsdp_stats``). ``device`` computes, ``materialize_on`` holds the sharded
    parameters (the CPU under ``CPUOffloadPolicy``)."""
    model = _build(shard, explicit)
    model.to_empty(device=materialize_on)
    torch.manual_seed(0)
    model.reset_parameters()
    initial = _full_params(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = _train(model, optim, range(STEPS), explicit, device)
    trained = _full_params(model)
    sharded = dict(zip(("model", "optim"), get_state_dict(model, optim), strict=True))
    dcp.save(sharded, checkpoint_id=os.path.join(root, "dcp"))
    full_model = get_model_state_dict(model, options=FULL)
    full_optim = get_optimizer_state_dict(model, optim, options=FULL)
    continued = _train(model, optim, range(STEPS, STEPS + RESUMED_STEPS), explicit, device)
    out = {
        "initial": initial,
        "trained": trained,
        "losses": losses + continued,
        "continued": _full_params(model),
        "model": model,
    }
    if resume:
        path = os.path.join(root, "dcp")
        out["resumed_dcp"] = _resume_dcp(shard, explicit, path, device, materialize_on)
        out["resumed_full"] = _resume_full(shard, explicit, full_model, full_optim, device)
    return out


def _resume_dcp(
    shard: Callable[[nn.Module], nn.Module],
    explicit: bool,
    path: str,
    device: str,
    materialize_on: str,
) -> dict:
    """A fresh meta model, sharded, ``to_empty``, then DCP's sharded load of model and Adam."""
    model = _build(shard, explicit)
    model.to_empty(device=materialize_on)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(model, optim, range(STEPS, STEPS + RESUMED_STEPS), explicit, device)
    return _full_params(model)


def _resume_full(
    shard: Callable[[nn.Module], nn.Module],
    explicit: bool,
    full_model: dict,
    full_optim: dict,
    device: str,
) -> dict:
    """The example's own resume: the full state dict broadcast from rank 0 onto the meta model
    (``set_model_state_dict(..., broadcast_from_rank0=True)``), then the optimizer's."""
    model = _build(shard, explicit)
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, {k: v.clone() for k, v in full_model.items()}, options=broadcast)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    set_optimizer_state_dict(model, optim, full_optim, options=FULL)
    _train(model, optim, range(STEPS, STEPS + RESUMED_STEPS), explicit, device)
    return _full_params(model)
