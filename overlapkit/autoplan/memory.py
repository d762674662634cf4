"""Per-GPU memory of a training layout: model state, activations, buffers, a fixed allowance.

**Model state** (ZeRO, Rajbhandari et al. SC'20, with Megatron-LM's mixed-precision bytes):
a GPU holds the parameters of its pipeline stage divided by tp (experts also by ep). With bf16
training, ddp/zero1/zero2 keep bf16 weights (2 bytes), fp32 gradients (4) and fp32 master
weights plus Adam's two moments (12) per parameter: 18 bytes under ddp, ``6 + 12/Z`` under zero1
(Megatron's distributed optimizer), ``2 + 16/Z`` under zero2. FSDP2 (fsdp, hsdp) keeps sharded
fp32 weights that double as the master copy, fp32 gradients and Adam: ``16/Z``, plus the
unsharded bf16 weights of the blocks in flight. ``Z`` is the sharding group: dense parameters
over ``dp x ep x cp`` (their replicas), experts over ``dp x cp``; hsdp over ``dp_shard``.

**Activations** per layer and micro-batch (Korthikanti et al., MLSys'23, section 4, generalised
from GPT to GQA, gated MLPs, MoE and flash attention): each tensor saved for backward counts
once, tagged by how it is split. The norm inputs, the inputs of the q/k/v and MLP projections
and the dropout masks are split over tp only with sequence parallelism (always on with tp > 1
here); q, k, v, the attention output and the MLP's inner activations are split over tp; the
attention core (softmax output, its dropout mask and output, ``a x s`` per token) is what
selective recomputation drops (Korthikanti's definition), and what flash attention never
stores (it keeps the output and the log-sum-exp). What selective recomputation keeps is the
framework's policy (``autoplan.selective``): Megatron-LM's also rebuilds the MLP's
activation-function outputs from the kept first projection (``mlp_act``), which is what it
saves once flash attention has removed the core. Full
recomputation keeps only each layer's input, and rebuilds one layer at a time in backward.
For GPT (``34 + 5as/h`` bytes per token per layer, no parallelism) this gives Korthikanti's
equations exactly without recomputation, with tensor and sequence parallelism and with full
recomputation. Context parallelism divides the tokens by cp.

**Pipeline**: under 1F1B the first stage holds ``min(pp, m)`` micro-batches in flight, and the
interleaved schedule ``1 + (pp - 1) / (pp x v)`` times that (Korthikanti, section 4.2.3); the
zero-bubble schedules hold each micro-batch until its deferred weight step
(``autoplan.pipeline_schedule.in_flight_micro_batches``). The last stage also holds one
micro-batch of logits (bf16 and the fp32 copy cross-entropy uses).

**Allowance**: a CUDA context (PyTorch forum: the first CUDA call takes ~723 MiB, "the CUDA
context"), NCCL's communicator buffers and cuBLAS workspaces, together ``RESERVED_GB``; and
``FRAGMENTATION`` of what is allocated, for the caching allocator's fragmentation.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import lru_cache

from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.pipeline_schedule import in_flight_micro_batches
from overlapkit.autoplan.selective import ATTENTION_CORE, SelectiveRecompute
from overlapkit.layout import TrainingLayout

RESERVED_GB = 2.0
"""CUDA context (~0.75 GB), NCCL buffers and cuBLAS workspaces per GPU, GB."""
FRAGMENTATION = 0.05
"""Share of allocated memory the caching allocator loses to fragmentation."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Precision:
    """Bytes per parameter and per activation element of one training recipe."""

    name: str
    activation_bytes: int
    """Activations and the compute copy of weights (bf16: 2)."""
    weight_bytes: int
    """ddp/zero: the persistent weights."""
    grad_bytes: int
    """ddp/zero: the gradient buffer."""
    optimizer_bytes: int
    """ddp/zero: optimizer state per parameter (fp32 master + Adam's two moments: 12)."""
    sharded_bytes: int
    """fsdp/hsdp: weights + gradients + optimizer per parameter, all sharded (16 for FSDP2)."""
    grad_reduce_bytes: int
    """ddp/zero: the gradient reduction's element size on the wire (Megatron: bf16)."""
    fsdp_reduce_bytes: int
    """fsdp/hsdp: reduce-scatter element size (torchtitan's FSDP2 reduce_dtype: fp32)."""
    matmul_dtype: str = "bf16"
    """Which peak the matrix multiplies run at (``bf16`` or ``fp8``)."""


