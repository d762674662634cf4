"""A pipeline stage whose deferred weight-gradient step fires every gradient hook.

torch's zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``) split a stage's backward into an input-gradient step (I: what the previous
stage waits for) and a deferred weight-gradient step (W) that fills the bubble. torch's W
(``torch.distributed.pipelining._backward.stage_backward_weight``) takes each parameter group's
gradients with ``torch.autograd.grad`` at the parameters' accumulator edges and adds them to
``.grad`` by hand, so no accumulator runs and no gradient hook fires: DDP's reducer never averages
the stage's gradients over dp (pytorch/pytorch#144530), ``ok.GradBucketer``'s post-accumulate
hooks never see them, and FSDP2's post-accumulate hooks neither.

``accumulate_weight_grads`` computes the same gradients with ``torch.autograd.backward(...,
inputs=weights)``: the engine runs each weight's ``AccumulateGrad`` node, with every hook on it.
The parameter groups run last layer first, as a full backward completes them, so the buckets of
DDP (filled in reverse registration order) and of ``ok.GradBucketer`` complete one after another
and their all-reduces launch during the stage's last weight step, hidden under the weight
gradients still to compute. The first stage never splits its backward (torch runs it whole in W,
through the accumulators already).

``SplitBackwardStage`` runs that W under the wrapper's switch between accumulating and reducing,
as torch's ``backward_maybe_with_nosync`` does for the other steps (``ok.ddp``: DDP's reducer
armed on the stage's last backward, ``no_sync`` before; ``ok.GradBucketer``: its ``no_sync``
before the last; ``ok.fsdp``: FSDP2's post-backward stays the schedule's ``REDUCE_GRAD``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel

from overlapkit.ddp import GradBucketer


def accumulate_weight_grads(param_groups: list[dict[str, Any]]) -> None:
    """Add one micro-batch's weight gradients to ``.grad`` through the accumulators.

    The same sums as ``stage_backward_weight`` (each group's saved output gradients, clamped so
    that an intermediate reached through another is not counted twice, as torch 2.13 does), but
    every parameter's ``AccumulateGrad`` runs, with its hooks.

    The weights are the accumulators' own (``AccumulateGrad.variable``): the ones the forward
    used, whatever the module holds now (FSDP2 swaps sharded and unsharded parameters).

    Args:
        param_groups: what the input-gradient step saved (``stage_backward_input``): per group
            the parameters' accumulator nodes, the intermediates and their saved gradients;
            consumed (the graph behind them is freed).
    """
    for group in reversed(param_groups):
        edges, grads = [], []
        for saved, intermediate in zip(group["grads"], group["intermediates"], strict=True):
            for i, grad in enumerate(saved):
                if grad is not None:
                    edges.append(GradientEdge(intermediate, i))
                    grads.append(grad)
        handles = []
        if len(group["intermediates"]) > 1:
            handles = [
                node.register_prehook(lambda _, saved=saved: saved)
                for saved, node in zip(group["grads"], group["intermediates"], strict=True)
            ]
        try:
            if edges:
                inputs = [node.variable for node in group["params"]]
                torch.autograd.backward(edges, grad_tensors=grads, inputs=inputs)
        finally:
            for handle in handles:
                handle.remove()
            group.clear()  # the hook -> group -> intermediates cycle, the saved gradients


class SplitBackwardStage(PipelineStage):
    """A ``PipelineStage`` whose weight-gradient steps accumulate through autograd's accumulators.

    Args:
        bucketer (GradBucketer | None): the ``ok.GradBucketer`` over the stage's parameters (its
            ``no_sync`` on every backward but the stage's last); None under ``ok.ddp`` or
            ``ok.fsdp`` (the submodule is then DDP or FSDP2, which torch's stage knows).
        *args, **kwargs: ``PipelineStage``'s.
    """

    def __init__(
        self, *args: object, bucketer: GradBucketer | None = None, **kwargs: object
    ) -> None:
        super().__init__(*args, **kwargs)
        self.bucketer = bucketer

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple:
        # The hook torch's docstring names for adapting data parallelism to the schedules.
        with self._bucketer_sync(last_backward):
            if backward_type == "input":
                self._unshard()
            if backward_type != "weight":
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            with self._wrapper_sync(last_backward):
                accumulate_weight_grads(bwd_kwargs["param_groups"])
            return (), None

    def _unshard(self) -> None:
        """Register FSDP2's unsharded parameters before the input step collects the stage's
        parameters (``stage_backward_input`` reads ``submod.parameters()`` before autograd runs
        FSDP2's pre-backward unshard): a block resharded after its forward would otherwise show
        its sharded parameters, which the graph does not use, and the micro-batch's weight
        gradients would never be computed (measured with torch 2.13: half of them lost)."""
        for module in self.submod.modules():
            if isinstance(module, FSDPModule):
                module.unshard()

    def _bucketer_sync(self, last_backward: bool) -> contextlib.AbstractContextManager:
        if self.bucketer is None or last_backward:
            return contextlib.nullcontext()
        return self.bucketer.no_sync()

    @contextlib.contextmanager
    def _wrapper_sync(self, last_backward: bool) -> Iterator[None]:
        """DDP's and FSDP2's state for a weight step, as torch sets it for the other steps."""
        module = self.submod
        if isinstance(module, DistributedDataParallel):
            if last_backward:
                # Arms DDP's reducer, as torch's stage does before a last full backward; the
                # stage's outputs were detached by the input step, so there are none to pass
                # (find_unused_parameters is refused with these schedules).
                module.reducer.prepare_for_backward([])
                yield
                return
            with module.no_sync():
                yield
            return
        if isinstance(module, FSDPModule):
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)
        yield
