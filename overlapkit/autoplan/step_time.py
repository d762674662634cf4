"""Predicted time of one training step of a layout: compute, exposed communication, bubble.

``predict_step`` composes the terms: one micro-batch's compute on the slowest pipeline stage
(``micro_batch_compute``), its tp / cp / ep / pp collectives (``autoplan.micro_batch``), the
pipeline's bubble, the data-parallel traffic (``autoplan.grad_sync``) and the optimizer step
(``optimizer_s``). What each term counts, and the sources: docs/auto-planner.md, "The model of a
step".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from overlapkit.autoplan.compute import gemm_rates
from overlapkit.autoplan.framework import MEGATRON, Framework
from overlapkit.autoplan.gemm import (
    GemmRates,
    gemm_seconds,
    layer_matmul_seconds,
    unfused_attention_seconds,
)
from overlapkit.autoplan.grad_sync import StepWindows, grad_sync
from overlapkit.autoplan.group_costs import AxisCosts, LayoutCollectives
from overlapkit.autoplan.memory import BF16, Precision, StageParams, sharding_groups, stage_params
from overlapkit.autoplan.memory_traffic import layer_memory_seconds, loss_bytes
from overlapkit.autoplan.micro_batch import (
    BACKWARD_OVER_FORWARD,
    CommSeconds,
    StageMicroBatch,
    context_parallel,
    expert_parallel,
    pipeline_parallel,
    tensor_parallel,
)
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.pipeline_schedule import PassTimes, bubble_s, gradient_window_s
from overlapkit.layout import TrainingLayout
from overlapkit.topology.accelerator import Accelerator

OPTIMIZER_BYTES_PER_PARAM = 30
"""Adam step per local parameter: read grad, master, m, v (16), write master, m, v (12) and
the bf16 weight (2)."""
RING_WINDOW_FORWARDS = 1 + BACKWARD_OVER_FORWARD
"""cp's ring passes K and V around while each layer's attention computes, forward and
backward: a window of three attention forwards (backward at ``BACKWARD_OVER_FORWARD``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOptions:
    """What the step-time model needs besides the model and the layout."""

    seq_len: int
    accelerator: Accelerator
    achievable: float
    """Fraction of the BF16 dense peak the layers' FLOPs run at (``autoplan.compute``)."""
    matmul_achievable: float | None = None
    """Fraction of the matmul precision's peak (FP8 runs); None: ``achievable``."""
    overlap_efficiency: float
    precision: Precision = BF16
    flash_attention: bool = True
    tp_overlap: float = 0.0
    """Share of tp communication hidden (async TP); 0: all on the critical path."""
    ep_overlap: float = 0.0
    """Share of ep all-to-all hidden behind compute (DualPipe-style schedules)."""
    ep_chunks: int = 1
    """Token chunks each MoE layer's all-to-alls are pipelined in with its experts
    (overlapkit-train's ``parallel.plan.ep_chunks``; ``micro_batch.expert_parallel``)."""
    tp_comm: str = "sync"
    """How tp's collectives meet their matmuls (overlapkit-train's ``parallel.plan.tp_comm``:
    ``sync``, ``split``, ``ring``; ``micro_batch.tensor_parallel``)."""
    tp_chunks: int = 2
    """With ``tp_comm="split"``: the micro-batch's chunks (``parallel.plan.tp_chunks``)."""
    collective_overhead_s: float = 0.0
    """Seconds every collective call costs beyond what the cost model prices: its launch and
    the wait for the last rank to arrive. 0 by default (NCCL's launch is microseconds); where
    ranks share CPU cores it is milliseconds (bench/planner_ranking measures it)."""
    tp_layer_dispatch_s: float = 0.0
    """Host seconds each pass (forward or backward) through a tensor-parallel layer costs
    beyond its FLOPs and collectives: the sharded tensors' per-operation dispatch (DTensor's
    sharding propagation and redistribution). 0 by default: on GPUs the host runs ahead of the
    kernels; where the host does the compute it adds to it, milliseconds per layer on this
    project's CPU ranks (bench/planner_ranking measures it: the tensor-parallel model on a
    one-rank mesh against the plain one, same FLOPs, no communication)."""
    framework: Framework = MEGATRON
    """What runs the layout (``autoplan.framework``): how tp splits the model, its collectives,
    which parameters are DTensors. Megatron-LM's by default; ``OVERLAPKIT_TRAIN`` prices what
    overlapkit-train runs."""
    optimizer_tensor_s: float = 0.0
    """Host seconds the optimizer step costs per plain parameter tensor, whatever its size
    (torch's AdamW steps CPU tensors one by one, about ten operations each). 0 by default: on
    GPUs the host launches the step's kernels ahead of them (bench/planner_ranking measures
    it: AdamW over as many one-element tensors as the model has parameters)."""
    optimizer_dtensor_s: float = 0.0
    """The same per DTensor parameter (FSDP2's, and the tp / ep shards where
    ``framework.dtensor_parameters``): every operation goes through DTensor's dispatch."""
    optimizer_param_s: float | None = None
    """Seconds the step's arithmetic costs per local parameter; None: memory-bound, 30 bytes
    per parameter at the accelerator's memory bandwidth (0 without one)."""


@dataclass(frozen=True, slots=True)
class StepTime:
    """One step's predicted time and its parts, seconds (per GPU)."""

    step_s: float
    compute_s: float
    """All micro-batches' compute on the slowest stage, recomputation included."""
    tp_s: float
    cp_s: float
    ep_s: float
    pp_s: float
    fsdp_s: float
    """Exposed FSDP / HSDP-shard traffic per step."""
    dp_s: float
    """Exposed data-parallel gradient traffic (after the last backward)."""
    bubble_s: float
    optimizer_s: float
    comm_total_s: float
    """Every collective's time, hidden or not."""
    model_flops: float
    """Per step, all GPUs: 6N + attention per token, no recomputation."""
    hardware_flops: float
    """Per step, all GPUs, recomputation counted."""
    hidden_share: dict[str, float] = field(default_factory=dict)
    """Per dimension whose communication a mode pipelines with compute (``tp`` under ``split``
    or ``ring``, ``ep`` with ``ep_chunks > 1``), the share of it the model hides."""
    modes: dict[str, object] = field(default_factory=dict)
    """The in-layer modes priced, as ``parallel.plan`` keys (``{"tp_comm": "ring"}``,
    ``{"ep_chunks": 4}``); empty: the synchronous ones."""

    def to_dict(self) -> dict:
        return {
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "exposed_s": {
                "tp": self.tp_s,
                "cp": self.cp_s,
                "ep": self.ep_s,
                "pp": self.pp_s,
                "fsdp": self.fsdp_s,
                "dp": self.dp_s,
            },
            "bubble_s": self.bubble_s,
            "optimizer_s": self.optimizer_s,
            "comm_total_s": self.comm_total_s,
            "hidden_share": dict(self.hidden_share),
            "modes": dict(self.modes),
        }


def _attention_flops(model: ModelSpec, tokens: float, seq_len: int) -> float:
    """Forward FLOPs of ``softmax(QK^T)V`` for ``tokens`` tokens of ``seq_len`` sequences."""
    return 2.0 * tokens * seq_len * model.heads * (model.qk_head_dim + model.attention_v_dim)


def _layer_matmul_s(
    model: ModelSpec, layout: TrainingLayout, tokens: float, rates: GemmRates
) -> tuple[float, float]:
    """(forward, backward) GEMM seconds of one layer, averaged over dense and MoE layers."""
    kwargs = dict(tp=layout.tp, ep=layout.ep, cp=layout.cp, rates=rates)
    dense = layer_matmul_seconds(model, tokens, moe_layer=False, **kwargs)
    if not model.is_moe:
        return dense
    moe = layer_matmul_seconds(model, tokens, moe_layer=True, **kwargs)
    share = model.moe_layers / model.layers
    return tuple((1 - share) * d + share * e for d, e in zip(dense, moe, strict=True))


@dataclass(frozen=True, slots=True)
class StepRates:
    """The rates the step's compute runs at: the matmuls at their precision's peak, attention at
    BF16's, each times its achievable fraction (``autoplan.compute``)."""

    matmul: GemmRates
    attention: GemmRates

    @classmethod
    def of(cls, options: StepOptions) -> StepRates:
        act = options.precision.activation_bytes
        fraction = (
            options.achievable if options.matmul_achievable is None else options.matmul_achievable
        )
        return cls(
            matmul=gemm_rates(
                options.accelerator, options.precision.matmul_dtype, fraction, element_bytes=act
            ),
            attention=gemm_rates(
                options.accelerator, "bf16", options.achievable, element_bytes=act
            ),
        )


@dataclass(frozen=True, slots=True)
class MicroBatchCompute:
    """One micro-batch's compute on the slowest pipeline stage, seconds."""

    forward_s: float
    """The stage's layers forward, memory-bound kernels included (no head, no loss)."""
    backward_s: float
    """Backward of the layers, head and loss, with recomputation's extra forward."""
    total_s: float
    """Forward, backward, recomputation, head, loss, and tp's host dispatch."""
    attention_forward_s: float
    """One layer's attention forward (what cp's ring hides behind, with its backward)."""
    weight_s: float
    """The backward's weight gradients: one forward of the layers' and the head's GEMMs (what
    a zero-bubble schedule defers; the rest of the backward is its input-gradient step)."""

    def passes(self) -> PassTimes:
        """Forward (head, loss and tp's dispatch with it), input- and weight-gradient steps."""
        forward = self.total_s - self.backward_s
        return PassTimes(forward, self.backward_s - self.weight_s, self.weight_s)


def _attention_s(stage: StageMicroBatch, flash: bool, rates: GemmRates) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's attention core."""
    layout = stage.layout
    if not flash:
        return unfused_attention_seconds(
            stage.model, layout.micro_batch, stage.seq_len, tp=layout.tp, cp=layout.cp, rates=rates
        )
    flops = _attention_flops(stage.model, stage.tokens, stage.seq_len)
    forward = flops / rates.flops_per_s / (layout.tp * layout.cp)
    return forward, BACKWARD_OVER_FORWARD * forward


def _loss_s(stage: StageMicroBatch, head_rows: int, bytes_per_s: float) -> tuple[float, float]:
    """(forward, backward) seconds of the loss over the vocabulary (cross entropy on the last
    stage's logits), memory-bound."""
    vocab_tp = stage.layout.tp if stage.framework.vocab_parallel else 1
    logits = head_rows * stage.model.vocab_size / vocab_tp
    forward, backward = (logits * n / bytes_per_s for n in loss_bytes(stage.precision))
    return forward, backward


def micro_batch_compute(
    stage: StageMicroBatch, options: StepOptions, rates: StepRates
) -> MicroBatchCompute:
    """One micro-batch's compute on ``stage``: its layers' GEMMs and attention (divided over
    tp x cp), recomputation, the output layer (the last stage's: the slowest), and, where the
    accelerator has a memory bandwidth, the kernels that are not matmuls and the loss."""
    model, layout, framework = stage.model, stage.layout, stage.framework
    layers, recomputed = stage.layers, stage.recomputed
    matmul_fwd, matmul_bwd = _layer_matmul_s(model, layout, stage.tokens, rates.matmul)
    attention_fwd, attention_bwd = _attention_s(stage, options.flash_attention, rates.attention)
    forward = layers * (matmul_fwd + attention_fwd)
    backward = layers * (matmul_bwd + attention_bwd)
    extra = recomputed * forward
    if layout.recompute == "selective":
        extra = layers * framework.selective.extra_forward_s(
            model, matmul_s=matmul_fwd, attention_s=attention_fwd, flash=options.flash_attention
        )
    vocab_tp = layout.tp if framework.vocab_parallel else 1
    head_rows = max(1, round(stage.tokens / layout.cp))
    head_fwd = gemm_seconds(head_rows, model.hidden, model.vocab_size // vocab_tp, rates.matmul)
    loss_fwd = loss_bwd = 0.0
    if bytes_per_s := rates.matmul.bytes_per_s:
        memory_fwd, memory_bwd = layer_memory_seconds(
            model,
            layout,
            stage.precision,
            seq_len=stage.seq_len,
            flash_attention=options.flash_attention,
            recomputed=recomputed,
            selective=framework.selective,
            bytes_per_s=bytes_per_s,
        )
        forward += layers * memory_fwd
        backward += layers * memory_bwd
        loss_fwd, loss_bwd = _loss_s(stage, head_rows, bytes_per_s)
    head = (1 + BACKWARD_OVER_FORWARD) * head_fwd
    total = forward + backward + extra + head + loss_fwd + loss_bwd
    if layout.tp > 1:  # forward, backward and the recomputed forward through each sharded layer
        total += layers * (2 + recomputed) * options.tp_layer_dispatch_s
    backward_total = backward + extra + BACKWARD_OVER_FORWARD * head_fwd + loss_bwd
    weight = layers * matmul_fwd + head_fwd
    return MicroBatchCompute(forward, backward_total, total, attention_fwd, weight)


def predict_step(
    model: ModelSpec, layout: TrainingLayout, options: StepOptions, costs: AxisCosts
) -> StepTime:
    """Predict one training step of ``layout``: per micro-batch on the slowest pipeline stage
    its compute and exposed tp / cp / ep / pp traffic, ``m`` of those plus the schedule's
    bubble (``autoplan.pipeline_schedule``: ``(pp - 1) / v`` of them under 1F1B and interleaved
    1F1B, Narayanan et al., SC'21; less under the zero-bubble schedules), then the exposed
    data-parallel traffic and the optimizer step.

    Args:
        model (ModelSpec): the model.
        layout (TrainingLayout): its sizes, micro-batching, recomputation and sharding.
        options (StepOptions): sequence length, accelerator, precision, overlap and the
            framework that runs the layout.
        costs (AxisCosts): every collective is the cost model's estimate on the group the
            layout's placement gives.

    Returns:
        StepTime: seconds per step (each GPU), the exposed part of each dimension, and the
        step's FLOPs over all GPUs. Every part is >= 0; ``step_s`` is
        ``(m x micro-batch + bubble) + tied all-reduce + dp_s + optimizer_s``.
    """
    framework, micro_batches = options.framework, layout.num_micro_batches
    stage = StageMicroBatch.of(
        model, layout, framework=framework, precision=options.precision, seq_len=options.seq_len
    )
    rates = StepRates.of(options)
    compute = micro_batch_compute(stage, options, rates)
    collectives = LayoutCollectives(costs, layout, call_overhead_s=options.collective_overhead_s)
    tp = tensor_parallel(
        stage,
        collectives,
        overlap=options.tp_overlap,
        mode=options.tp_comm,
        chunks=options.tp_chunks,
        rates=rates.matmul,
    )
    ring_window = options.overlap_efficiency * RING_WINDOW_FORWARDS * compute.attention_forward_s
    cp = context_parallel(stage, collectives, ring_window_s=ring_window)
    ep = expert_parallel(
        stage,
        collectives,
        overlap=options.ep_overlap,
        chunks=options.ep_chunks,
        rates=rates.matmul,
    )
    pp_s, tied_s = pipeline_parallel(stage, collectives)
    first, last = (
        stage_params(model, layout, stage=i, vocab_parallel=framework.vocab_parallel)
        for i in (0, layout.pp - 1)
    )
    dense_params, expert_params = max(first.dense, last.dense), max(first.expert, last.expert)
    sync = grad_sync(
        layout,
        stage=first,
        dense_params=dense_params,
        expert_params=expert_params,
        precision=options.precision,
        framework=framework,
        windows=StepWindows(
            compute_s=compute.total_s,
            backward_s=gradient_window_s(layout, compute.passes()),
            overlap_efficiency=options.overlap_efficiency,
        ),
        forward_s=compute.forward_s,
        collectives=collectives,
    )
    micro_batch_s = (
        compute.total_s + tp.exposed_s + cp.exposed_s + ep.exposed_s + pp_s + sync.per_micro_batch_s
    )
    bubble = bubble_s(layout, compute.passes(), stretch=micro_batch_s / compute.total_s)
    local_params = _local_params(layout, dense_params, expert_params)
    optimizer = optimizer_s(model, layout, options, local_params, (first, last), rates)
    model_flops, hardware_flops = _step_flops(stage)
    return StepTime(
        step_s=micro_batches * micro_batch_s + bubble + tied_s + sync.exposed_s + optimizer,
        compute_s=micro_batches * compute.total_s,
        tp_s=micro_batches * tp.exposed_s,
        cp_s=micro_batches * cp.exposed_s,
        ep_s=micro_batches * ep.exposed_s,
        pp_s=micro_batches * pp_s + tied_s,
        fsdp_s=micro_batches * sync.per_micro_batch_s,
        dp_s=sync.exposed_s,
        bubble_s=bubble,
        optimizer_s=optimizer,
        comm_total_s=micro_batches * (tp.total_s + cp.total_s + ep.total_s + pp_s)
        + tied_s
        + sync.total_s,
        model_flops=model_flops,
        hardware_flops=hardware_flops,
        hidden_share=_hidden_share(
            {"tp": (tp, options.tp_comm != "sync"), "ep": (ep, options.ep_chunks > 1)}
        ),
        modes=_modes(layout, options),
    )


def _hidden_share(parts: dict[str, tuple[CommSeconds, bool]]) -> dict[str, float]:
    """Per dimension a mode overlaps, the share of its communication hidden (what its pieces
    lose in GEMM efficiency counts as exposed, so a mode that loses more than it hides shows
    0)."""
    return {
        dim: max(0.0, 1.0 - comm.exposed_s / comm.total_s)
        for dim, (comm, overlapped) in parts.items()
        if overlapped and comm.total_s > 0
    }


def _modes(layout: TrainingLayout, options: StepOptions) -> dict[str, object]:
    """The in-layer modes priced, as ``parallel.plan`` keys (see ``StepTime.modes``)."""
    modes: dict[str, object] = {}
    if layout.tp > 1 and options.tp_comm != "sync":
        modes["tp_comm"] = options.tp_comm
        if options.tp_comm == "split":
            modes["tp_chunks"] = options.tp_chunks
    if layout.ep > 1:
        modes["ep_chunks"] = options.ep_chunks
    return modes


def _local_params(layout: TrainingLayout, dense_params: float, expert_params: float) -> float:
    """Parameters whose optimizer state one GPU steps: the heaviest stage's, divided by the ranks
    that state is sharded over (``memory.sharding_groups``; none under ddp)."""
    if layout.sharding == "ddp":
        return dense_params + expert_params
    dense_ranks, expert_ranks = sharding_groups(layout)
    return dense_params / dense_ranks + expert_params / expert_ranks


def optimizer_s(
    model: ModelSpec,
    layout: TrainingLayout,
    options: StepOptions,
    local_params: float,
    stages: tuple[StageParams, StageParams],
    rates: StepRates,
) -> float:
    """Seconds of the optimizer step on one GPU of ``local_params`` parameters.

    ``options.optimizer_param_s`` per parameter where given; else memory-bound
    (``OPTIMIZER_BYTES_PER_PARAM`` at the achievable memory bandwidth; 0 without one). Plus,
    where the host steps tensor by tensor, the first or last stage's (``stages``) plain and
    DTensor parameter tensors at ``optimizer_tensor_s`` and ``optimizer_dtensor_s``, the
    slower of the two.
    """
    seconds = 0.0
    if options.optimizer_param_s is not None:
        seconds = local_params * options.optimizer_param_s
    elif rates.matmul.bytes_per_s:
        seconds = local_params * OPTIMIZER_BYTES_PER_PARAM / rates.matmul.bytes_per_s
    if not (options.optimizer_tensor_s or options.optimizer_dtensor_s):
        return seconds
    framework, (first, last) = options.framework, stages
    return seconds + max(
        plain * options.optimizer_tensor_s + dtensors * options.optimizer_dtensor_s
        for plain, dtensors in (
            parameter_tensors(model, layout, framework, layers=first.layers, stage=0),
            parameter_tensors(model, layout, framework, layers=last.layers, stage=layout.pp - 1),
        )
    )


def _step_flops(stage: StageMicroBatch) -> tuple[float, float]:
    """(model, hardware) FLOPs of one step over all GPUs: 6N + attention per token, and that
    plus what recomputation runs again."""
    model, layout, seq_len = stage.model, stage.layout, stage.seq_len
    global_tokens = layout.global_batch * seq_len
    model_flops = model.model_flops_per_token(seq_len) * global_tokens
    # Full recomputation reruns a layer's forward: a third of its 6N, less the output layer's.
    full = model.model_flops_per_token(seq_len) / 3 - 2.0 * model.hidden * model.vocab_size
    recompute_flops = {
        "none": 0.0,
        "selective": stage.framework.selective.extra_flops_per_token(model, seq_len),
        "full": stage.recomputed * full,
    }[layout.recompute] * global_tokens
    return model_flops, model_flops + recompute_flops


def parameter_tensors(
    model: ModelSpec, layout: TrainingLayout, framework: Framework, *, layers: int, stage: int
) -> tuple[float, float]:
    """(plain, DTensor) parameter tensors one GPU of pipeline stage ``stage`` holds, with its
    ``layers`` layers (an MoE model's averaged over dense and MoE layers).

    FSDP2 (fsdp, hsdp, and zero1 / zero2 where ``framework.zero_on_fsdp``) makes every
    parameter a DTensor; otherwise the tp and ep shards are DTensors where
    ``framework.dtensor_parameters`` (the row-parallel biases not where
    ``framework.plain_row_biases``), the rest plain tensors.
    """
    share = model.moe_layers / model.layers if model.is_moe else 0.0
    dense = model.layer_tensors(moe_layer=False)
    moe = model.layer_tensors(moe_layer=True) if model.is_moe else dense
    split, other, expert = ((1 - share) * d + share * e for d, e in zip(dense, moe, strict=True))
    total = layers * (split + other + expert)
    if stage == 0:
        total += model.embedding_tensors()
    if stage == layout.pp - 1:
        total += model.head_tensors()
    fsdp2 = ("fsdp", "hsdp", "zero1", "zero2") if framework.zero_on_fsdp else ("fsdp", "hsdp")
    if layout.sharding in fsdp2:
        return 0.0, total
    if not framework.dtensor_parameters:
        return total, 0.0
    if framework.plain_row_biases:
        split -= (1 - share) * model.row_parallel_biases(moe_layer=False)
        split -= share * model.row_parallel_biases(moe_layer=True)
    dtensors = layers * split if layout.tp > 1 else 0.0
    dtensors += layers * expert if layout.ep > 1 else 0.0
    return total - dtensors, dtensors


def tokens_per_s_per_gpu(layout: TrainingLayout, seq_len: int, step: StepTime) -> float:
    return layout.global_batch * seq_len / (step.step_s * layout.world_size)
