"""What "selective" recomputation recomputes, and so what it costs: a framework's policy.

Full recomputation means the same in every framework (a layer's forward again, keeping only its
input); selective recomputation does not: each framework picks which operations it recomputes.
A ``Framework`` (``autoplan.framework``) carries its policy as ``selective``, and the memory
(``autoplan.memory``) and step-time (``autoplan.step_time``) models ask the policy what a layer
keeps and what rebuilding the rest costs. Three policies are described:

- ``ATTENTION_CORE`` (Megatron-LM's ``--recompute-granularity selective``): Korthikanti et al.'s
  (MLSys'23, section 5), the attention core (``QK^T``, the softmax and its dropout, ``a x s``
  bytes per token and layer) is dropped after forward
  and recomputed in backward, plus the MLP's activation-function outputs, rebuilt from the kept
  first projection (Megatron-LM's ``--recompute-modules mlp_act`` / ``moe_act``). Flash
  attention never stores the core (its backward recomputes it anyway), so there the policy
  saves the activation outputs only, and costs their memory traffic only.
- ``SDPA_KERNEL`` (overlapkit-train's ``train.recompute=selective``,
  ``overlapkit/train/parallel/recompute.py``): every block runs under
  ``torch.utils.checkpoint`` with a
  policy that reruns the SDPA kernels in backward and saves every other op's output. What that
  keeps, measured on gpt_tiny's block (the profiler's allocations retained by a forward, in
  ``b x s x h`` fp32 tensors: none 16.03, selective 18.02, tp = 2 on 2 gloo ranks 10.02 and
  14.02): the SDPA output is not freed, because ``proj`` saves its input, a view of that
  output's storage; the log-sum-exp (4 bytes per head and token) is; and the selective cache
  also keeps the outputs of the two row-wise layers (``proj``, the MLP's second layer) that
  backward never reads and plain autograd frees after the residual add: ``2 x c x h`` bytes per
  token and layer more (under tp their all-reduced copies too, ``4 x c x h``, which this
  policy does not count: the memory model has no tp term outside its three parts). Its price
  is the attention's forward again in backward. With flash attention the backward kernel
  rebuilds the softmax from the log-sum-exp anyway, so the recomputed forward is pure extra
  work: one flash forward per layer, for a layer that then holds more memory than without
  recomputation. Without a fused kernel (``--attention softmax``) SDPA's math path is not one
  of the kernels the policy reruns: nothing is recomputed, the cache's extra outputs remain.
- ``TORCHTITAN_OP_SAC`` (torchtitan 0.3.0's ``activation-checkpoint:selective``,
  ``torchtitan/distributed/activation_checkpoint.py``: ``SelectiveAC``): a per-op policy over
  each block, which keeps only the block's input and the outputs of the operations it saves:
  attention (SDPA, FlexAttention), reduce-scatter and all-to-all outputs, and every *odd*
  ``mm`` / ``linear`` of the block in forward order (the 1st, 3rd, ...); everything else is
  recomputed in backward by running the block's forward again: every even matmul (a Llama
  block's ``wk``, ``wo`` and ``w3``), the norms, RoPE, the activation function, the residual
  adds, the tensor-parallel all-gathers before attention and the MLP, and the router and the
  routed experts (``torch._grouped_mm`` is not a saved op; ``moe.router.gate`` is recomputed by
  name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from overlapkit.autoplan.model_spec import ModelSpec


class SelectiveRecompute(Protocol):
    """A framework's selective recomputation, as the memory and step-time models price it."""

    name: str
    tp_all_gathers_recomputed: int
    """Sequence-parallel all-gathers per layer the recomputed forward runs again."""
    recomputes_attention_core: bool
    """Without flash attention, the attention core's kernels (softmax, dropout) run again in
    backward (their memory traffic counted again, ``autoplan.memory_traffic``)."""

    def kept_bytes_per_token(
        self,
        model: ModelSpec,
        element_bytes: int,
        *,
        saved: tuple[float, float, float],
        moe_layer: bool,
        tp: int,
        ep: int,
    ) -> tuple[float, float, float]:
        """Of ``saved`` (``memory.activation_bytes_per_token``: split-with-sp, split-over-tp
        and attention-core bytes one layer saves per token without recomputation), what the
        policy keeps, in the same three parts (each divided by tp by the caller: a part kept
        whole on every tp rank is returned ``tp`` times over)."""
        ...

    def rebuilt_bytes_per_token(
        self, model: ModelSpec, element_bytes: int, *, moe_layer: bool
    ) -> float:
        """Bytes per token the recomputed element-wise operations write again in backward
        (priced at memory bandwidth, read once and written once)."""
        ...

    def extra_forward_s(
        self, model: ModelSpec, *, matmul_s: float, attention_s: float, flash: bool
    ) -> float:
        """Seconds of one layer's forward run again, from its matmuls' (``matmul_s``) and its
        attention core's (``attention_s``) forward seconds; ``flash``: flash attention."""
        ...

    def extra_flops_per_token(self, model: ModelSpec, seq_len: int) -> float:
        """FLOPs per token (all layers) recomputed: what hardware FLOPs count beyond 6N."""
        ...


