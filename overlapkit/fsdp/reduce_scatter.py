"""Gradient reduce-scatter for host (gloo) devices: overlapped with backward, all-to-all based.

FSDP2 calls its reduce-scatter without ``async_op`` and, on CPU, its reduce-scatter "stream" is a
no-op, so with gloo the backward thread waits for every block's reduce-scatter before computing
the previous block's gradients. ``BlockReduceScatter`` (installed with FSDP2's public
``set_custom_reduce_scatter``) instead:

- issues it asynchronously and keeps at most ``max_in_flight`` (1) pending, waiting for the
  oldest before the next is issued (FSDP2 bounds its reduce-scatter buffers the same way, with
  ``reduce_scatter_max_input_buffers=1``), so a block's reduce-scatter runs during the previous
  block's backward; the rest are finished by an autograd final callback when backward ends;
- on gloo, moves the data with ``all_to_all_single`` and sums the received chunks locally.
  Gloo's ``reduce_scatter_tensor`` runs an all-reduce of the whole input (the profiler shows
  ``gloo:all_reduce``): measured here, a 4 MiB reduce-scatter on 2 ranks took 16-18 ms behind an
  8 Gbit/s link, an all-to-all of the same tensor 6.5 ms.

The asynchronous path is only taken when FSDP2 will not read the output before backward ends
(``async_reduce_scatter_blocker``): then the sharded gradients are views of the output, filled
in when the collective is finished. Otherwise (and on HSDP, where FSDP2 all-reduces the output
at once) the call blocks, as FSDP2's own does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor

from overlapkit.fsdp.comms import Alloc
from overlapkit.group.dim_labels import comm_dim
from overlapkit.group.failures import FailureScope
from overlapkit.group.process_group import reduce_scatter_single as _reduce_scatter

logger = logging.getLogger(__name__)

Finish = Callable[[], None]


class PendingReductions:
    """Reduce-scatters in flight during one backward; all are finished when it ends.

    Each entry keeps its tensors alive until the collective is done: FSDP2 drops its reference
    to the reduce-scatter input when the next block's reduce-scatter starts.

    Args:
        max_in_flight (int): pending reduce-scatters allowed before the oldest is waited for;
            each holds one block's unsharded gradient buffer. Defaults to 1.
    """

    __slots__ = ("_callback_queued", "_items", "issued", "max_in_flight", "peak_in_flight")

    def __init__(self, max_in_flight: int = 1) -> None:
        self.max_in_flight = max_in_flight
        self._items: list[tuple[dist.Work, Finish | None, tuple[torch.Tensor, ...]]] = []
        self._callback_queued = False
        self.issued = 0  # reduce-scatters issued asynchronously so far
        self.peak_in_flight = 0

    def make_room(self) -> None:
        """Finish the oldest pending reduce-scatters until one more fits."""
        while len(self._items) >= self.max_in_flight:
            self._finish_oldest()

    def add(self, work: dist.Work, finish: Finish | None, *tensors: torch.Tensor) -> None:
        self.issued += 1
        self._items.append((work, finish, tensors))
        self.peak_in_flight = max(self.peak_in_flight, len(self._items))
        if not self._callback_queued:
            # Queued from inside backward (FSDP2's post-backward), so it runs after FSDP2's own
            # final callback, which may still issue the root's reduce-scatter.
            Variable._execution_engine.queue_callback(self.wait_all)
            self._callback_queued = True

    def _finish_oldest(self) -> None:
        work, finish, _ = self._items.pop(0)
        work.wait()
        if finish is not None:
            finish()

    def wait_all(self) -> None:
        """Finish every pending reduce-scatter (end of backward, or after one that raised)."""
        self._callback_queued = False
        while self._items:
            self._finish_oldest()

    def __len__(self) -> int:
        return len(self._items)


def async_reduce_scatter_blocker(
    params: Sequence[torch.Tensor], op: object, output_dtype: torch.dtype, group_size: int
) -> str | None:
    """Why FSDP2 would read this reduce-scatter's output before backward ends, or None.

    After the call, ``foreach_reduce`` divides the output when the op is a plain SUM, casts it
    when the reduce dtype differs from the parameters', adds it into an existing sharded
    gradient (accumulation), and runs post-accumulate-grad hooks. Otherwise the sharded
    gradients are views of the output, which can be filled in later.

    Args:
        params: the block's registered parameters at reduce-scatter time.
        op: the reduce op FSDP2 passes (AVG unless it divides separately).
        output_dtype (torch.dtype): the reduce dtype.
        group_size (int): ranks in the reduce-scatter group.
    """
    if op == dist.ReduceOp.SUM and group_size > 1:
        return "FSDP2 divides the summed gradients after the reduce-scatter"
    for p in params:
        if not isinstance(p, DTensor):
            return "parameters are still unsharded (reshard_after_backward=False)"
        if p.grad is not None:
            return "gradients accumulate into an existing .grad"
        if getattr(p, "_post_accumulate_grad_hooks", None):
            return "a post-accumulate-grad hook reads the gradient"
        if p.dtype != output_dtype:
            return f"gradients are cast from {output_dtype} to {p.dtype} after the reduce-scatter"
    return None


def issue_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op: object
) -> tuple[dist.Work, Finish | None]:
    """Start a reduce-scatter of ``input`` (rank-major chunks) into ``output``.

    Returns:
        tuple: the ``Work``, and a function to call once it is done (None when the collective
        writes ``output`` itself).
    """
    n = group.size()
    is_avg = op == dist.ReduceOp.AVG
    if dist.get_backend(group) != "gloo" or not (is_avg or op == dist.ReduceOp.SUM):
        return _reduce_scatter(output, input, group=group, op=op, async_op=True), None
    received = torch.empty_like(input)  # chunk j: rank j's contribution to this rank's shard
    work = dist.all_to_all_single(received, input, group=group, async_op=True)

    def finish() -> None:
        torch.sum(received.view(n, -1), dim=0, out=output)
        if is_avg:
            output.div_(n)

    return work, finish


class BlockReduceScatter(Alloc, ReduceScatter):
    """Reduce-scatter of one block's gradients, asynchronous when nothing reads it early.

    Args:
        params (Callable): returns the block's own parameters as registered right now.
        pending (PendingReductions): the model's in-flight reduce-scatters.
        name (str): the block's name, for the fallback log message.
        allow_async (bool): False always blocks (HSDP all-reduces the output at once).
        failures (FailureScope): explains a failed reduce-scatter (dead or stuck rank).
        where (str): the block as the error names it, e.g. ``"block 0 ('layers.0')"``.
    """

    def __init__(
        self,
        params: Callable[[], list[nn.Parameter]],
        pending: PendingReductions,
        name: str,
        *,
        allow_async: bool,
        failures: FailureScope,
        where: str,
    ):
        self.params = params
        self.pending = pending
        self.name = name
        self.allow_async = allow_async
        self.failures = failures
        self.where = where
        self.calls = 0  # read by ``replica_all_reduce``: did this post-backward reduce-scatter?
        self._logged: set[str] = set()

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.calls += 1
        reason = (
            async_reduce_scatter_blocker(self.params(), op, output_tensor.dtype, group.size())
            if self.allow_async
            else "HSDP all-reduces the output right after the reduce-scatter"
        )
        if reason is None:
            self.pending.make_room()
        site = self.failures.site(group, "reduce_scatter", self.where)
        with comm_dim("dp"):  # the report's dims (gloo traces carry no group)
            work, finish = issue_reduce_scatter(output_tensor, input_tensor, group, op)
        work = site.wrap(work)
        if reason is None:
            self.pending.add(work, finish, input_tensor, output_tensor)
            return work
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("ok.fsdp: blocking reduce-scatter for %s: %s", self.name, reason)
        work.wait()
        if finish is not None:
            finish()
        return None


class ExplainedReduceScatter(Alloc, ReduceScatter):
    """FSDP2's own reduce-scatter (``DefaultReduceScatter``), with a failure explained.

    Installed where overlapkit's reduce-scatter is not (``prefetch=0``,
    ``overlap_reduce_scatter=False``, CUDA): the same collective, blocking or not as FSDP2
    asks, but a dead or stuck rank raises ``CollectiveFailure`` naming the block and the step.

    Args:
        failures (FailureScope): explains a failed reduce-scatter.
        where (str): the block as the error names it, e.g. ``"block 0 ('layers.0')"``.
    """

    def __init__(self, *, failures: FailureScope, where: str):
        self.failures = failures
        self.where = where
        self.calls = 0  # read by ``replica_all_reduce``: did this post-backward reduce-scatter?

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.calls += 1
        site = self.failures.site(group, "reduce_scatter", self.where)
        try:
            work = _reduce_scatter(
                output_tensor, input_tensor, group=group, op=op, async_op=async_op
            )
        except RuntimeError as error:  # a blocking reduce-scatter fails here
            raise site.explain(error) from error
        return None if work is None else site.wrap(work)
