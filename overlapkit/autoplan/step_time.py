"""Predicted time of one training step of a layout: compute, exposed communication, bubble.

Per micro-batch, on the slowest pipeline stage (``ceil(layers / (pp x v)) x v`` layers, plus
the output layer on the last stage):

- **compute**: forward FLOPs of its layers (``2 x`` active matmul parameters per token, and
  attention's ``2 x seq x heads x (qk_dim + v_dim)`` per token), backward twice that,
  recomputation's extra forward (full: the whole layer; selective: what the framework's policy
  recomputes, ``autoplan.selective``: Megatron-LM's attention core), all
  divided by ``tp x cp`` and run at the achievable fraction of the device's dense peak
  (``autoplan.compute``); matmuls at the precision's peak (FP8 or BF16), attention at BF16's,
  each GEMM with its wave and tile losses (``autoplan.gemm``); the kernels that are not
  matmuls, and the loss over the vocabulary, at the achievable memory bandwidth
  (``autoplan.memory_traffic``); under tp, the host's dispatch of the sharded layers where it
  is not hidden (``tp_layer_dispatch_s``).
- **tp** (sequence parallel): all-gather before and reduce-scatter after attention and the
  MLP, in forward and backward (and in the recomputed forward), of the micro-batch's
  activations: on the critical path (``tp_overlap`` hides a share, as async TP does).
- **cp** (ring attention): K and V gathered in forward, again in backward with their gradients
  reduce-scattered, per layer; hidden behind that layer's attention compute. Where the framework
  all-gathers K and V before the attention instead (``Framework.cp_all_gather``,
  overlapkit-train): the gather in forward (again in a recomputed one, and in backward on a
  non-gloo library, where torch's ``context_parallel`` gathers again) and the gradients'
  reduce-scatter in backward, all on the critical path; on gloo (``flex_cp_allgather``) K and V
  are gathered, and their gradients scattered, by a call each, on CUDA in one buffer.
- **ep**: all-to-all dispatch and combine of each token's ``topk`` copies, forward and backward,
  per MoE layer: exposed (``ep_overlap`` hides a share, as DeepSeek's DualPipe does).
- **pp**: the activation sent forward and its gradient sent back, per model chunk; where the
  framework sums a tied embedding and head between the first and last stage
  (``Framework.tied_embedding_all_reduce``), that all-reduce after backward (2 ranks: as long
  as sending the gradient once).
- **fsdp / hsdp shard axis**: each block's parameters all-gathered for forward and for
  backward and its gradients reduce-scattered, per micro-batch (once per step where the framework
  accumulates unsharded, ``Framework.fsdp_reduces_once_per_step``), hidden behind its compute
  (the first block's gather is not; under a pipeline that reduces after the schedule,
  ``Framework.fsdp_reduce_after_pipeline``, the reduction is exposed).

Then ``step = (m + (pp - 1) / v) x t_micro_batch`` (1F1B, interleaved: Narayanan et al.,
SC'21), plus the data-parallel gradient traffic that does not hide behind the last
micro-batch's backward (ddp all-reduce; zero1 reduce-scatter, then the parameter all-gather
behind the next forward; zero2 reduce-scatter per micro-batch; hsdp's replica all-reduce; in
Megatron-LM's buckets, or per block for hsdp; ZeRO on FSDP2, ``Framework.zero_on_fsdp``: per
block, one all-gather ahead of the step's first forward and one reduce-scatter in its last
backward, zero2 one in every backward; ``autoplan.grad_sync``, which also holds what the
framework changes there),
plus the optimizer step (memory-bound: ~30 bytes read and written per local parameter; where
the host steps tensor by tensor, a cost per parameter tensor, more for DTensors).
Hidden communication uses ``overlap_efficiency`` of the window, and one of its collectives
(the last gradient bucket, the first parameter gather, FSDP's first gather and last
reduce-scatter) hides behind nothing. Every collective is the cost
model's estimate on the group the layout's placement gives (``autoplan.group_costs``).
"""

from __future__ import annotations

from dataclasses import dataclass

