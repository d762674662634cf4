"""autoplan.memory: Korthikanti's activation equations, ZeRO's state bytes, the pipeline's peak."""

import pytest

from overlapkit.autoplan.memory import (
    BF16,
    in_flight_micro_batches,
    layer_activation_bytes,
    memory_breakdown,
    model_state_bytes,
    stage_params,
)
from overlapkit.autoplan.models import gpt_spec, load_model
from overlapkit.layout import TrainingLayout

# Korthikanti et al.'s GPT: 16-bit activations, dropout, no flash attention.
S, B, H, A = 2048, 1, 12288, 96
GPT = gpt_spec(name="gpt-175b", layers=96, hidden=H, heads=A)


def _bytes(tp=1, recompute="none", flash=False, **kw):
    layout = TrainingLayout(tp=tp, dp=1, micro_batch=B, recompute=recompute, **kw)
    return layer_activation_bytes(
        GPT, layout, BF16, seq_len=S, flash_attention=flash, moe_layer=False
    )


def test_activations_without_parallelism_are_34_plus_5as_over_h():
    assert _bytes() == pytest.approx(S * B * H * (34 + 5 * A * S / H))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_and_sequence_parallel_divide_every_activation_by_t(tp):
    # Korthikanti eq. 5: sbh (34/t + 5as/(ht)).
    assert _bytes(tp=tp) == pytest.approx(S * B * H * (34 + 5 * A * S / H) / tp)


def test_selective_recompute_drops_the_attention_core_of_gpt():
    # Korthikanti section 5: sbh x 34/t (GPT's GELU MLP loses fc1's activation copy too: our
    # selective also rebuilds the activation function's output, 2 x 4h bytes per token).
    assert _bytes(tp=8, recompute="selective") == pytest.approx(S * B * H * (34 - 8) / 8)


def test_full_recompute_keeps_each_layer_input_only():
    assert _bytes(tp=8, recompute="full") == pytest.approx(2 * S * B * H / 8)


def test_flash_attention_stores_no_attention_scores():
    assert _bytes(tp=8, flash=True) < _bytes(tp=8) and _bytes(tp=8, flash=True) == pytest.approx(
        S * B * H * 34 / 8 + S * B * 4 * A / 8
    )


def _state_per_param(sharding, dp, **kw):
    model = load_model("llama3-8b")
    layout = TrainingLayout(dp=dp, sharding=sharding, **kw)
    params = stage_params(model, layout, stage=0)
    return sum(model_state_bytes(params, layout, BF16)) / params.dense


@pytest.mark.parametrize(
    ("sharding", "bytes_per_param"),
    [("ddp", 18), ("zero1", 6 + 12 / 8), ("zero2", 2 + 16 / 8), ("fsdp", 16 / 8)],
)
def test_model_state_bytes_follow_zero_stages(sharding, bytes_per_param):
    assert _state_per_param(sharding, 8) == pytest.approx(bytes_per_param)


def test_hsdp_shards_over_the_shard_group_only():
    assert _state_per_param("hsdp", 8, dp_shard=2) == pytest.approx(16 / 2)


def test_tensor_and_pipeline_parallel_split_the_parameters():
    model = load_model("llama3-70b")
    whole = stage_params(model, TrainingLayout(), stage=0).dense
    part = stage_params(model, TrainingLayout(tp=8, pp=4, dp=1), stage=1).dense
    assert part == pytest.approx(whole / 32, rel=0.05)  # middle stage: no embedding or head


def test_expert_parallel_splits_only_the_experts():
    model = load_model("mixtral-8x7b")
    one = stage_params(model, TrainingLayout(), stage=0)
    eight = stage_params(model, TrainingLayout(ep=8), stage=0)
    assert eight.expert == pytest.approx(one.expert / 8) and eight.dense == one.dense


def test_1f1b_first_stage_holds_pp_micro_batches_and_interleaving_more():
    assert in_flight_micro_batches(TrainingLayout(pp=8, num_micro_batches=32)) == 8
    assert in_flight_micro_batches(TrainingLayout(pp=8, num_micro_batches=4)) == 4
    interleaved = TrainingLayout(pp=8, num_micro_batches=32, virtual_stages=2)
    assert in_flight_micro_batches(interleaved) == pytest.approx(8 * (1 + 7 / 16))


def test_recomputing_more_layers_never_needs_more_memory():
    model = load_model("llama3-70b")
    totals = [
        memory_breakdown(
            model,
            TrainingLayout(tp=8, pp=4, dp=1, num_micro_batches=8, recompute="full", **kw),
            seq_len=8192,
        ).total
        for kw in ({"recompute_layers": 1}, {"recompute_layers": 10}, {})
    ]
    assert totals == sorted(totals, reverse=True)