@dataclass(frozen=True, slots=True)
class AttentionCoreRecompute:
    """Korthikanti et al.'s selective recomputation with Megatron-LM's ``mlp_act`` (module doc)."""

    name: str = "attention core"
    tp_all_gathers_recomputed: int = 0
    recomputes_attention_core: bool = True

    def kept_bytes_per_token(
        self,
        model: ModelSpec,
        element_bytes: int,
        *,
        saved: tuple[float, float, float],
        moe_layer: bool,
        tp: int,
        ep: int,
    ) -> tuple[float, float, float]:
        sp_part, tp_part, _core = saved
        rebuilt = self.rebuilt_bytes_per_token(model, element_bytes, moe_layer=moe_layer)
        return sp_part, tp_part - rebuilt, 0.0

    def rebuilt_bytes_per_token(
        self, model: ModelSpec, element_bytes: int, *, moe_layer: bool
    ) -> float:
        # The activation function's output (and SwiGLU's product) comes back from the first
        # projection's output, which is kept.
        ffn = model.moe_ffn_hidden if moe_layer else model.ffn_hidden
        copies = model.topk + model.shared_experts if moe_layer else 1
        return copies * (2 if model.gated_mlp else 1) * element_bytes * ffn

    def extra_forward_s(
        self, model: ModelSpec, *, matmul_s: float, attention_s: float, flash: bool
    ) -> float:
        # Flash attention's backward recomputes the core whatever the policy says.
        return 0.0 if flash else attention_s

    def extra_flops_per_token(self, model: ModelSpec, seq_len: int) -> float:
        return model.attention_flops_per_token(seq_len)


ATTENTION_CORE = AttentionCoreRecompute()


@dataclass(frozen=True, slots=True)
class SdpaKernelRecompute:
    """overlapkit-train's selective recomputation: only the SDPA kernel reruns (module doc)."""

    name: str = "SDPA kernel"
    tp_all_gathers_recomputed: int = 0  # the rerun kernel takes the saved q, k, v
    recomputes_attention_core: bool = False
    """Without flash attention SDPA's math path is not a kernel the policy reruns."""

    def kept_bytes_per_token(
        self,
        model: ModelSpec,
        element_bytes: int,
        *,
        saved: tuple[float, float, float],
        moe_layer: bool,
        tp: int,
        ep: int,
    ) -> tuple[float, float, float]:
        sp_part, tp_part, core = saved
        # The outputs of the two row-wise layers stay in the selective cache until backward.
        cached = 2 * element_bytes * model.hidden
        # Under flash attention (no core stored) the log-sum-exp is recomputed, not kept.
        lse = 4 * model.heads if core == 0 else 0.0
        return sp_part + cached, tp_part - lse, core

    def rebuilt_bytes_per_token(
        self, model: ModelSpec, element_bytes: int, *, moe_layer: bool
    ) -> float:
        return 0.0

    def extra_forward_s(
        self, model: ModelSpec, *, matmul_s: float, attention_s: float, flash: bool
    ) -> float:
        return attention_s if flash else 0.0

    def extra_flops_per_token(self, model: ModelSpec, seq_len: int) -> float:
        return model.attention_flops_per_token(seq_len)


SDPA_KERNEL = SdpaKernelRecompute()


@dataclass(frozen=True, slots=True)
class Matmul:
    """One matrix multiply of a layer's forward, per token: its weights and output width."""

    params: float
    """Weights it multiplies by (its FLOPs per token are twice that)."""
    width: int
    """Output elements per token."""
    split: bool
    """Its output is split over tp (column-wise); False: whole on every tp rank (row-wise
    partial sums)."""
    counted: bool = True
    """Counted by torchtitan's every-second rule (``mm`` / ``linear``); False: the router
    (recomputed by name) and the routed experts (``_grouped_mm``: never saved)."""


def layer_matmuls(model: ModelSpec, *, moe_layer: bool) -> list[Matmul]:
    """One layer's matmuls in forward order, as torchtitan 0.3.0's decoders run them: attention
    (``wq``, ``wk``, ``wv``, ``wo``; MLA: ``wq`` or ``wq_a``/``wq_b``, ``wkv_a``, ``wkv_b``,
    ``wo``), then the MLP (``w1``, ``w3``, ``w2``), or the router, the routed experts (the
    ``topk`` each token visits) and the shared experts."""
    h = model.hidden
    if model.mla:
        rope, heads = model.qk_rope_head_dim, model.heads
        out = (
            [
                Matmul(h * model.q_lora_rank, model.q_lora_rank, False),
                Matmul(model.q_lora_rank * model.q_dim, model.q_dim, True),
            ]
            if model.q_lora_rank
            else [Matmul(h * model.q_dim, model.q_dim, True)]
        )
        kv_b = heads * (model.head_dim + model.v_head_dim)
        out += [
            Matmul(h * (model.kv_lora_rank + rope), model.kv_lora_rank + rope, False),
            Matmul(model.kv_lora_rank * kv_b, kv_b, True),
        ]
    else:
        kv = model.kv_heads * model.head_dim
        out = [Matmul(h * model.q_dim, model.q_dim, True)]
        out += [Matmul(h * kv, kv, True), Matmul(h * kv, kv, True)]
    out.append(Matmul(model.heads * model.attention_v_dim * h, h, False))

    def mlp(ffn: int, *, counted: bool = True, copies: int = 1) -> list[Matmul]:
        up = [Matmul(copies * h * ffn, copies * ffn, True, counted)]
        if model.gated_mlp:
            up.append(Matmul(copies * h * ffn, copies * ffn, True, counted))
        return [*up, Matmul(copies * ffn * h, copies * h, False, counted)]

    if not moe_layer:
        return out + mlp(model.ffn_hidden)
    out.append(Matmul(h * model.experts, model.experts, False, counted=False))
    out += mlp(model.moe_ffn_hidden, counted=False, copies=model.topk)
    for _ in range(model.shared_experts):
        out += mlp(model.moe_ffn_hidden)
    return out