BF16 = Precision(
    name="bf16",
    activation_bytes=2,
    weight_bytes=2,
    grad_bytes=4,
    optimizer_bytes=12,
    sharded_bytes=16,
    grad_reduce_bytes=2,
    fsdp_reduce_bytes=4,
)
FP8 = Precision(
    name="fp8",
    activation_bytes=2,
    # Transformer Engine keeps an FP8 copy of each weight beside the bf16 one.
    weight_bytes=3,
    grad_bytes=4,
    optimizer_bytes=12,
    sharded_bytes=17,
    grad_reduce_bytes=2,
    fsdp_reduce_bytes=4,
    matmul_dtype="fp8",
)
FP32 = Precision(
    name="fp32",
    activation_bytes=4,
    weight_bytes=4,
    grad_bytes=4,
    optimizer_bytes=8,
    sharded_bytes=16,
    grad_reduce_bytes=4,
    fsdp_reduce_bytes=4,
)
PRECISIONS = {p.name: p for p in (BF16, FP8, FP32)}


@dataclass(frozen=True, slots=True)
class StageParams:
    """Parameters one GPU of a pipeline stage holds (counts, already divided by tp / ep)."""

    dense: float
    expert: float
    dense_layer_max: float
    """The largest layer's dense parameters on this GPU (FSDP's unsharded block)."""
    expert_layer_max: float
    layers: int


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Per-GPU memory of the heaviest pipeline stage, bytes."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    """FSDP's unsharded blocks in flight, the last stage's logits."""
    reserved: float
    """CUDA context, NCCL, workspaces and fragmentation."""

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.activations
            + self.buffers
            + (self.reserved)
        )

    def to_dict(self) -> dict:
        """GB (10^9 bytes) per component."""
        return {
            "weights_gb": self.weights / 1e9,
            "grads_gb": self.grads / 1e9,
            "optimizer_gb": self.optimizer / 1e9,
            "activations_gb": self.activations / 1e9,
            "buffers_gb": self.buffers / 1e9,
            "reserved_gb": self.reserved / 1e9,
            "total_gb": self.total / 1e9,
        }


def layers_per_stage(model: ModelSpec, layout: TrainingLayout) -> int:
    """Layers on the fullest pipeline stage: ``ceil(layers / (pp x v)) x v``."""
    chunks = layout.pp * layout.virtual_stages
    return math.ceil(model.layers / chunks) * layout.virtual_stages


def stage_params(
    model: ModelSpec, layout: TrainingLayout, *, stage: int, vocab_parallel: bool = True
) -> StageParams:
    """What one GPU of pipeline stage ``stage`` holds (layers dealt round-robin in chunks).

    ``vocab_parallel``: the embedding and the head are split over tp, as Megatron-LM splits
    them; False: every tp rank holds them whole (overlapkit-train, ``autoplan.framework``).
    """
    return _stage_params(
        model, layout.pp, layout.virtual_stages, layout.tp, layout.ep, stage, vocab_parallel
    )


@lru_cache(maxsize=4096)
def _stage_params(
    model: ModelSpec, pp: int, v: int, tp: int, ep: int, stage: int, vocab_parallel: bool
) -> StageParams:
    per_chunk = math.ceil(model.layers / (pp * v))
    indices = [
        index
        for chunk in range(v)
        for index in range(
            (chunk * pp + stage) * per_chunk,
            min((chunk * pp + stage + 1) * per_chunk, model.layers),
        )
    ]
    dense = expert = dense_max = expert_max = 0.0
    for index in indices:
        d, e = model.layer_params(index)
        dense, expert = dense + d / tp, expert + e / (tp * ep)
        dense_max, expert_max = max(dense_max, d / tp), max(expert_max, e / (tp * ep))
    # Embedding, head and norms are vocabulary-parallel over tp (Megatron).
    vocab_tp = tp if vocab_parallel else 1
    if stage == 0:
        dense += model.embedding_params() / vocab_tp
    if stage == pp - 1:
        dense += model.head_params() / vocab_tp
        if model.tied_embeddings and pp > 1:  # the last stage keeps its own copy (Megatron)
            dense += model.vocab_size * model.hidden / vocab_tp
    return StageParams(dense, expert, dense_max, expert_max, len(indices))


def sharding_groups(layout: TrainingLayout) -> tuple[int, int]:
    """(dense, expert) ranks a parameter's state is sharded over under zero/fsdp/hsdp."""
    if layout.sharding == "hsdp":
        return layout.dp_shard, layout.dp_shard
    return layout.dp * layout.ep * layout.cp, layout.dp * layout.cp


