"""Where a ``ModelSpec`` comes from: a Hugging Face ``config.json``, a built-in name, a
Megatron-LM GPT described by its shape, or an overlapkit-train model config.

``from_hf_config`` reads the families ``model_spec.FAMILIES`` lists, field by field as each
family's modelling code does; the built-in names (``autoplan/data/models.json``) are stored in the
same config.json form, so both take one path (``load_model``). ``load_model`` also takes a
Megatron-LM GPT by its shape, as papers' tables give it (``GPT_SPEC``:
``gpt:layers=24,hidden=2304,heads=24``, what ``--model`` and ``ok.plan(model=)`` accept).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from overlapkit.autoplan.model_spec import FAMILIES, ModelSpec

GPT_PREFIX = "gpt:"
GPT_SPEC = "gpt:layers=..,hidden=..,heads=..[,vocab=..,seq=..,ffn=..,experts=..,topk=..]"
"""A Megatron-LM GPT by its shape (``gpt_spec``): ``vocab`` 51200, ``seq`` (learned positions)
the run's sequence length, ``ffn`` 4 x hidden; ``experts`` with ``topk``: every MLP a mixture of
that many experts of ``ffn``."""
GPT_FIELDS = {
    "layers": "layers",
    "hidden": "hidden",
    "heads": "heads",
    "vocab": "vocab_size",
    "seq": "seq_len",
    "ffn": "ffn_hidden",
    "experts": "experts",
    "topk": "topk",
}
"""``gpt:`` keys -> ``gpt_spec`` arguments."""
DEFAULT_GPT_SEQ_LEN = 2048


def _require(config: dict, key: str, where: str, *, default: Any = ...) -> Any:
    if key in config and config[key] is not None:
        return config[key]
    if default is not ...:
        return default
    raise ValueError(
        f"{where}: missing {key!r} (model_type {config.get('model_type')!r} needs it); "
        "use the model's config.json from its Hugging Face repository"
    )


class _ConfigFields:
    """Reads a ``config.json`` mapping field by field: ``fields(key)`` is the value (ValueError
    naming the key and ``where`` when missing or null), ``fields(key, default)`` the value or
    ``default``."""

    def __init__(self, config: dict, where: str) -> None:
        self.config = config
        self.where = where

    def __call__(self, key: str, default: Any = ...) -> Any:
        return _require(self.config, key, self.where, default=default)


def from_hf_config(
    config: dict, *, name: str = "config.json", where: str | None = None
) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json`` mapping, read as the family's
    modelling code reads it.

    Args:
        config (dict): the ``config.json`` mapping; its ``model_type`` is one of ``FAMILIES``.
        name (str): the spec's name. Defaults to ``"config.json"``.
        where (str | None): what errors name (the file). Defaults to ``name``.

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
    fields = _ConfigFields(config, where)
    if family == "gpt2":
        return _gpt2(fields, name)
    hidden, heads = fields("hidden_size"), fields("num_attention_heads")
    common = dict(
        name=name,
        family=family,
        layers=fields("num_hidden_layers"),
        hidden=hidden,
        heads=heads,
        vocab_size=fields("vocab_size"),
        tied_embeddings=fields("tie_word_embeddings", False),
    )
    if family == "gpt_neox":
        return _gpt_neox(fields, common)
    if family == "deepseek_v3":
        return _deepseek_v3(fields, common)
    return _llama_like(fields, common)


def _gpt2(fields: _ConfigFields, name: str) -> ModelSpec:
    """GPT-2 (``transformers``' ``GPT2Config`` names: ``n_embd``, ``n_head``, ...)."""
    hidden = fields("n_embd")
    heads = fields("n_head")
    return ModelSpec(
        name=name,
        family="gpt2",
        layers=fields("n_layer"),
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        head_dim=hidden // heads,
        ffn_hidden=fields("n_inner", 4 * hidden),
        vocab_size=fields("vocab_size"),
        gated_mlp=False,
        norm="layernorm",
        attention_bias=True,
        output_bias=True,
        tied_embeddings=fields("tie_word_embeddings", True),
        position_embeddings=fields("n_positions"),
        dropout=fields("resid_pdrop", 0.1) > 0,
    )


def _gpt_neox(fields: _ConfigFields, common: dict[str, Any]) -> ModelSpec:
    """GPT-NeoX (Pythia): full multi-head attention, a plain MLP, LayerNorm."""
    return ModelSpec(
        **common,
        kv_heads=common["heads"],
        head_dim=common["hidden"] // common["heads"],
        ffn_hidden=fields("intermediate_size"),
        gated_mlp=False,
        norm="layernorm",
        attention_bias=fields("attention_bias", True),
        output_bias=fields("attention_bias", True),
        dropout=fields("hidden_dropout", 0.0) > 0,
    )


def _deepseek_v3(fields: _ConfigFields, common: dict[str, Any]) -> ModelSpec:
    """DeepSeek-V3: multi-head latent attention, shared and routed experts after the first
    dense layers, group-limited routing."""
    return ModelSpec(
        **common,
        kv_heads=fields("num_key_value_heads", common["heads"]),
        head_dim=fields("qk_nope_head_dim"),
        ffn_hidden=fields("intermediate_size"),
        experts=fields("n_routed_experts"),
        topk=fields("num_experts_per_tok"),
        moe_ffn_hidden=fields("moe_intermediate_size"),
        shared_experts=fields("n_shared_experts", 0),
        dense_layers=fields("first_k_dense_replace", 0),
        router_bias=fields("topk_method", "") == "noaux_tc",
        routing_group_limit=fields("topk_group", 0) or 0,
        q_lora_rank=fields("q_lora_rank", 0) or 0,
        kv_lora_rank=fields("kv_lora_rank"),
        qk_rope_head_dim=fields("qk_rope_head_dim"),
        v_head_dim=fields("v_head_dim"),
        attention_bias=fields("attention_bias", False),
    )


def _llama_like(fields: _ConfigFields, common: dict[str, Any]) -> ModelSpec:
    """Llama, Mistral, Qwen2 and Mixtral (whose every MLP is a mixture of experts): grouped-query
    attention, a gated MLP, RMSNorm."""
    family = common["family"]
    moe = {}
    if family == "mixtral":
        moe = dict(
            experts=fields("num_local_experts"),
            topk=fields("num_experts_per_tok"),
            moe_ffn_hidden=fields("intermediate_size"),
        )
    return ModelSpec(
        **common,
        kv_heads=fields("num_key_value_heads", common["heads"]),
        head_dim=fields("head_dim", common["hidden"] // common["heads"]),
        ffn_hidden=fields("intermediate_size"),
        attention_bias=family == "qwen2" or fields("attention_bias", False),
        dropout=fields("attention_dropout", 0.0) > 0,
        **moe,
    )


def _builtin_configs() -> dict[str, dict]:
    text = resources.files("overlapkit.autoplan").joinpath("data/models.json").read_text("utf-8")
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def builtin_names() -> list[str]:
    """The model names ``load_model`` knows without a file."""
    return sorted(_builtin_configs())


def load_model(name_or_path: str | Path, *, seq_len: int | None = None) -> ModelSpec:
    """A built-in model by name, a Hugging Face ``config.json`` file or a ``gpt:`` shape.

    Args:
        name_or_path (str | Path): ``"llama3-8b"``, ``"path/config.json"`` or
            ``"gpt:layers=24,hidden=2304,heads=24"`` (``GPT_SPEC``).
        seq_len (int): a ``gpt:`` shape without ``seq=`` gets learned positions for this many
            tokens (the run's sequence length); 2048 when None. Other models ignore it.

    Raises:
        ValueError: an unknown name (the nearest names suggested), a file that is not JSON, a
            config missing a field, a bad ``gpt:`` shape (the field named).
        FileNotFoundError: a path that does not exist.
    """
    text = str(name_or_path)
    if text.startswith(GPT_PREFIX):
        return gpt_from_text(text, seq_len=seq_len or DEFAULT_GPT_SEQ_LEN)
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
        f"Hugging Face config.json, or a Megatron GPT as {GPT_SPEC}"
    )


def gpt_from_text(text: str, *, seq_len: int = DEFAULT_GPT_SEQ_LEN) -> ModelSpec:
    """The Megatron GPT ``text`` describes (``GPT_SPEC``), named ``text``.

    Raises:
        ValueError: an unknown or repeated key, a value that is not an integer >= 1, a missing
            ``layers`` / ``hidden`` / ``heads``, ``hidden`` not a multiple of ``heads``,
            ``experts`` without ``topk`` (or the reverse), naming it.
    """
    where = f"model {text!r}"
    values: dict[str, int] = {}
    for item in text.removeprefix(GPT_PREFIX).split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in GPT_FIELDS:
            raise ValueError(f"{where}: {item.strip()!r} is not one of {GPT_SPEC}")
        if key in values:
            raise ValueError(f"{where}: {key}= is given twice")
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number < 1:
            raise ValueError(f"{where}: {key} must be an integer >= 1, got {value.strip()!r}")
        values[key] = number
    missing = [k for k in ("layers", "hidden", "heads") if k not in values]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(f'{k}=' for k in missing)} ({GPT_SPEC})")
    if values["hidden"] % values["heads"]:
        raise ValueError(
            f"{where}: hidden ({values['hidden']}) must be a multiple of heads ({values['heads']})"
        )
    if ("experts" in values) != ("topk" in values):
        raise ValueError(f"{where}: experts= and topk= go together")
    args = {GPT_FIELDS[k]: v for k, v in values.items()}
    args.setdefault("seq_len", seq_len)
    if "experts" in args:
        args["expert_hidden"] = args.get("ffn_hidden") or 4 * args["hidden"]
    return gpt_spec(name=text, **args)


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
