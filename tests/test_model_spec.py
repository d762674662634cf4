"""autoplan.model_spec: parameter counts against the published ones, FLOPs, config.json errors."""

import json
from pathlib import Path

import pytest

from overlapkit.autoplan.models import builtin_names, gpt_spec, load_model, train_model_spec
from overlapkit.train.models import GPT, GPTConfig, MoEConfig, MoEGPT

FIXTURES = Path(__file__).parent / "fixtures" / "hf_configs"


@pytest.mark.parametrize(
    ("name", "published", "tolerance"),
    [
        # Meta's model cards: 8.03B, 70.6B, 405.9B (rounded to the digits they print).
        ("llama3-8b", 8.03e9, 0.005e9),
        ("llama3-70b", 70.6e9, 0.05e9),
        ("llama3-405b", 405.9e9, 0.05e9),
        # GPT-3 paper Table 2.1 prints 175.0B; biases, LayerNorms and the 50,257-token
        # embedding are not in its 12 l h^2 estimate.
        ("gpt3-175b", 175.0e9, 0.5e9),
        # Mistral's Mixtral announcement: 46.7B total, 12.9B active per token.
        ("mixtral-8x7b", 46.7e9, 0.05e9),
        # DeepSeek-V3 report: 671B total (the MTP module is not counted), 37B activated.
        ("deepseek-v3", 671e9, 0.5e9),
    ],
)
def test_builtin_models_have_their_published_parameter_counts(name, published, tolerance):
    assert abs(load_model(name).params - published) <= tolerance


def test_moe_models_count_only_the_routed_experts_a_token_uses_as_active():
    assert abs(load_model("mixtral-8x7b").active_params - 12.9e9) <= 0.05e9
    assert abs(load_model("deepseek-v3").active_params - 37e9) <= 0.6e9


@pytest.mark.parametrize(
    ("fixture", "exact"),
    [
        # safetensors totals of the public checkpoints (Hugging Face model pages).
        ("llama3-8b.json", 8_030_261_248),
        ("mistral-7b.json", 7_241_732_096),
        ("qwen2-7b.json", 7_615_616_512),
        ("gpt2.json", 124_439_808),
        # Pythia paper, Table 1 (total parameters of Pythia-6.9B).
        ("pythia-6.9b.json", 6_857_302_016),
        ("mixtral-8x7b.json", 46_702_792_704),
    ],
)
def test_hf_config_families_count_parameters_exactly(fixture, exact):
    assert load_model(FIXTURES / fixture).params == exact


def test_deepseek_v3_config_reads_latent_attention_and_limited_routing():
    model = load_model(FIXTURES / "deepseek-v3.json")
    assert model.mla and model.qk_head_dim == 192 and model.attention_v_dim == 128
    assert model.dense_layers == 3 and model.moe_layers == 58
    assert model.dispatch_copies == 4  # topk 8 limited to 4 node groups
    assert abs(model.params - 671e9) <= 0.5e9


def test_gated_and_plain_mlps_are_counted_differently():
    plain = load_model(FIXTURES / "gpt2.json")
    assert plain.mlp_params(3072) == 2 * 768 * 3072 + 3072 + 768
    assert load_model("llama3-8b").mlp_params(14336) == 3 * 4096 * 14336


def test_model_flops_match_megatron_formula_for_gpt():
    """Narayanan et al. eq. 3 without recomputation: 72 B s l h^2 (1 + s/6h + V/12lh)."""
    s, layers, h, vocab = 2048, 96, 12288, 51200
    model = gpt_spec(name="175b", layers=layers, hidden=h, heads=96, vocab_size=vocab)
    megatron = 72 * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * layers * h)) / s
    # Biases and LayerNorms (13 h per layer) are the only difference: < 0.1 %.
    assert model.model_flops_per_token(s) == pytest.approx(megatron, rel=1e-3)


def test_config_missing_a_field_is_refused_naming_it(tmp_path):
    config = json.loads((FIXTURES / "llama3-8b.json").read_text())
    del config["intermediate_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: missing 'intermediate_size'"):
        load_model(path)


def test_unknown_model_type_lists_the_supported_families(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama4"}))
    with pytest.raises(ValueError, match=r"model_type 'llama4' is not supported.*mixtral"):
        load_model(path)


def test_unknown_builtin_name_suggests_the_nearest():
    with pytest.raises(ValueError, match=r"unknown model 'llama3-7b'.*Did you mean.*llama3-8b"):
        load_model("llama3-7b")
    assert "llama3-405b" in builtin_names()


def test_missing_config_file_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope" / "config.json")


@pytest.mark.parametrize(
    ("model", "config"),
    [
        (GPT, GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)),
        (
            MoEGPT,
            MoEConfig(
                vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128, n_expert=4,
                top_k=2, expert_hidden=256,
            ),
        ),
    ],
)  # fmt: skip
def test_train_model_spec_counts_the_real_modules_parameters(model, config):
    spec = train_model_spec(config, name="tiny")
    real = model(config)
    # Tied weights (the head is the token embedding) are one parameter, counted once.
    assert spec.params == sum(p.numel() for p in real.parameters())
    assert spec.is_moe == isinstance(real, MoEGPT)