def marked_matmuls(model: ModelSpec, *, moe_layer: bool) -> list[tuple[Matmul, bool]]:
    """Each matmul of ``layer_matmuls`` and whether torchtitan's selective policy recomputes
    it: every even counted one, and the uncounted ones (router, routed experts)."""
    out, count = [], 0
    for mm in layer_matmuls(model, moe_layer=moe_layer):
        count += mm.counted
        out.append((mm, not mm.counted or count % 2 == 0))
    return out


def _recomputed_params(model: ModelSpec, *, moe_layer: bool) -> float:
    return sum(mm.params for mm, redo in marked_matmuls(model, moe_layer=moe_layer) if redo)


@dataclass(frozen=True, slots=True)
class TorchtitanOpRecompute:
    """torchtitan 0.3.0's ``SelectiveAC``: saves every odd matmul's output (module doc)."""

    name: str = "torchtitan op policy (every second matmul)"
    tp_all_gathers_recomputed: int = 2
    recomputes_attention_core: bool = False  # SDPA's and FlexAttention's outputs are saved

    def kept_bytes_per_token(
        self,
        model: ModelSpec,
        element_bytes: int,
        *,
        saved: tuple[float, float, float],
        moe_layer: bool,
        tp: int,
        ep: int,
    ) -> tuple[float, float, float]:
        c, h = element_bytes, model.hidden
        split = whole = 0.0
        for mm, redo in marked_matmuls(model, moe_layer=moe_layer):
            if redo:
                continue
            if mm.split:
                split += c * mm.width
            else:
                whole += c * mm.width
        # The attention output and its fp32 log-sum-exp (SDPA / FlexAttention: saved).
        split += c * model.heads * model.attention_v_dim + 4 * model.heads
        sp_part = c * h  # the block's input
        if tp > 1:
            sp_part += 2 * c * h  # the reduce-scatters after attention and after the MLP
        if moe_layer:
            whole += model.topk * 12  # topk's fp32 scores and int64 indices
            if ep > 1:
                whole += 2 * model.topk * c * h  # the dispatch and combine all-to-alls
        return sp_part, split + tp * whole, 0.0

    def rebuilt_bytes_per_token(
        self, model: ModelSpec, element_bytes: int, *, moe_layer: bool
    ) -> float:
        # The element-wise outputs rebuilt: two norms, two residual adds, RoPE on q and k, the
        # activation function (and SwiGLU's product) of every MLP the token passes through.
        c = element_bytes
        ffn = model.moe_ffn_hidden if moe_layer else model.ffn_hidden
        copies = model.topk + model.shared_experts if moe_layer else 1
        act = copies * (2 if model.gated_mlp else 1) * c * ffn
        return 4 * c * model.hidden + c * (model.q_dim + model.kv_dim) + act

    def extra_forward_s(
        self, model: ModelSpec, *, matmul_s: float, attention_s: float, flash: bool
    ) -> float:
        # Attention's output is saved: only the recomputed matmuls' share of their seconds.
        return matmul_s * recomputed_share(model)

    def extra_flops_per_token(self, model: ModelSpec, seq_len: int) -> float:
        return 2.0 * sum(
            count * _recomputed_params(model, moe_layer=moe) for moe, count in _layer_kinds(model)
        )


def recomputed_share(model: ModelSpec) -> float:
    """Share of a layer's matmul FLOPs torchtitan's policy recomputes (over all layers)."""
    redone = total = 0.0
    for moe, count in _layer_kinds(model):
        redone += count * _recomputed_params(model, moe_layer=moe)
        total += count * sum(mm.params for mm in layer_matmuls(model, moe_layer=moe))
    return redone / total


def _layer_kinds(model: ModelSpec) -> list[tuple[bool, int]]:
    """(moe_layer, how many layers) of the model."""
    if not model.is_moe:
        return [(False, model.layers)]
    return [(False, model.dense_layers), (True, model.moe_layers)]


TORCHTITAN_OP_SAC = TorchtitanOpRecompute()
