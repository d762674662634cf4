"""The small training workload the doctor and the benchmarks time: a model and one rank's batch.

``make_workload`` returns a model factory and the loss on this rank's batch. Every model it
builds has the same weights (on every rank, at every call), so that wrappers timed side by side
start alike; each rank's batch is its own (seeded by the rank), as data parallelism splits one.

Example::

    >>> workload = make_workload("mlp", rank=0, **DEFAULT_SIZES["mlp"])
    >>> model = ok.ddp(workload.new_model())
    >>> workload.loss(model).backward()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from overlapkit.train.models.gpt import GPT, GPTConfig
from overlapkit.train.models.mlp import MLP, MLPConfig

MODELS = ("mlp", "gpt_tiny")
DEFAULT_SIZES = {
    "mlp": {"layers": 8, "width": 1024, "batch": 64},
    "gpt_tiny": {"layers": 4, "width": 256, "batch": 2},
}
"""Per model: blocks, block width and the batch per rank (rows of the MLP, sequences of
``seq_len`` tokens of gpt_tiny)."""


@dataclass(frozen=True, slots=True)
class Workload:
    new_model: Callable[[], nn.Module]
    """A fresh model on the workload's device; the same weights on every rank and every call."""
    loss: Callable[[nn.Module], torch.Tensor]
    """The scalar loss of a model on this rank's batch (its forward included)."""
    items: int
    """Items one rank processes per step: rows (mlp) or tokens (gpt_tiny)."""


def make_workload(
    model: str,
    *,
    rank: int,
    layers: int,
    width: int,
    batch: int,
    seq_len: int = 64,
    device: torch.device | str = "cpu",
) -> Workload:
    """This rank's workload: ``mlp`` (MSE on random rows) or ``gpt_tiny`` (next-token loss).

    Args:
        model (str): ``"mlp"`` (``layers`` blocks of ``Linear(width)`` + ReLU) or
            ``"gpt_tiny"`` (``layers`` transformer blocks of width ``width``).
        rank (int): seeds this rank's batch.
        layers (int): blocks of the model.
        width (int): block width (features).
        batch (int): rows (mlp) or sequences (gpt_tiny) per rank.
        seq_len (int): tokens per gpt_tiny sequence. Defaults to 64.
        device (torch.device | str): where the model and the batch live. Defaults to CPU.

    Raises:
        ValueError: ``model`` is not one of ``MODELS``.
    """
    g = torch.Generator().manual_seed(rank)
    if model == "mlp":
        mlp_config = MLPConfig(width=width, n_layer=layers)
        x = torch.randn(batch, width, generator=g).to(device)
        y = torch.randn(batch, width, generator=g).to(device)

        def new_mlp() -> nn.Module:
            torch.manual_seed(0)
            return MLP(mlp_config).to(device)

        return Workload(new_mlp, lambda m: (m(x) - y).pow(2).mean(), batch)
    if model != "gpt_tiny":
        raise ValueError(f"workload model must be one of {list(MODELS)}, got {model!r}")
    gpt_config = GPTConfig(n_layer=layers, n_embd=width, block_size=seq_len)
    tokens = torch.randint(0, gpt_config.vocab_size, (batch, seq_len + 1), generator=g).to(device)

    def new_gpt() -> nn.Module:
        torch.manual_seed(0)
        return GPT(gpt_config).to(device)

    return Workload(new_gpt, lambda m: GPT.loss(m(tokens[:, :-1]), tokens[:, 1:]), batch * seq_len)