from overlapkit.autoplan.compute import gemm_rates
from overlapkit.autoplan.framework import MEGATRON, Framework
from overlapkit.autoplan.gemm import (
    GemmRates,
    gemm_seconds,
    layer_matmul_seconds,
    unfused_attention_seconds,
)
from overlapkit.autoplan.grad_sync import StepWindows, grad_sync
from overlapkit.autoplan.group_costs import HSDP_ORDER, TRAFFIC_ORDER, AxisCosts
from overlapkit.autoplan.memory import BF16, Precision, layers_per_stage, stage_params
from overlapkit.autoplan.memory_traffic import layer_memory_seconds, loss_bytes
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.layout import TrainingLayout
from overlapkit.topology.accelerator import Accelerator

OPTIMIZER_BYTES_PER_PARAM = 30
"""Adam step per local parameter: read grad, master, m, v (16), write master, m, v (12) and
the bf16 weight (2)."""


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


def predict_step(
    model: ModelSpec, layout: TrainingLayout, options: StepOptions, costs: AxisCosts
) -> StepTime:
    """Predict one step of ``layout`` (see module doc)."""
    o, lay = options, layout
    s, b = o.seq_len, lay.micro_batch
    m, pp, v, tp, cp = lay.num_micro_batches, lay.pp, lay.virtual_stages, lay.tp, lay.cp
    act = o.precision.activation_bytes
    tokens = b * s  # one micro-batch of one replica; its tp x cp group shares the work
    matmul_fraction = o.achievable if o.matmul_achievable is None else o.matmul_achievable
    mm_rates = gemm_rates(
        o.accelerator, o.precision.matmul_dtype, matmul_fraction, element_bytes=act
    )
    attn_rates = gemm_rates(o.accelerator, "bf16", o.achievable, element_bytes=act)
    n_layers = layers_per_stage(model, lay)
    moe_per_stage = n_layers * (model.moe_layers / model.layers) if model.is_moe else 0.0

    split = tp * cp
    mm_fwd, mm_bwd = _layer_matmul_s(model, lay, tokens, mm_rates)
    if o.flash_attention:
        attn_fwd = _attention_flops(model, tokens, s) / attn_rates.flops_per_s / split
        attn_bwd = 2 * attn_fwd
    else:
        attn_fwd, attn_bwd = unfused_attention_seconds(model, b, s, tp=tp, cp=cp, rates=attn_rates)
    fwd = n_layers * (mm_fwd + attn_fwd)
    bwd = n_layers * (mm_bwd + attn_bwd)
    recomputed = lay.recomputed_share(n_layers)
    extra = recomputed * fwd
    fw = o.framework
    if lay.recompute == "selective":
        extra = n_layers * fw.selective.extra_forward_s(
            model, matmul_s=mm_fwd, attention_s=attn_fwd, flash=o.flash_attention
        )
    # The output layer runs on the last stage (all of them with pp = 1): it is the slowest.
    vocab_tp = tp if fw.vocab_parallel else 1
    head_rows = max(1, round(tokens / cp))
    head_fwd = gemm_seconds(head_rows, model.hidden, model.vocab_size // vocab_tp, mm_rates)
    # Kernels that are not matmuls (norms, activations, softmax, dropout): memory-bound.
    if mm_rates.bytes_per_s:
        mem_fwd, mem_bwd = layer_memory_seconds(
            model,
            lay,
            o.precision,
            seq_len=s,
            flash_attention=o.flash_attention,
            recomputed=recomputed,
            selective=fw.selective,
            bytes_per_s=mm_rates.bytes_per_s,
        )
        fwd += n_layers * mem_fwd
        bwd += n_layers * mem_bwd
        # The loss over the vocabulary (cross entropy on the last stage's logits).
        logits = head_rows * model.vocab_size / vocab_tp
        loss_fwd, loss_bwd = (logits * n / mm_rates.bytes_per_s for n in loss_bytes(o.precision))
    else:
        loss_fwd = loss_bwd = 0.0
    t_compute = fwd + bwd + extra + 3 * head_fwd + loss_fwd + loss_bwd
    if tp > 1:  # forward, backward and the recomputed forward through each sharded layer
        t_compute += n_layers * (2 + recomputed) * o.tp_layer_dispatch_s
    t_bwd = bwd + extra + 2 * head_fwd + loss_bwd

    hsdp = lay.sharding == "hsdp"
    order = HSDP_ORDER if hsdp else TRAFFIC_ORDER
    sizes = dict(lay.dims)
    if hsdp:
        sizes |= {"dp_replicate": lay.dp // lay.dp_shard, "dp_shard": lay.dp_shard}
        del sizes["dp"]

    def cost(collective: str, nbytes: float, *axes: str) -> float:
        """One collective call over the groups of ``axes``: transfer and call overhead."""
        seconds = costs.time_s(collective, nbytes, sizes, order, axes)
        return seconds + o.collective_overhead_s if seconds > 0 else 0.0

    # Tensor parallel: with sequence parallelism 2 all-gathers + 2 reduce-scatters per layer
    # pass; without, the framework's all-reduces of the replicated activations.
    tp_bytes = tokens / cp * model.hidden * act
    if fw.sequence_parallel:
        tp_fwd = 2 * (cost("all_gather", tp_bytes, "tp") + cost("reduce_scatter", tp_bytes, "tp"))
        tp_bwd = tp_fwd
    else:
        all_reduce = cost("all_reduce", tp_bytes, "tp")
        tp_fwd = fw.tp_forward_all_reduces * all_reduce
        tp_bwd = fw.tp_backward_all_reduces * all_reduce
    tp_total = n_layers * ((1 + recomputed) * tp_fwd + tp_bwd)
    if lay.recompute == "selective" and fw.sequence_parallel:
        # The policy's recomputed forward gathers its sequence-parallel inputs again.
        regathers = fw.selective.tp_all_gathers_recomputed
        tp_total += n_layers * regathers * cost("all_gather", tp_bytes, "tp")
    tp_exposed = (1 - o.tp_overlap) * tp_total

    # Context parallel: ring attention hidden behind each layer's attention, or K/V gathered
    # before it (and their gradients scattered after its backward) on the critical path.
    kv_bytes = tokens * (model.kv_dim + model.v_dim) * act / tp
    kv_gather, kv_scatter = (cost(c, kv_bytes, "cp") for c in ("all_gather", "reduce_scatter"))
    if fw.cp_all_gather and str(costs.topology.library) == "gloo":
        # cplib::flex_cp_allgather gathers K and V with a call each, and reduce-scatters their
        # gradients with a call each.
        k_v = [tokens * dim * act / tp for dim in (model.kv_dim, model.v_dim)]
        gather = sum(cost("all_gather", nbytes, "cp") for nbytes in k_v)
        scatter = sum(cost("reduce_scatter", nbytes, "cp") for nbytes in k_v)
        cp_total = n_layers * ((1 + recomputed) * gather + scatter)
        cp_exposed = cp_total
    elif fw.cp_all_gather:  # torch's context_parallel: K and V in one buffer, again in backward
        cp_total = n_layers * ((2 + recomputed) * kv_gather + kv_scatter)
        cp_exposed = cp_total
    else:
        cp_layer = 2 * kv_gather + kv_scatter
        cp_total = n_layers * cp_layer
        cp_exposed = n_layers * max(0.0, cp_layer - o.overlap_efficiency * 3 * attn_fwd)

    # Expert parallel: dispatch + combine, forward and backward (and recomputed forward).
    ep_bytes = tokens / (cp * tp) * model.hidden * model.dispatch_copies * act
    ep_passes = 4 + 2 * recomputed
    ep_total = moe_per_stage * ep_passes * cost("all_to_all", ep_bytes, "ep")
    ep_exposed = (1 - o.ep_overlap) * ep_total

    # Pipeline: one activation forward and one gradient back per model chunk boundary.
    pp_bytes = tokens / cp * model.hidden * act / tp
    pp_total = 2 * v * cost("send_recv", pp_bytes, "pp") if pp > 1 else 0.0
    tied = 0.0
    if pp > 1 and model.tied_embeddings and fw.tied_embedding_all_reduce:
        vocab_rows = model.vocab_size / (tp if fw.vocab_parallel else 1)
        tied = cost("send_recv", vocab_rows * model.hidden * o.precision.grad_reduce_bytes, "pp")

    # Data-parallel traffic of the heaviest stage's parameters (``autoplan.grad_sync``).
    stage = stage_params(model, lay, stage=0, vocab_parallel=fw.vocab_parallel)
    last = stage_params(model, lay, stage=pp - 1, vocab_parallel=fw.vocab_parallel)
    dense_params = max(stage.dense, last.dense)
    expert_params = max(stage.expert, last.expert)
    sync = grad_sync(
        lay,
        stage=stage,
        dense_params=dense_params,
        expert_params=expert_params,
        precision=o.precision,
        framework=fw,
        windows=StepWindows(
            compute_s=t_compute, backward_s=t_bwd, overlap_efficiency=o.overlap_efficiency
        ),
        forward_s=fwd,
        cost=cost,
    )
    fsdp_mb, dp_total, dp_exposed = sync.per_micro_batch_s, sync.total_s, sync.exposed_s

    t_mb = t_compute + tp_exposed + cp_exposed + ep_exposed + pp_total + fsdp_mb
    bubble = (pp - 1) / v * t_mb
    pipeline = m * t_mb + bubble + tied

    z_dense, z_expert = (
        (1, 1)
        if lay.sharding == "ddp"
        else (lay.dp_shard, lay.dp_shard)
        if hsdp
        else (lay.dp * lay.ep * cp, lay.dp * cp)
    )
    local = dense_params / z_dense + expert_params / z_expert
    optimizer = 0.0
    if o.optimizer_param_s is not None:
        optimizer = local * o.optimizer_param_s
    elif mm_rates.bytes_per_s:
        optimizer = local * OPTIMIZER_BYTES_PER_PARAM / mm_rates.bytes_per_s
    if o.optimizer_tensor_s or o.optimizer_dtensor_s:
        optimizer += max(
            plain * o.optimizer_tensor_s + dtensors * o.optimizer_dtensor_s
            for plain, dtensors in (
                parameter_tensors(model, lay, fw, layers=stage.layers, stage=0),
                parameter_tensors(model, lay, fw, layers=last.layers, stage=pp - 1),
            )
        )

    step = pipeline + dp_exposed + optimizer
    global_tokens = lay.global_batch * s
    model_flops = model.model_flops_per_token(s) * global_tokens
    recompute_flops = {
        "none": 0.0,
        "selective": fw.selective.extra_flops_per_token(model, s),
        "full": recomputed
        * (model.model_flops_per_token(s) / 3 - 2.0 * model.hidden * model.vocab_size),
    }[lay.recompute] * global_tokens
    return StepTime(
        step_s=step,
        compute_s=m * t_compute,
        tp_s=m * tp_exposed,
        cp_s=m * cp_exposed,
        ep_s=m * ep_exposed,
        pp_s=m * pp_total + tied,
        fsdp_s=m * fsdp_mb,
        dp_s=dp_exposed,
        bubble_s=bubble,
        optimizer_s=optimizer,
        comm_total_s=m * (tp_total + cp_total + ep_total + pp_total) + tied + dp_total,
        model_flops=model_flops,
        hardware_flops=model_flops + recompute_flops,
    )


def parameter_tensors(
    model: ModelSpec, layout: TrainingLayout, framework: Framework, *, layers: int, stage: int
) -> tuple[float, float]:
    """(plain, DTensor) parameter tensors one GPU of pipeline stage ``stage`` holds, with its
    ``layers`` layers (an MoE model's averaged over dense and MoE layers).

    FSDP2 (fsdp, hsdp, and zero1 / zero2 where ``framework.zero_on_fsdp``) makes every
    parameter a DTensor; otherwise the tp and ep shards are DTensors where
    ``framework.dtensor_parameters``, the rest plain tensors.
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
    dtensors = 0.0
    if framework.dtensor_parameters:
        dtensors += layers * split if layout.tp > 1 else 0.0
        dtensors += layers * expert if layout.ep > 1 else 0.0
    return total - dtensors, dtensors


def tokens_per_s_per_gpu(layout: TrainingLayout, seq_len: int, step: StepTime) -> float:
    return layout.global_batch * seq_len / (step.step_s * layout.world_size)
