"""The data-parallel traffic of one step: parameter gathers and gradient reductions, and what
of them the compute does not hide (``autoplan.step_time`` adds it to the step).

Per sharding, of the heaviest pipeline stage's parameters (module doc of ``step_time``):
ddp's gradient all-reduce after the last backward, in Megatron-LM's buckets; zero1's
reduce-scatter, then the parameter all-gather behind the next forward; zero2's reduce-scatter
per micro-batch; FSDP's all-gather per block for forward and again for backward and its
reduce-scatter, per micro-batch, hidden behind the compute (the first block's gather and the
last reduce-scatter are not); hsdp's replica all-reduce per block after the last backward.

The framework changes some of them (``autoplan.framework``): where FSDP keeps a stage gathered
across micro-batches under pp (torchtitan), its parameters are gathered once, behind the first
forward, and its gradients reduced once, after the last backward; where gradients are reduced
after every micro-batch (torchtitan with pp = 1), hsdp's replica all-reduce runs per
micro-batch, and so does ddp's, per block in the reduce dtype (FSDP2 over a shard group of 1).
Where FSDP accumulates unsharded gradients over a step (overlapkit-train's ``no_sync``), they
are reduce-scattered once, after the last backward; where a pipeline reduces them after its
whole schedule (overlapkit-train: torch's ``PipelineStage`` runs FSDP2's post-backward), the
reduction is exposed whole. Where ZeRO-1/2 are FSDP2 with the parameters kept gathered
(overlapkit-train's ``ok.fsdp(zero=)``), each block is all-gathered once per step, ahead of the
first forward, and reduce-scattered in the last backward (zero1) or in every one (zero2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from overlapkit.autoplan.framework import Framework
from overlapkit.autoplan.group_costs import LayoutCollectives
from overlapkit.autoplan.memory import Precision, StageParams
from overlapkit.layout import TrainingLayout

BUCKET_PARAMS = 40_000_000
BUCKET_PARAMS_PER_RANK = 1_000_000
"""Gradients are reduced in buckets of ``max(40M, 1M x data-parallel ranks)`` parameters,
Megatron-LM's rule (``DistributedDataParallelConfig.bucket_size``); each bucket is one
collective, with its latency."""


@dataclass(frozen=True, slots=True)
class GradSync:
    """One step's data-parallel traffic, seconds."""

    per_micro_batch_s: float
    """Exposed in every micro-batch (FSDP, zero2, per-micro-batch reductions)."""
    total_s: float
    """Every collective's time, hidden or not."""
    exposed_s: float
    """Exposed once per step (after the last backward, before the first forward)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepWindows:
    """The compute the traffic hides behind, seconds (already times the overlap efficiency
    where named a window)."""

    compute_s: float
    """One micro-batch's compute."""
    backward_s: float
    """The last micro-batch's backward the step's gradient reduction starts in (recomputation
    included): its whole backward, or under a split backward its weight steps
    (``pipeline_schedule.gradient_window_s``)."""
    overlap_efficiency: float


def exposed(total: float, pieces: int, window: float) -> float:
    """Seconds of ``total`` traffic, sent as ``pieces`` equal collectives, that a compute
    ``window`` (already times the overlap efficiency) leaves exposed.

    The pieces leave as their data becomes ready, ``window / pieces`` apart (gradient buckets
    in backward), or must arrive before their part of the window starts (parameters ahead of a
    forward); either way one piece has no compute left to hide behind: a single bucket, as a
    small model's, is exposed whole.
    """
    if total <= 0:
        return 0.0
    return max(total / pieces, total - window * (pieces - 1) / pieces)


def grad_sync(
    layout: TrainingLayout,
    *,
    stage: StageParams,
    dense_params: float,
    expert_params: float,
    precision: Precision,
    framework: Framework,
    windows: StepWindows,
    forward_s: float,
    collectives: LayoutCollectives,
) -> GradSync:
    """The data-parallel traffic of one step of ``layout``, seconds: the heaviest stage's
    parameter gathers and gradient reductions as its sharding and framework run them (module
    doc), and what of them the compute leaves exposed.

    Args:
        layout (TrainingLayout): its sharding, sizes and micro-batches.
        stage (StageParams): the first stage's parameters (its layers: FSDP's blocks).
        dense_params (float): the heaviest stage's dense parameters on one GPU.
        expert_params (float): the heaviest stage's expert parameters on one GPU (0: dense).
        precision (Precision): element sizes of weights and gradients on the wire.
        framework (Framework): what changes where the traffic runs (module doc).
        windows (StepWindows): the compute it hides behind.
        forward_s (float): one micro-batch's forward, which the first gathers precede.
        collectives (LayoutCollectives): the cost model's collectives on the layout's groups.

    Returns:
        GradSync: seconds exposed per micro-batch and per step, and every call's total.
    """
    traffic = _Traffic(
        layout=layout,
        precision=precision,
        framework=framework,
        windows=windows,
        collectives=collectives,
        first_forward_s=windows.overlap_efficiency * forward_s,
        per_block=_Split(
            dense_params, expert_params, stage.layers + 1, max(1, stage.layers), *_REPLICAS
        ),
    )
    if layout.sharding in ("fsdp", "hsdp"):
        return traffic.fully_sharded()
    if layout.sharding in ("zero1", "zero2") and framework.zero_on_fsdp:
        return traffic.zero_on_fsdp()
    if layout.sharding == "ddp" and traffic.every_micro_batch:
        return traffic.ddp_per_block()
    dense_buckets = buckets(dense_params, layout.dp * layout.ep * layout.cp)
    expert_buckets = buckets(expert_params, layout.dp * layout.cp)
    in_buckets = _Split(dense_params, expert_params, dense_buckets, expert_buckets, *_REPLICAS)
    return traffic.bucketed(in_buckets)


