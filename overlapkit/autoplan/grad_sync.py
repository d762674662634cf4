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
from collections.abc import Callable
from dataclasses import dataclass

from overlapkit.autoplan.framework import Framework
from overlapkit.autoplan.memory import Precision, StageParams
from overlapkit.layout import TrainingLayout

BUCKET_PARAMS = 40_000_000
BUCKET_PARAMS_PER_RANK = 1_000_000
"""Gradients are reduced in buckets of ``max(40M, 1M x data-parallel ranks)`` parameters,
Megatron-LM's rule (``DistributedDataParallelConfig.bucket_size``); each bucket is one
collective, with its latency."""

Cost = Callable[..., float]
"""``cost(collective, nbytes, *axes)``: seconds of one collective call over those axes."""


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
    """One micro-batch's backward (recomputation included)."""
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
    cost: Cost,
) -> GradSync:
    """The data-parallel traffic of ``layout`` (see module doc): ``stage`` the first stage's
    parameters (its layers), ``dense_params`` / ``expert_params`` the heaviest stage's on one
    GPU, ``forward_s`` a micro-batch's forward, ``cost`` the cost model's collectives on the
    layout's groups."""
    lay, p, fw = layout, precision, framework
    m, cp, act = lay.num_micro_batches, lay.cp, p.activation_bytes
    hsdp = lay.sharding == "hsdp"
    eff = windows.overlap_efficiency
    last_bwd, first_fwd = eff * windows.backward_s, eff * forward_s
    dense_axes, expert_axes = ("dp", "ep", "cp"), ("dp", "cp")
    every_micro_batch = fw.grad_sync_every_micro_batch and lay.pp == 1
    after_pipeline = fw.fsdp_reduce_after_pipeline and lay.pp > 1

    def in_chunks(collective: str, nbytes: float, chunks: int, *axes: str) -> float:
        return chunks * cost(collective, nbytes / chunks, *axes)

    def pieces(chunks: int) -> int:
        """The expert parameters' collectives: none in a dense model."""
        return chunks if expert_params else 0

    per_mb = total = exposed_s = 0.0
    blocks = stage.layers + 1  # the stage's layers and the root (embedding, head)
    expert_blocks = max(1, stage.layers)
    if lay.sharding in ("fsdp", "hsdp"):
        shard_axes = ("dp_shard",) if hsdp else dense_axes
        expert_shard = ("dp_shard",) if hsdp else expert_axes
        gather = in_chunks("all_gather", dense_params * act, blocks, *shard_axes) + in_chunks(
            "all_gather", expert_params * act, expert_blocks, *expert_shard
        )
        scatter = in_chunks(
            "reduce_scatter", dense_params * p.fsdp_reduce_bytes, blocks, *shard_axes
        ) + in_chunks(
            "reduce_scatter", expert_params * p.fsdp_reduce_bytes, expert_blocks, *expert_shard
        )
        collectives = blocks + pieces(stage.layers)
        if fw.fsdp_gathered_across_micro_batches and lay.pp > 1:
            total += gather + scatter
            exposed_s += exposed(gather, collectives, first_fwd)
            exposed_s += exposed(scatter, collectives, last_bwd)
        elif fw.fsdp_reduces_once_per_step or after_pipeline:
            # Gathered for forward and again for backward every micro-batch; the gradients
            # reduced once per step, after the last backward or after the whole schedule.
            per_mb = max(0.0, 2 * gather - eff * windows.compute_s) + gather / blocks
            exposed_s += scatter if after_pipeline else exposed(scatter, collectives, last_bwd)
            total += m * 2 * gather + scatter
        else:
            # Gathered for forward and again for backward, reduced, every micro-batch.
            traffic = 2 * gather + scatter
            first_block, last_block = gather / blocks, scatter / blocks
            per_mb = max(last_block, traffic - eff * windows.compute_s) + first_block
            total += m * traffic
        if hsdp:
            z = lay.dp_shard
            replica = in_chunks(
                "all_reduce",
                dense_params * p.fsdp_reduce_bytes / z,
                blocks,
                "dp_replicate",
                "ep",
                "cp",
            ) + in_chunks(
                "all_reduce",
                expert_params * p.fsdp_reduce_bytes / z,
                expert_blocks,
                "dp_replicate",
                "cp",
            )
            if every_micro_batch:
                total += m * replica
                per_mb += exposed(replica, collectives, last_bwd)
            else:
                total += replica
                exposed_s += exposed(replica, collectives, 0.0 if after_pipeline else last_bwd)
        return GradSync(per_mb, total, exposed_s)
    if lay.sharding in ("zero1", "zero2") and fw.zero_on_fsdp:
        # FSDP2 with the parameters kept gathered: per block one all-gather before the step's
        # first forward, one reduce-scatter in the last backward (zero1) or in every one (zero2).
        gather = in_chunks("all_gather", dense_params * act, blocks, *dense_axes) + in_chunks(
            "all_gather", expert_params * act, expert_blocks, *expert_axes
        )
        scatter = in_chunks(
            "reduce_scatter", dense_params * p.fsdp_reduce_bytes, blocks, *dense_axes
        ) + in_chunks(
            "reduce_scatter", expert_params * p.fsdp_reduce_bytes, expert_blocks, *expert_axes
        )
        collectives = blocks + pieces(stage.layers)
        gather_exposed = exposed(gather, collectives, first_fwd)
        scatter_exposed = scatter if after_pipeline else exposed(scatter, collectives, last_bwd)
        if lay.sharding == "zero1":
            return GradSync(0.0, gather + scatter, gather_exposed + scatter_exposed)
        return GradSync(scatter_exposed, gather + m * scatter, gather_exposed)
    if lay.sharding == "ddp" and every_micro_batch:
        # FSDP2 over a shard group of one: each block's gradients all-reduced in the reduce
        # dtype as its backward ends, every micro-batch.
        reduce = in_chunks(
            "all_reduce", dense_params * p.fsdp_reduce_bytes, blocks, *dense_axes
        ) + in_chunks(
            "all_reduce", expert_params * p.fsdp_reduce_bytes, expert_blocks, *expert_axes
        )
        per_mb = exposed(reduce, blocks + pieces(stage.layers), last_bwd)
        return GradSync(per_mb, m * reduce, 0.0)
    g = p.grad_reduce_bytes
    grads = (dense_params * g, expert_params * g)
    chunks = (buckets(dense_params, lay.dp * lay.ep * cp), buckets(expert_params, lay.dp * cp))
    collectives = chunks[0] + pieces(chunks[1])
    if lay.sharding == "ddp":
        reduce = in_chunks("all_reduce", grads[0], chunks[0], *dense_axes) + in_chunks(
            "all_reduce", grads[1], chunks[1], *expert_axes
        )
        return GradSync(0.0, reduce, exposed(reduce, collectives, last_bwd))
    scatter = in_chunks("reduce_scatter", grads[0], chunks[0], *dense_axes) + in_chunks(
        "reduce_scatter", grads[1], chunks[1], *expert_axes
    )
    weights = (dense_params * p.weight_bytes, expert_params * p.weight_bytes)
    gather = in_chunks("all_gather", weights[0], chunks[0], *dense_axes) + in_chunks(
        "all_gather", weights[1], chunks[1], *expert_axes
    )
    gather_exposed = exposed(gather, collectives, first_fwd)
    if lay.sharding == "zero1":
        scatter_exposed = exposed(scatter, collectives, last_bwd)
        return GradSync(0.0, scatter + gather, scatter_exposed + gather_exposed)
    # zero2: gradients reduce-scattered every micro-batch, behind its backward
    per_mb = exposed(scatter, collectives, eff * windows.backward_s)
    return GradSync(per_mb, m * scatter + gather, gather_exposed)


def buckets(count: float, replicas: int) -> int:
    """Megatron-LM's gradient buckets for ``count`` parameters over ``replicas`` ranks."""
    return max(1, math.ceil(count / max(BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK * replicas)))
