"""The model the auto-planner places: a decoder-only transformer's shape, parameters and FLOPs.

A ``ModelSpec`` comes from a Hugging Face ``config.json`` (read offline from a file; families
``llama``, ``mistral``, ``mixtral``, ``qwen2``, ``gpt_neox``, ``gpt2``, ``deepseek_v3``) or from a
built-in name (``llama3-8b``, ``llama3-70b``, ``llama3-405b``, ``gpt3-175b``, ``mixtral-8x7b``,
... in ``autoplan/data/models.json``, stored in the same config.json form, so both take one path;
``autoplan.models`` reads both).

**Parameters** are counted from the shapes, the way each family's modelling code builds them:
a gated MLP (SwiGLU: gate, up and down projections, ``3 x hidden x ffn``) or a plain one
(``2 x hidden x ffn`` plus biases), grouped-query attention (``kv_heads`` key/value heads),
DeepSeek's multi-head latent attention (low-rank q and kv projections), MoE layers with
``experts`` routed experts (``topk`` per token), shared experts and a router, LayerNorm (weight
and bias) or RMSNorm (weight), learned position embeddings (GPT-2), tied or separate input and
output embeddings. DeepSeek-V3's multi-token-prediction module is not counted (671B, as the
report counts the main model).

**FLOPs** (PaLM, appendix B): a token costs ``6 x N`` in forward and backward, ``N`` the
parameters that take part in a matrix multiply (routed experts: the ``topk`` active ones;
the input embedding and position tables are look-ups and do not count, a tied output head
does), plus attention's ``6 x 2 x layers x seq_len x heads x (qk_dim + v_dim)`` per token
(``12 x layers x seq_len x hidden`` for plain multi-head attention; the full square, as
Megatron-LM and PaLM count it, not the causal half).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "gpt_neox", "gpt2", "deepseek_v3")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer's shape (see the module doc for how it is counted).

    Raises:
        ValueError: a size that is not a positive integer or does not divide as it must,
            naming the field.
    """

    name: str
    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    """Intermediate size of a dense MLP."""
    vocab_size: int
    gated_mlp: bool = True
    """SwiGLU (gate, up, down) rather than GELU (fc1, fc2)."""
    norm: str = "rmsnorm"
    """``rmsnorm`` (a weight) or ``layernorm`` (weight and bias)."""
    attention_bias: bool = False
    """Biases on q, k and v (qwen2) or on all four projections (gpt2, gpt_neox)."""
    output_bias: bool = False
    """Bias on the attention output projection and the MLP's linear layers (gpt2, gpt_neox)."""
    tied_embeddings: bool = False
    position_embeddings: int = 0
    """Learned positions (GPT-2's ``n_positions``); 0 for rotary."""
    dropout: bool = False
    """Whether training applies dropout (masks are stored for backward)."""
    experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    topk: int = 0
    moe_ffn_hidden: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    """Leading layers with a dense MLP in a MoE model (DeepSeek's ``first_k_dense_replace``)."""
    router_bias: bool = False
    """A per-expert score-correction bias (DeepSeek-V3)."""
    routing_group_limit: int = 0
    """Device-limited routing (DeepSeek's ``topk_group``): a token's experts lie in at most
    this many expert groups (nodes), so dispatch sends it over the network at most this many
    times (0: no limit)."""
    q_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek): rank of the q projection (0: no MLA)."""
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab_size"):
            _positive(self, field)
        if self.family not in FAMILIES:
            raise ValueError(f"model {self.name!r}: family {self.family!r}; known: {FAMILIES}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model {self.name!r}: num_attention_heads ({self.heads}) must be a multiple of "
                f"num_key_value_heads ({self.kv_heads})"
            )
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"model {self.name!r}: norm must be rmsnorm or layernorm")
        if self.experts:
            for field in ("topk", "moe_ffn_hidden"):
                _positive(self, field)
            if self.topk > self.experts:
                raise ValueError(
                    f"model {self.name!r}: num_experts_per_tok ({self.topk}) exceeds the "
                    f"{self.experts} experts"
                )
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"model {self.name!r}: dense_layers must be in [0, layers]")
        if not self.experts or self.dense_layers:
            _positive(self, "ffn_hidden")

    # -- shapes ---------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def dispatch_copies(self) -> int:
        """Copies of a token the expert all-to-all sends (device-limited routing dedups them
        per destination group, as DeepSeek's DeepEP does over the network)."""
        if self.routing_group_limit:
            return min(self.topk, self.routing_group_limit)
        return self.topk

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.is_moe else 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Per-head q and k width (MLA: the no-rope part plus the rope part)."""
        return self.head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def attention_v_dim(self) -> int:
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def q_dim(self) -> int:
        return self.heads * self.qk_head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the k (and of the v) activations (GQA: ``kv_heads x head_dim``)."""
        return (self.heads if self.mla else self.kv_heads) * self.qk_head_dim

    @property
    def v_dim(self) -> int:
        return (self.heads if self.mla else self.kv_heads) * self.attention_v_dim

    # -- parameters -----------------------------------------------------------------------
    def _norm_params(self, width: int) -> int:
        return 2 * width if self.norm == "layernorm" else width

    def _linear(self, inputs: int, outputs: int, bias: bool) -> int:
        return inputs * outputs + (outputs if bias else 0)

    def attention_params(self) -> int:
        """One layer's attention projections (and MLA's norms)."""
        h = self.hidden
        if self.mla:
            rope = self.qk_rope_head_dim
            q = (
                h * self.q_lora_rank
                + self.q_lora_rank
                + self.q_lora_rank * self.heads * self.qk_head_dim
                if self.q_lora_rank
                else h * self.heads * self.qk_head_dim
            )
            kv = (
                h * (self.kv_lora_rank + rope)
                + self.kv_lora_rank
                + self.kv_lora_rank * self.heads * (self.head_dim + self.v_head_dim)
            )
            return q + kv + self.heads * self.v_head_dim * h
        qkv_bias = self.attention_bias
        return (
            self._linear(h, self.q_dim, qkv_bias)
            + 2 * self._linear(h, self.kv_heads * self.head_dim, qkv_bias)
            + self._linear(self.heads * self.head_dim, h, self.output_bias)
        )

    def mlp_params(self, ffn: int, *, expert: bool = False) -> int:
        """One MLP of intermediate size ``ffn``; an ``expert``'s has no biases."""
        h = self.hidden
        if self.gated_mlp:
            return 3 * h * ffn
        bias = self.output_bias and not expert
        return self._linear(h, ffn, bias) + self._linear(ffn, h, bias)

    @property
    def expert_mlp_params(self) -> int:
        """One routed (or shared) expert."""
        return self.mlp_params(self.moe_ffn_hidden, expert=True)

    def router_params(self) -> int:
        return self.hidden * self.experts + (self.experts if self.router_bias else 0)

    def expert_params_per_layer(self) -> int:
        """Routed experts of one MoE layer (what expert parallelism shards)."""
        return self.experts * self.expert_mlp_params

    def dense_params_per_layer(self, *, moe_layer: bool) -> int:
        """One layer's parameters outside the routed experts."""
        norms = 2 * self._norm_params(self.hidden)
        if not moe_layer:
            return norms + self.attention_params() + self.mlp_params(self.ffn_hidden)
        shared = self.shared_experts * self.expert_mlp_params
        return norms + self.attention_params() + shared + self.router_params()

    def embedding_params(self) -> int:
        """Input embedding table and learned positions."""
        return (self.vocab_size + self.position_embeddings) * self.hidden

    def head_params(self) -> int:
        """Final norm and (untied) output projection."""
        untied = 0 if self.tied_embeddings else self.vocab_size * self.hidden
        return self._norm_params(self.hidden) + untied

    # -- parameter tensors ----------------------------------------------------------------
    def layer_tensors(self, *, moe_layer: bool) -> tuple[int, int, int]:
        """(split, other, expert) parameter tensors of one layer, as torchtitan and
        overlapkit-train build them: separate ``q``, ``k``, ``v`` and output projections and
        the MLP's linear layers with their biases (what tensor parallelism splits, shared
        experts included); the norms and the router (``other``); the routed experts stacked in
        one tensor per projection (``expert``). Where the host steps the optimizer tensor by
        tensor, each costs it the same, whatever its size."""
        other = 2 * (2 if self.norm == "layernorm" else 1)
        if self.mla:
            split = (3 if self.q_lora_rank else 1) + 4  # q (low-rank: a, norm, b); kv a, norm, b; o
        else:
            split = 4 + (3 if self.attention_bias else 0) + (1 if self.output_bias else 0)
        mlp = 3 if self.gated_mlp else (2 + (2 if self.output_bias else 0))
        if not moe_layer:
            return split + mlp, other, 0
        other += 2 if self.router_bias else 1
        if self.shared_experts:
            split += 3 if self.gated_mlp else 2
        return split, other, 3 if self.gated_mlp else 2

    def row_parallel_biases(self, *, moe_layer: bool) -> int:
        """The biases of one layer's row-parallel linears (attention's output projection, a
        dense MLP's second layer), counted among ``layer_tensors``' split ones."""
        if not self.output_bias:
            return 0
        return 1 + (0 if moe_layer or self.gated_mlp else 1)

    def embedding_tensors(self) -> int:
        """The token embedding and the learned positions."""
        return 1 + (1 if self.position_embeddings else 0)

    def head_tensors(self) -> int:
        """The final norm and the (untied) output projection."""
        return (2 if self.norm == "layernorm" else 1) + (0 if self.tied_embeddings else 1)

    def layer_params(self, index: int) -> tuple[int, int]:
        """(dense, expert) parameters of layer ``index`` (0-based)."""
        moe = self.is_moe and index >= self.dense_layers
        expert = self.expert_params_per_layer() if moe else 0
        return self.dense_params_per_layer(moe_layer=moe), expert

    @property
    def params(self) -> int:
        """Every parameter (count)."""
        return _total_params(self)

    @property
    def expert_params(self) -> int:
        """Parameters in routed experts (count)."""
        return self.moe_layers * self.expert_params_per_layer()

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (routed experts: ``topk`` of them)."""
        inactive = self.moe_layers * (self.experts - self.topk) * self.expert_mlp_params
        return self.params - inactive

    # -- FLOPs ----------------------------------------------------------------------------
    def matmul_params(self) -> int:
        """Active parameters that take part in a matrix multiply (see module doc)."""
        lookup = self.position_embeddings * self.hidden
        if not self.tied_embeddings:
            lookup += self.vocab_size * self.hidden
        return self.active_params - lookup

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs of ``softmax(QK^T)V`` per token, all layers (the full square)."""
        return 2.0 * self.layers * seq_len * self.heads * (self.qk_head_dim + self.attention_v_dim)

    def model_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs per token, no recomputation: ``6N`` + attention (PaLM)."""
        return 6.0 * self.matmul_params() + 3.0 * self.attention_flops_per_token(seq_len)

    def describe(self) -> str:
        kind = (
            f"MoE {self.experts} experts top-{self.topk}, {self.active_params / 1e9:.3g}B active"
            if self.is_moe
            else "dense"
        )
        return (
            f"{self.name}: {self.params / 1e9:.4g}B parameters ({kind}), {self.layers} layers x "
            f"hidden {self.hidden}, {self.heads} heads ({self.kv_heads} kv), "
            f"vocab {self.vocab_size}"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {
            "params": self.params,
            "active_params": self.active_params,
        }


@lru_cache(maxsize=256)
def _total_params(spec: ModelSpec) -> int:
    # The search asks for it per layout; the spec is immutable.
    dense = spec.dense_layers if spec.is_moe else spec.layers
    layers = dense * spec.dense_params_per_layer(moe_layer=False) + spec.moe_layers * (
        spec.dense_params_per_layer(moe_layer=True) + spec.expert_params_per_layer()
    )
    return layers + spec.embedding_params() + spec.head_params()


def _positive(spec: ModelSpec, field: str) -> None:
    value = getattr(spec, field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model {spec.name!r}: {field} must be an integer >= 1, got {value!r}")
