"""Device-memory time of a layer's kernels that are not matrix multiplies.

Norms, activation functions, dropout, residual adds and, without flash attention, the attention
core's softmax and dropout do a few operations per element they read and write: they run at the
device's achievable memory bandwidth (``autoplan.compute.achievable_bandwidth``), and their share
of a layer grows as the hidden size shrinks (their bytes grow with ``h`` and ``a x s`` per token,
the GEMMs' FLOPs with ``h^2``).

- **Saved activations** (everything but the attention core): ``TRAFFIC_PASSES`` passes over what
  the layer keeps for backward (written in forward, read in backward, their gradients written),
  one more per recomputed forward; selective recomputation also rebuilds what the framework's
  policy recomputes element-wise (``autoplan.selective``: reads its input, writes it).
- **The attention core** (no flash attention: ``a x s`` score elements per token, split over tp
  and cp), counted kernel by kernel as Megatron-LM runs it (``FusedScaleMaskSoftmax``, then
  dropout on the probabilities): forward, softmax reads the scores and writes the probabilities
  (``2c`` bytes per element, ``c`` the activation bytes), dropout reads them and writes its
  output and a one-byte mask (``2c + 1``); backward, dropout reads the gradient and the mask and
  writes (``2c + 1``), softmax reads the probabilities and the gradient and writes (``3c``).
  A recomputed forward (full recomputation, or selective, whose recomputation is this core)
  repeats the forward's. ``2c`` + ``2c + 1`` = 9 bytes forward and 11 backward in BF16, where
  three passes over the 5 bytes it saves would be 15 in all.
- **The loss** over the vocabulary, on the last stage: Megatron-LM's vocabulary-parallel cross
  entropy (``tensor_parallel/cross_entropy.py``) in FP32 over the logits, per logit: the cast
  (``c + 4`` bytes), the max (4), subtracting it (8), ``exp`` (8), the sum (4) and the division
  into the softmax it keeps (8) forward; scaling that by the loss gradient (8) and the cast back
  (``4 + c``) backward: 38 and 14 bytes in BF16. Its share grows as ``vocab / (hidden x
  layers)``: 1.5 % of the step of Llama 3 8B on 64 A100s or of Megatron's 1.7B GPT, 0.2 % of
  its 1T model's, more where the last pipeline stage holds few layers (DeepSeek-V3 at pp 16:
  4 %). A fused cross entropy (Megatron-Core's ``--cross-entropy-loss-fusion``) reads the
  logits once and writes their gradient once, about a tenth of that: which loss a framework
  runs is not modelled, the unfused one is priced.
"""

from __future__ import annotations

from overlapkit.autoplan.memory import Precision, activation_bytes_per_token, layer_activation_bytes
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.selective import SelectiveRecompute
from overlapkit.layout import TrainingLayout

TRAFFIC_PASSES = 3
"""Times a layer's saved activations cross device memory in a step (see module doc)."""


def attention_core_bytes(precision: Precision, *, dropout: bool) -> tuple[float, float]:
    """(forward, backward) bytes the attention core's kernels move per score element."""
    c = precision.activation_bytes
    mask_pass = 2 * c + 1 if dropout else 0
    return 2 * c + mask_pass, 3 * c + mask_pass


def loss_bytes(precision: Precision) -> tuple[float, float]:
    """(forward, backward) bytes the cross-entropy kernels move per logit (see module doc)."""
    c = precision.activation_bytes
    return c + 4 + 4 + 8 + 8 + 4 + 8, 8 + 4 + c


def layer_memory_seconds(
    model: ModelSpec,
    layout: TrainingLayout,
    precision: Precision,
    *,
    seq_len: int,
    flash_attention: bool,
    recomputed: float,
    selective: SelectiveRecompute,
    bytes_per_s: float,
) -> tuple[float, float]:
    """(forward, backward) seconds one layer's memory-bound kernels take for one micro-batch
    on one GPU. ``recomputed`` is the share of the layer's forward recomputed (full
    recomputation); ``selective`` the framework's policy, used under selective recomputation.
    The saved activations' traffic is split a third to forward (as the step model always has);
    the attention core's recomputed forward counts in backward, where it runs."""
    moe_layer = model.is_moe and model.dense_layers == 0
    tokens = layout.micro_batch * seq_len / layout.cp
    saved = layer_activation_bytes(
        model,
        layout,
        precision,
        seq_len=seq_len,
        flash_attention=flash_attention,
        moe_layer=moe_layer,
        recompute="none",
    )
    _, _, core_per_token = activation_bytes_per_token(
        model, precision, seq_len=seq_len, flash_attention=flash_attention, moe_layer=moe_layer
    )
    saved -= tokens * core_per_token / layout.tp
    streamed = (TRAFFIC_PASSES + recomputed) * saved
    if layout.recompute == "selective":
        rebuilt = selective.rebuilt_bytes_per_token(
            model, precision.activation_bytes, moe_layer=moe_layer
        )
        streamed += 2 * tokens * rebuilt / layout.tp
    # One pass of three is forward's (the recomputed one is counted there too, as before).
    fwd = streamed / TRAFFIC_PASSES
    bwd = streamed - fwd
    if not flash_attention:
        scores = tokens * model.heads * seq_len / layout.tp
        forward, backward = attention_core_bytes(precision, dropout=model.dropout)
        if layout.recompute == "selective":
            again = 1.0 if selective.recomputes_attention_core else 0.0
        else:
            again = recomputed
        fwd += scores * forward
        bwd += scores * (backward + again * forward)
    return fwd / bytes_per_s, bwd / bytes_per_s
