"""An MLP of identical blocks: the simplest model whose gradients are all large matrices."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(kw_only=True)
class MLPConfig:
    width: int = 1024
    """Features of every block's input and output."""
    n_layer: int = 8
    """Number of ``Linear(width, width) + ReLU`` blocks."""

    def __post_init__(self):
        for name in ("width", "n_layer"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLPConfig.{name} must be >= 1, got {getattr(self, name)}")


class MLP(nn.Module):
    """``n_layer`` blocks of ``Linear(width, width)`` + ReLU; input and output ``(B, width)``."""

    def __init__(self, config: MLPConfig):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(config.width, config.width), nn.ReLU())
            for _ in range(config.n_layer)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x
