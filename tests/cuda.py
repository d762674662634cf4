"""Marking tests that need a CUDA GPU: ``@requires_cuda`` (``make test-gpu`` runs them).

They are marked ``cuda`` (``pytest -m cuda`` selects them) and skipped, with the reason, where
CUDA is not available; ``make test-gpu`` refuses to start without CUDA, so on a GPU host none is
skipped.
"""

import pytest
import torch

CUDA_SKIP_REASON = "needs a CUDA GPU; `make test-gpu` runs it on a GPU host"


def requires_cuda(test):
    """Mark ``test`` as CUDA-only: the ``cuda`` marker, skipped without CUDA."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_SKIP_REASON)
    return pytest.mark.cuda(skip(test))


NCCL_ONE_HOST_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}
"""What two NCCL ranks of ``run_on_ranks`` on one host need (loopback, no InfiniBand)."""


def nccl_rank_device(rank: int, world_size: int) -> torch.device:
    """This NCCL rank's GPU, set current: its own where there are enough, else GPU 0 shared
    (NCCL then joins the ranks through its socket transport, as two "hosts")."""
    import os

    if torch.cuda.device_count() >= world_size:
        device = torch.device("cuda", rank)
    else:
        os.environ["NCCL_HOSTID"] = f"host{rank}"
        device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device
