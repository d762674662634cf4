"""FSDP2 custom comms that make all-gathers and reduce-scatters overlap on host (gloo) devices.

Why FSDP2's own prefetch does not overlap on CPU (torch 2.13, ``fsdp/_fully_shard``):

- FSDP2 overlaps by *streams*: ``FSDPCommContext`` issues all-gathers on an all-gather stream and
  reduce-scatters on a reduce-scatter stream, and synchronises with events. On CPU these are
  ``torch.cpu.Stream``/``torch.cpu.Event``, whose ``wait_stream``/``record_event``/``wait_event``
  are empty (``record_event()`` returns None).
- The pre-forward unshard and every explicit prefetch (``_prefetch_unshard``) call
  ``unshard(async_op=self.unshard_async_op)``, which is False unless the private
  ``_set_unshard_async_op`` is used, so ``foreach_all_gather`` calls
  ``dist.all_gather_single(..., async_op=False)``. With NCCL that only enqueues a kernel; with
  gloo it blocks the calling thread until the collective has finished.
- ``foreach_reduce`` calls the reduce-scatter without ``async_op`` either, and with gloo the
  backward thread waits for it before computing the next block's gradients.

So on gloo, ``set_modules_to_forward_prefetch`` only moves *where* the thread blocks: block
i+1's all-gather completes inside block i's pre-forward, before block i computes.

The fix uses FSDP2's public extension point, ``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter``:

- ``BlockAllGather`` issues the all-gather with ``async_op=True`` on host devices and returns the
  ``Work``. FSDP2 already handles a returned ``Work``: ``foreach_all_gather_copy_out`` calls
  ``work.wait()`` in the target block's pre-forward, so the prefetched all-gather runs in gloo's
  worker thread while the current block computes. On CUDA it passes ``async_op`` through
  unchanged, and FSDP2's streams do the overlapping.
- ``BlockReduceScatter`` (``overlapkit.fsdp.reduce_scatter``) lets the reduce-scatter run while
  backward goes on, as FSDP2's reduce-scatter stream does on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from overlapkit.fsdp.stats import UnshardRecorder
from overlapkit.group.dim_labels import comm_dim
from overlapkit.group.failures import FailureScope
from overlapkit.group.process_group import all_gather_single


class Alloc:
    """``Comm.allocate``: a plain ``torch.empty``, as FSDP2's default comms do."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class BlockAllGather(Alloc, AllGather):
    """All-gather of one block's parameters that reports its issue and, on host, does not wait.

    Args:
        block (int): the block's index in forward order (``stats.ROOT`` for the root).
        recorder (UnshardRecorder): receives the issue event and the pending ``Work``.
        force_async (bool): issue with ``async_op=True`` whatever FSDP2 asks (host devices);
            False passes FSDP2's ``async_op`` through (CUDA, or ``prefetch=0``).
        failures (FailureScope): explains a failed all-gather (dead or stuck rank).
        where (str): the block as the error names it, e.g. ``"block 0 ('layers.0')"``.
    """

    def __init__(
        self,
        block: int,
        recorder: UnshardRecorder,
        *,
        force_async: bool,
        failures: FailureScope,
        where: str,
    ):
        self.block = block
        self.recorder = recorder
        self.force_async = force_async
        self.failures = failures
        self.where = where

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        site = self.failures.site(group, "all_gather", self.where)
        try:
            with comm_dim("dp"):  # the report's dims (gloo traces carry no group)
                work = all_gather_single(
                    output_tensor, input_tensor, group=group, async_op=async_op or self.force_async
                )
        except RuntimeError as error:  # a blocking all-gather fails here
            raise site.explain(error) from error
        if work is not None:
            work = site.wrap(work)  # FSDP2 waits on it in the block's pre-forward
        self.recorder.all_gather_issued(self.block, work)
        return work
