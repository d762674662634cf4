"""Where a benchmark's ranks compute: gloo ranks on CPU, or NCCL ranks sharing GPU 0.

NCCL refuses two ranks on one GPU of one host ("Duplicate GPU detected"). A host id per rank
(``NCCL_HOSTID``) makes them two hosts, joined by NCCL's socket transport over loopback: real
NCCL kernels and a real (slow) network on one GPU. Without CUDA MPS the ranks' kernels
time-slice the GPU, which distorts overlap; ``bench/gpu/*.sh`` start MPS first (see
docs/emulation.md).
"""

from __future__ import annotations

import os

import torch


def share_gpu_zero(rank: int) -> None:
    """Make this rank its own NCCL "host" on GPU 0, joined to the others over loopback.

    NCCL reads these variables when it creates its communicator (at the first collective of a
    group), so call this before that; values already set in the environment are kept.
    """
    os.environ.setdefault("NCCL_HOSTID", f"host{rank}")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    torch.cuda.set_device(0)


def backend_for(cfg: dict) -> str:
    """The process group backend of ``cfg["device"]``: NCCL on CUDA, gloo on CPU."""
    return "nccl" if cfg.get("device") == "cuda" else "gloo"


def settle(cfg: dict) -> None:
    """Wait for the device's queued work, so that a host clock read after it measures it."""
    if cfg.get("device") == "cuda":
        torch.cuda.synchronize()


def enter_device(cfg: dict, rank: int) -> None:
    """On CUDA (``cfg["device"] == "cuda"``): this rank shares GPU 0 (``share_gpu_zero``)."""
    if cfg.get("device") == "cuda":
        share_gpu_zero(rank)
