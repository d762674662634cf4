"""The models the benchmarks train: overlapkit's workload (the doctor's too) and a block MLP."""

from __future__ import annotations

import torch
from torch import nn

from overlapkit.train.models.workload import Workload, make_workload


def workload_of(cfg: dict, rank: int) -> Workload:
    """``make_workload`` of a benchmark config (``model``, ``layers``, ``width``, ``batch``,
    ``seq_len`` and, optionally, ``device``) for this rank."""
    return make_workload(
        cfg["model"],
        rank=rank,
        layers=cfg["layers"],
        width=cfg["width"],
        batch=cfg["batch"],
        seq_len=cfg["seq_len"],
        device=cfg.get("device", "cpu"),
    )


def make_mlp(blocks: int, width: int) -> nn.Sequential:
    """``blocks`` blocks of ``Linear(width, width)`` + ReLU, each an ``nn.Sequential`` (what
    ``ok.fsdp`` shards and ``set_explicit_prefetch`` links); the same weights at every call."""
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks))
    )