_REPLICAS = (("dp", "ep", "cp"), ("dp", "cp"))
"""The axes a dense and an expert parameter are replicated over (``overlapkit.layout``)."""
_SHARD_GROUP = (("dp_shard",), ("dp_shard",))
"""hsdp: the axis both are sharded over."""
_HSDP_REPLICAS = (("dp_replicate", "ep", "cp"), ("dp_replicate", "cp"))
"""hsdp: the axes both are replicated over, across shard groups."""


@dataclass(frozen=True, slots=True)
class _Split:
    """What one kind of data-parallel collective moves: the dense parameters in ``dense_calls``
    equal calls over ``dense_axes``, the expert parameters in ``expert_calls`` over
    ``expert_axes``."""

    dense_params: float
    expert_params: float
    dense_calls: int
    expert_calls: int
    dense_axes: tuple[str, ...]
    expert_axes: tuple[str, ...]

    @property
    def calls(self) -> int:
        """Calls in all (none for the expert parameters of a dense model)."""
        return self.dense_calls + (self.expert_calls if self.expert_params else 0)

    def over(self, axes: tuple[tuple[str, ...], tuple[str, ...]]) -> _Split:
        """The same calls over other (dense, expert) axes."""
        return _Split(
            self.dense_params, self.expert_params, self.dense_calls, self.expert_calls, *axes
        )

    def seconds(
        self,
        collectives: LayoutCollectives,
        collective: str,
        element_bytes: int,
        *,
        divide_by: int = 1,
    ) -> float:
        """Seconds of ``collective`` on every parameter of ``element_bytes`` bytes (divided by
        ``divide_by``: the shard of an hsdp replica)."""
        dense = self.dense_params * element_bytes / divide_by
        expert = self.expert_params * element_bytes / divide_by
        return collectives.in_chunks(
            collective, dense, self.dense_calls, *self.dense_axes
        ) + collectives.in_chunks(collective, expert, self.expert_calls, *self.expert_axes)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Traffic:
    """One step's data-parallel traffic, per sharding."""

    layout: TrainingLayout
    precision: Precision
    framework: Framework
    windows: StepWindows
    collectives: LayoutCollectives
    first_forward_s: float
    """The first micro-batch's forward, times the overlap efficiency."""
    per_block: _Split
    """One call per block of the first stage (its layers and the root: embedding, head)."""

    @property
    def last_backward_s(self) -> float:
        """The last micro-batch's backward, times the overlap efficiency."""
        return self.windows.overlap_efficiency * self.windows.backward_s

    @property
    def every_micro_batch(self) -> bool:
        """Gradients reduced after every micro-batch (torchtitan without pp)."""
        return self.framework.grad_sync_every_micro_batch and self.layout.pp == 1

    @property
    def after_pipeline(self) -> bool:
        """Gradients reduced after the whole pipeline schedule (overlapkit-train under pp)."""
        return self.framework.fsdp_reduce_after_pipeline and self.layout.pp > 1

    def _gather_and_scatter(self, split: _Split) -> tuple[float, float]:
        """Seconds of the parameters' all-gather and of their gradients' reduce-scatter."""
        act, reduce_bytes = self.precision.activation_bytes, self.precision.fsdp_reduce_bytes
        gather = split.seconds(self.collectives, "all_gather", act)
        return gather, split.seconds(self.collectives, "reduce_scatter", reduce_bytes)

    def _scatter_exposed(self, scatter: float, calls: int) -> float:
        if self.after_pipeline:
            return scatter
        return exposed(scatter, calls, self.last_backward_s)

    def fully_sharded(self) -> GradSync:
        """fsdp / hsdp: each block gathered for forward and backward, its gradients
        reduce-scattered; hsdp's replica all-reduce on top."""
        layout, framework, micro_batches = (
            self.layout,
            self.framework,
            self.layout.num_micro_batches,
        )
        hsdp = layout.sharding == "hsdp"
        split = self.per_block.over(_SHARD_GROUP if hsdp else _REPLICAS)
        gather, scatter = self._gather_and_scatter(split)
        calls, blocks = split.calls, split.dense_calls
        compute = self.windows.overlap_efficiency * self.windows.compute_s
        per_mb = 0.0
        if framework.fsdp_gathered_across_micro_batches and layout.pp > 1:
            total = gather + scatter
            step_exposed = exposed(gather, calls, self.first_forward_s)
            step_exposed += exposed(scatter, calls, self.last_backward_s)
        elif framework.fsdp_reduces_once_per_step or self.after_pipeline:
            # Gathered for forward and again for backward every micro-batch; the gradients
            # reduced once per step, after the last backward or after the whole schedule.
            per_mb = max(0.0, 2 * gather - compute) + gather / blocks
            step_exposed = self._scatter_exposed(scatter, calls)
            total = micro_batches * 2 * gather + scatter
        else:
            # Gathered for forward and again for backward, reduced, every micro-batch.
            traffic = 2 * gather + scatter
            per_mb = max(scatter / blocks, traffic - compute) + gather / blocks
            total, step_exposed = micro_batches * traffic, 0.0
        if not hsdp:
            return GradSync(per_mb, total, step_exposed)
        replica = split.over(_HSDP_REPLICAS).seconds(
            self.collectives,
            "all_reduce",
            self.precision.fsdp_reduce_bytes,
            divide_by=layout.dp_shard,
        )
        if self.every_micro_batch:
            per_mb += exposed(replica, calls, self.last_backward_s)
            return GradSync(per_mb, total + micro_batches * replica, step_exposed)
        window = 0.0 if self.after_pipeline else self.last_backward_s
        return GradSync(per_mb, total + replica, step_exposed + exposed(replica, calls, window))

    def zero_on_fsdp(self) -> GradSync:
        """zero1 / zero2 on FSDP2 with the parameters kept gathered: per block one all-gather
        before the step's first forward, one reduce-scatter in the last backward (zero1) or in
        every one (zero2)."""
        gather, scatter = self._gather_and_scatter(self.per_block)
        calls = self.per_block.calls
        gather_exposed = exposed(gather, calls, self.first_forward_s)
        scatter_exposed = self._scatter_exposed(scatter, calls)
        if self.layout.sharding == "zero1":
            return GradSync(0.0, gather + scatter, gather_exposed + scatter_exposed)
        micro_batches = self.layout.num_micro_batches
        return GradSync(scatter_exposed, gather + micro_batches * scatter, gather_exposed)

    def ddp_per_block(self) -> GradSync:
        """ddp as FSDP2 over a shard group of one: each block's gradients all-reduced in the
        reduce dtype as its backward ends, every micro-batch."""
        split = self.per_block
        reduce = split.seconds(self.collectives, "all_reduce", self.precision.fsdp_reduce_bytes)
        per_mb = exposed(reduce, split.calls, self.last_backward_s)
        return GradSync(per_mb, self.layout.num_micro_batches * reduce, 0.0)

    def bucketed(self, split: _Split) -> GradSync:
        """ddp, zero1, zero2 in Megatron-LM's buckets (``split``): ddp's all-reduce after the
        last backward; zero's reduce-scatter (zero2: every micro-batch) and parameter
        all-gather behind the next forward."""
        collectives, precision = self.collectives, self.precision
        if self.layout.sharding == "ddp":
            reduce = split.seconds(collectives, "all_reduce", precision.grad_reduce_bytes)
            return GradSync(0.0, reduce, exposed(reduce, split.calls, self.last_backward_s))
        scatter = split.seconds(collectives, "reduce_scatter", precision.grad_reduce_bytes)
        gather = split.seconds(collectives, "all_gather", precision.weight_bytes)
        gather_exposed = exposed(gather, split.calls, self.first_forward_s)
        if self.layout.sharding == "zero1":
            scatter_exposed = exposed(scatter, split.calls, self.last_backward_s)
            return GradSync(0.0, scatter + gather, scatter_exposed + gather_exposed)
        # zero2: gradients reduce-scattered every micro-batch, behind its backward
        per_mb = exposed(scatter, split.calls, self.last_backward_s)
        micro_batches = self.layout.num_micro_batches
        return GradSync(per_mb, micro_batches * scatter + gather, gather_exposed)


def buckets(count: float, replicas: int) -> int:
    """Megatron-LM's gradient buckets for ``count`` parameters over ``replicas`` ranks."""
    return max(1, math.ceil(count / max(BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK * replicas)))