def model_state_bytes(
    params: StageParams, layout: TrainingLayout, precision: Precision
) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per GPU for ``params`` under ``layout.sharding``."""
    z_dense, z_expert = sharding_groups(layout)

    def split(count: float, ranks: int) -> tuple[float, float, float]:
        match layout.sharding:
            case "ddp":
                return (
                    precision.weight_bytes * count,
                    precision.grad_bytes * count,
                    precision.optimizer_bytes * count,
                )
            case "zero1":
                return (
                    precision.weight_bytes * count,
                    precision.grad_bytes * count,
                    precision.optimizer_bytes * count / ranks,
                )
            case "zero2":
                return (
                    precision.weight_bytes * count,
                    precision.grad_bytes * count / ranks,
                    precision.optimizer_bytes * count / ranks,
                )
            case _:  # fsdp, hsdp: FSDP2's sharded fp32 weights are the master copy
                state = precision.sharded_bytes * count / ranks
                # Of FSDP2's 16 bytes: fp32 weight 4, fp32 gradient 4, Adam's two moments 8.
                return 0.25 * state, 0.25 * state, 0.5 * state

    dense = split(params.dense, z_dense)
    expert = split(params.expert, z_expert)
    return tuple(a + b for a, b in zip(dense, expert, strict=True))


def activation_bytes_per_token(
    model: ModelSpec,
    precision: Precision,
    *,
    seq_len: int,
    flash_attention: bool,
    moe_layer: bool,
) -> tuple[float, float, float]:
    """(split-with-sp, split-over-tp, attention-core) bytes one layer saves per token.

    The first part is divided by tp only under sequence parallelism, the other two always;
    the core is what Korthikanti's selective recomputation drops (``a x s`` per token; nothing
    under flash); what a framework's selective recomputation keeps is its policy's
    (``autoplan.selective``).
    """
    c = precision.activation_bytes
    h = model.hidden
    masks = 2 * h if model.dropout else 0  # one byte each: after attention and after the MLP
    # Two norm inputs, the q/k/v input and the MLP (or router) input.
    sp_part = 4 * c * h + masks
    tp_part = (
        c * (model.q_dim + model.kv_dim + model.v_dim) + c * model.heads * model.attention_v_dim
    )
    core = 0.0
    if flash_attention:
        tp_part += 4 * model.heads  # fp32 log-sum-exp per head
    else:
        keys = seq_len  # a query attends to the whole sequence (ring attention: all of it too)
        core = model.heads * keys * (c + (1 + c if model.dropout else 0))
    inner = 4 if model.gated_mlp else 2  # eager SwiGLU keeps gate, up, silu(gate), their product
    if moe_layer:
        k = model.topk
        # Routed copies of each token in and out of the experts, the experts' insides, the
        # shared experts and the router's fp32 scores.
        tp_part += k * (2 * c * h + inner * c * model.moe_ffn_hidden)
        tp_part += model.shared_experts * inner * c * model.moe_ffn_hidden + 4 * model.experts
    else:
        tp_part += inner * c * model.ffn_hidden
    return sp_part, tp_part, core


def layer_activation_bytes(
    model: ModelSpec,
    layout: TrainingLayout,
    precision: Precision,
    *,
    seq_len: int,
    flash_attention: bool,
    moe_layer: bool,
    recompute: str | None = None,
    selective: SelectiveRecompute = ATTENTION_CORE,
) -> float:
    """Bytes one layer keeps for backward for one micro-batch on one GPU (``selective``: what
    selective recomputation keeps, the framework's policy)."""
    return _layer_activation_bytes(
        model,
        layout.micro_batch,
        layout.tp,
        layout.cp,
        layout.ep,
        layout.sequence_parallel,
        precision,
        seq_len,
        flash_attention,
        moe_layer,
        layout.recompute if recompute is None else recompute,
        selective,
    )


@lru_cache(maxsize=65536)
def _layer_activation_bytes(
    model: ModelSpec,
    micro_batch: int,
    tp: int,
    cp: int,
    ep: int,
    sequence_parallel: bool,
    precision: Precision,
    seq_len: int,
    flash_attention: bool,
    moe_layer: bool,
    recompute: str,
    selective: SelectiveRecompute,
) -> float:
    tokens = micro_batch * seq_len / cp
    sp_divisor = tp if sequence_parallel else 1
    if recompute == "full":
        return tokens * precision.activation_bytes * model.hidden / sp_divisor
    saved = activation_bytes_per_token(
        model, precision, seq_len=seq_len, flash_attention=flash_attention, moe_layer=moe_layer
    )
    if recompute == "selective":
        saved = selective.kept_bytes_per_token(
            model, precision.activation_bytes, saved=saved, moe_layer=moe_layer, tp=tp, ep=ep
        )
    sp_part, tp_part, core = saved
    return tokens * (sp_part / sp_divisor + (tp_part + core) / tp)


def memory_breakdown(
    model: ModelSpec,
    layout: TrainingLayout,
    *,
    seq_len: int,
    precision: Precision = BF16,
    flash_attention: bool = True,
    fsdp_prefetch: int = 1,
    reserved_gb: float = RESERVED_GB,
    vocab_parallel: bool = True,
    selective: SelectiveRecompute = ATTENTION_CORE,
    fsdp_gathered_stage: bool = False,
) -> MemoryBreakdown:
    """Peak memory per GPU over the pipeline stages (see module doc), bytes.

    ``vocab_parallel``: the embedding, the head and the logits split over tp (Megatron-LM);
    False: whole on every tp rank (overlapkit-train, ``autoplan.framework``). ``selective``:
    what selective recomputation keeps (the framework's policy, ``autoplan.selective``).
    ``fsdp_gathered_stage``: under pp, FSDP keeps the stage's parameters gathered and its
    gradients unsharded for the whole step (torchtitan, ``Framework``'s
    ``fsdp_gathered_across_micro_batches``) instead of a block or two at a time.
    """
    best: MemoryBreakdown | None = None
    for stage in sorted({0, layout.pp - 1}):
        params = stage_params(model, layout, stage=stage, vocab_parallel=vocab_parallel)
        weights, grads, optimizer = model_state_bytes(params, layout, precision)
        activations = _stage_activations(
            model,
            layout,
            precision,
            params,
            seq_len=seq_len,
            flash_attention=flash_attention,
            first_stage=stage == 0,
            selective=selective,
        )
        buffers = _fsdp_buffers(
            layout, precision, params, fsdp_prefetch=fsdp_prefetch, gathered=fsdp_gathered_stage
        )
        if stage == layout.pp - 1:
            tokens = layout.micro_batch * seq_len / layout.cp
            vocab_tp = layout.tp if vocab_parallel else 1
            buffers += tokens * model.vocab_size / vocab_tp * (precision.activation_bytes + 4)
        allocated = weights + grads + optimizer + activations + buffers
        reserved = reserved_gb * 1e9 + FRAGMENTATION * allocated
        candidate = MemoryBreakdown(weights, grads, optimizer, activations, buffers, reserved)
        if best is None or candidate.total > best.total:
            best = candidate
    assert best is not None
    return best


def _layer_activations_by_kind(
    model: ModelSpec,
    layout: TrainingLayout,
    precision: Precision,
    *,
    seq_len: int,
    flash_attention: bool,
    recompute: str | None,
    selective: SelectiveRecompute,
) -> dict[bool, float]:
    """``layer_activation_bytes`` of a dense (False) and an MoE (True) layer; a dense model's
    dense figure under both keys."""
    kinds = (False, True) if model.is_moe else (False,)
    per_layer = {
        moe: layer_activation_bytes(
            model,
            layout,
            precision,
            seq_len=seq_len,
            flash_attention=flash_attention,
            moe_layer=moe,
            recompute=recompute,
            selective=selective,
        )
        for moe in kinds
    }
    per_layer.setdefault(True, per_layer[False])
    return per_layer


def _stage_activations(
    model: ModelSpec,
    layout: TrainingLayout,
    precision: Precision,
    params: StageParams,
    *,
    seq_len: int,
    flash_attention: bool,
    first_stage: bool,
    selective: SelectiveRecompute,
) -> float:
    """Bytes of activations a GPU of the stage holding ``params`` keeps at its peak: its layers'
    (averaged over dense and MoE layers) for every micro-batch in flight (the first stage's:
    ``in_flight_micro_batches``), and under full recomputation the one layer backward rebuilds
    whole."""
    by_kind = functools.partial(
        _layer_activations_by_kind,
        model,
        layout,
        precision,
        seq_len=seq_len,
        flash_attention=flash_attention,
        selective=selective,
    )
    moe_share = model.moe_layers / model.layers if model.is_moe else 0.0

    def mean(per_layer: dict[bool, float]) -> float:
        return (1 - moe_share) * per_layer[False] + moe_share * per_layer[True]

    mean_layer = mean(by_kind(recompute=None))
    share = layout.recomputed_share(params.layers)
    whole = by_kind(recompute="none") if layout.recompute == "full" else {}
    if layout.recompute == "full" and share < 1:
        mean_layer = share * mean_layer + (1 - share) * mean(whole)
    in_flight = in_flight_micro_batches(layout) if first_stage else 1.0
    activations = mean_layer * params.layers * in_flight
    if layout.recompute != "full":
        return activations
    # Backward rebuilds one layer at a time: its full activations, one micro-batch.
    return activations + max(whole.values())


def _fsdp_buffers(
    layout: TrainingLayout,
    precision: Precision,
    params: StageParams,
    *,
    fsdp_prefetch: int,
    gathered: bool,
) -> float:
    """Bytes FSDP holds unsharded on a GPU of the stage holding ``params`` (0 without FSDP):
    under pp with ``gathered``, the whole stage and its gradients in the reduce dtype; else the
    largest block, ``1 + fsdp_prefetch`` times, and its gradients."""
    if layout.sharding not in ("fsdp", "hsdp"):
        return 0.0
    if gathered and layout.pp > 1:
        whole = params.dense + params.expert
        return whole * (precision.activation_bytes + precision.fsdp_reduce_bytes)
    block = params.dense_layer_max + params.expert_layer_max
    return block * ((1 + fsdp_prefetch) * precision.activation_bytes + precision.fsdp_reduce_bytes)
