"""The model the auto-planner places: a decoder-only transformer's shape, parameters and FLOPs.

A ``ModelSpec`` comes from a Hugging Face ``config.json`` (read offline from a file; families
``llama``, ``mistral``, ``mixtral``, ``qwen2``, ``gpt_neox``, ``gpt2``, ``deepseek_v3``) or from a
built-in name (``llama3-8b``, ``llama3-70b``, ``llama3-405b``, ``gpt3-175b``, ``mixtral-8x7b``,
... in ``planner/data/models.json``, stored in the same config.json form, so both take one path).

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
import difflib
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

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


# -- Hugging Face config.json -------------------------------------------------------------
def _require(config: dict, key: str, where: str, *, default: Any = ...) -> Any:
    if key in config and config[key] is not None:
        return config[key]
    if default is not ...:
        return default
    raise ValueError(
        f"{where}: missing {key!r} (model_type {config.get('model_type')!r} needs it); "
        "use the model's config.json from its Hugging Face repository"
    )


def from_hf_config(
    config: dict, *, name: str = "config.json", where: str | None = None
) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json`` mapping.

    Raises:
        ValueError: an unknown ``model_type`` (the known families listed) or a missing key
            (named, with the file).
    """
    where = where or name
    family = config.get("model_type")
    if family not in FAMILIES:
        close = difflib.get_close_matches(str(family), FAMILIES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{where}: model_type {family!r} is not supported{hint}; known: {', '.join(FAMILIES)}"
        )
    r = lambda key, default=...: _require(config, key, where, default=default)  # noqa: E731
    if family == "gpt2":
        hidden = r("n_embd")
        heads = r("n_head")
        return ModelSpec(
            name=name,
            family=family,
            layers=r("n_layer"),
            hidden=hidden,
            heads=heads,
            kv_heads=heads,
            head_dim=hidden // heads,
            ffn_hidden=r("n_inner", 4 * hidden),
            vocab_size=r("vocab_size"),
            gated_mlp=False,
            norm="layernorm",
            attention_bias=True,
            output_bias=True,
            tied_embeddings=r("tie_word_embeddings", True),
            position_embeddings=r("n_positions"),
            dropout=r("resid_pdrop", 0.1) > 0,
        )
    hidden = r("hidden_size")
    heads = r("num_attention_heads")
    common = dict(
        name=name,
        family=family,
        layers=r("num_hidden_layers"),
        hidden=hidden,
        heads=heads,
        vocab_size=r("vocab_size"),
        tied_embeddings=r("tie_word_embeddings", False),
    )
    if family == "gpt_neox":
        return ModelSpec(
            **common,
            kv_heads=heads,
            head_dim=hidden // heads,
            ffn_hidden=r("intermediate_size"),
            gated_mlp=False,
            norm="layernorm",
            attention_bias=r("attention_bias", True),
            output_bias=r("attention_bias", True),
            dropout=r("hidden_dropout", 0.0) > 0,
        )
    kv_heads = r("num_key_value_heads", heads)
    head_dim = r("head_dim", hidden // heads)
    if family == "deepseek_v3":
        return ModelSpec(
            **common,
            kv_heads=kv_heads,
            head_dim=r("qk_nope_head_dim"),
            ffn_hidden=r("intermediate_size"),
            experts=r("n_routed_experts"),
            topk=r("num_experts_per_tok"),
            moe_ffn_hidden=r("moe_intermediate_size"),
            shared_experts=r("n_shared_experts", 0),
            dense_layers=r("first_k_dense_replace", 0),
            router_bias=r("topk_method", "") == "noaux_tc",
            routing_group_limit=r("topk_group", 0) or 0,
            q_lora_rank=r("q_lora_rank", 0) or 0,
            kv_lora_rank=r("kv_lora_rank"),
            qk_rope_head_dim=r("qk_rope_head_dim"),
            v_head_dim=r("v_head_dim"),
            attention_bias=r("attention_bias", False),
        )
    moe = {}
    if family == "mixtral":
        moe = dict(
            experts=r("num_local_experts"),
            topk=r("num_experts_per_tok"),
            moe_ffn_hidden=r("intermediate_size"),
        )
    return ModelSpec(
        **common,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden=r("intermediate_size"),
        attention_bias=family == "qwen2" or r("attention_bias", False),
        dropout=r("attention_dropout", 0.0) > 0,
        **moe,
    )


def _builtin_configs() -> dict[str, dict]:
    text = resources.files("overlapkit.planner").joinpath("data/models.json").read_text("utf-8")
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def builtin_names() -> list[str]:
    """The model names ``load_model`` knows without a file."""
    return sorted(_builtin_configs())


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A built-in model by name, or a Hugging Face ``config.json`` file.

    Raises:
        ValueError: an unknown name (the nearest names suggested), a file that is not JSON, a
            config missing a field.
        FileNotFoundError: a path that does not exist.
    """
    text = str(name_or_path)
    builtins = _builtin_configs()
    if text in builtins:
        config = builtins[text]
        return from_hf_config(config, name=text, where=f"built-in model {text!r}")
    if isinstance(name_or_path, Path) or text.endswith(".json") or "/" in text:
        path = Path(text)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model config {text!r} does not exist")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: not a JSON config.json ({err})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path}: a config.json must be a JSON object")
        return from_hf_config(config, name=path.parent.name or path.stem, where=str(path))
    close = difflib.get_close_matches(text, list(builtins), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ValueError(
        f"unknown model {text!r}.{hint} Built-in: {', '.join(sorted(builtins))}; or pass a "
        "Hugging Face config.json"
    )


def gpt_spec(
    *,
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    vocab_size: int = 51200,
    seq_len: int = 2048,
    ffn_hidden: int | None = None,
    dropout: bool = True,
    experts: int = 0,
    topk: int = 0,
    expert_hidden: int = 0,
) -> ModelSpec:
    """A Megatron-LM GPT (GELU MLP of ``4 x hidden``, LayerNorm, tied embeddings, learned
    positions, dropout), as its papers' tables describe models by layers, hidden and heads;
    with ``experts``, every MLP a mixture of them (overlapkit-train's moe_tiny)."""
    config = {
        "model_type": "gpt2",
        "n_layer": layers,
        "n_embd": hidden,
        "n_head": heads,
        "n_inner": ffn_hidden,
        "n_positions": seq_len,
        "vocab_size": vocab_size,
        "resid_pdrop": 0.1 if dropout else 0.0,
    }
    spec = from_hf_config(config, name=name)
    if experts:
        spec = dataclasses.replace(spec, experts=experts, topk=topk, moe_ffn_hidden=expert_hidden)
    return spec


class TrainModelConfig(Protocol):
    """The fields of overlapkit-train's ``GPTConfig`` (and ``MoEConfig``) the planner reads."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int


def train_model_spec(config: TrainModelConfig, *, name: str) -> ModelSpec:
    """An overlapkit-train transformer (``overlapkit/train/models``) as the planner describes it.

    ``GPT``: GPT-2 shapes (separate q, k, v and output projections with biases, a GELU MLP of
    ``4 x n_embd``, LayerNorm, learned positions, the head tied to the token embedding) and no
    dropout. A config with ``n_expert`` (``MoEConfig``, moe_tiny) makes every MLP a mixture of
    that many bias-free experts of ``expert_hidden``, ``top_k`` per token.

    Example:
        >>> from overlapkit.train.models import GPTConfig
        >>> train_model_spec(GPTConfig(n_embd=128, block_size=64), name="gpt_tiny").params
        834304
    """
    experts = getattr(config, "n_expert", 0)
    return gpt_spec(
        name=name,
        layers=config.n_layer,
        hidden=config.n_embd,
        heads=config.n_head,
        vocab_size=config.vocab_size,
        seq_len=config.block_size,
        dropout=False,
        experts=experts,
        topk=getattr(config, "top_k", 0) if experts else 0,
        expert_hidden=getattr(config, "expert_hidden", 0) if experts else 0,
    )
