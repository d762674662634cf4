"""The step model's terms that make small layers slower (autoplan.gemm, autoplan.compute,
autoplan.memory_traffic), each against its formula and the published measurement it cites."""

import dataclasses

import pytest

from overlapkit.autoplan.compute import (
    MEMORY_BANDWIDTH_FRACTION,
    achievable_bandwidth,
    gemm_rates,
    matmul_fraction,
)
from overlapkit.autoplan.gemm import (
    GemmRates,
    gemm_seconds,
    tile_efficiency,
    tile_k_overhead,
    unfused_attention_seconds,
)
from overlapkit.autoplan.memory import (
    BF16,
    activation_bytes_per_token,
    layer_activation_bytes,
)
from overlapkit.autoplan.memory_traffic import (
    TRAFFIC_PASSES,
    attention_core_bytes,
    layer_memory_seconds,
    loss_bytes,
)
from overlapkit.autoplan.models import gpt_spec
from overlapkit.autoplan.selective import ATTENTION_CORE
from overlapkit.layout import TrainingLayout
from overlapkit.topology import load_topology

A100 = load_topology("dgx-a100").accelerator
H100 = load_topology("dgx-h100").accelerator
GPT = gpt_spec(name="gpt-1.7b", layers=24, hidden=2304, heads=24)


def _tflops(rates: GemmRates, m: int, k: int, n: int, batch: int = 1) -> float:
    return 2 * batch * m * k * n / gemm_seconds(m, k, n, rates, batch=batch) / 1e12


def test_tile_fixed_cost_is_a_stage_of_operands_and_the_outputs_at_the_machine_balance():
    # (128 x 256 + (128 + 256) x 64) x 2 bytes per tile over its 2 x 128 x 256 FLOPs per unit
    # of K is 1.75; times A100's 312 TFLOP/s over 0.88 x 2039 GB/s: 304 units of K.
    assert tile_k_overhead(312e12, 0.88 * 2039e9, 2) == pytest.approx(1.75 * 312 / (0.88 * 2.039))
    assert gemm_rates(A100, "bf16", 0.8).k_overhead == pytest.approx(304.3, abs=0.1)
    # Hopper's persistent, warp-specialised kernels overlap it with other tiles: none there.
    assert gemm_rates(H100, "bf16", 0.8).k_overhead == 0.0


def test_tile_efficiency_is_k_over_k_plus_overhead_capped_by_the_best_matmul():
    best = matmul_fraction(A100)
    assert tile_efficiency(256, 304.0, best) == pytest.approx(256 / 560 / best)
    assert tile_efficiency(4096, 304.0, best) == 1.0  # the measured best matmul caps it
    assert tile_efficiency(96, 0.0, best) == 1.0


def test_tile_cost_reproduces_the_measured_a100_attention_products():
    # EleutherAI cookbook, benchmarks/sizing/sample_results/transformer.out (an A100: its
    # GEMMs run at 235-255 TFLOP/s of 312): qkv_transform (4 x 2048 tokens, 4096 -> 12288)
    # 241.616 TFLOP/s; attention_score (64 heads, 2048 x 256 by 256 x 2048) 130.182;
    # attention_over_value (64 heads, 2048 x 2048 by 2048 x 256) 218.952.
    rates = gemm_rates(A100, "bf16", matmul_fraction(A100))
    qkv = _tflops(rates, 8192, 4096, 12288)
    scores = _tflops(rates, 2048, 256, 2048, batch=64)
    values = _tflops(rates, 2048, 2048, 256, batch=64)
    assert scores / qkv == pytest.approx(130.182 / 241.616, abs=0.03)
    assert values / qkv == pytest.approx(218.952 / 241.616, abs=0.07)
    # Control: waves and the memory roofline alone run the scores as fast as the qkv GEMM,
    # 1.9 times the measurement.
    untiled = dataclasses.replace(rates, k_overhead=0.0)
    assert _tflops(untiled, 2048, 256, 2048, batch=64) / _tflops(untiled, 8192, 4096, 12288) > 0.95


def test_attention_backward_products_are_the_four_of_their_own_shapes():
    rates = GemmRates(flops_per_s=1e14)  # compute-bound, no tiles: FLOPs only
    forward, backward = unfused_attention_seconds(GPT, 2, 2048, tp=1, cp=1, rates=rates)
    flops = 2 * 2 * 24 * 2048 * 2048 * 96  # per product: micro-batch x heads x s x s x d, x2
    assert forward == pytest.approx(2 * flops / 1e14)
    assert backward == pytest.approx(4 * flops / 1e14)
    # With the tile cost, only dP = dO V^T of the four has the head dimension as its K.
    tiled = gemm_rates(A100, "bf16", matmul_fraction(A100))
    slow_f, slow_b = unfused_attention_seconds(GPT, 2, 2048, tp=1, cp=1, rates=tiled)
    scores = gemm_seconds(2048, 96, 2048, tiled, batch=48)
    assert slow_b < 2 * slow_f
    assert slow_b == pytest.approx(scores + 3 * (slow_f - scores), rel=0.05)


def test_memory_bound_kernels_run_at_the_measured_share_of_the_datasheet_bandwidth():
    # NVIDIA developer forums, topic 339083: 1.80 of 2.04 TB/s on an A100 SXM4 80GB (88 %).
    assert abs(MEMORY_BANDWIDTH_FRACTION - 1.80 / 2.04) < 0.005
    assert achievable_bandwidth(A100) == pytest.approx(1.80e12, rel=0.01)
    assert gemm_rates(A100, "bf16", 0.8).bytes_per_s == achievable_bandwidth(A100)


def test_attention_core_traffic_is_counted_kernel_by_kernel():
    # Forward: softmax reads the scores and writes (2 + 2), dropout reads, writes and writes a
    # one-byte mask (2 + 2 + 1); backward: dropout (2 + 1 + 2), softmax (2 + 2 + 2).
    assert attention_core_bytes(BF16, dropout=True) == (9, 11)
    assert attention_core_bytes(BF16, dropout=False) == (4, 6)


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_layer_memory_time_streams_the_saved_activations_and_the_core_per_kernel(recompute):
    layout = TrainingLayout(micro_batch=2, recompute=recompute)
    tokens, bandwidth = 2 * 2048, 1e12
    fwd, bwd = layer_memory_seconds(
        GPT,
        layout,
        BF16,
        seq_len=2048,
        flash_attention=False,
        recomputed=1.0 if recompute == "full" else 0.0,
        selective=ATTENTION_CORE,
        bytes_per_s=bandwidth,
    )
    saved = layer_activation_bytes(
        GPT, layout, BF16, seq_len=2048, flash_attention=False, moe_layer=False, recompute="none"
    )
    *_, core = activation_bytes_per_token(
        GPT, BF16, seq_len=2048, flash_attention=False, moe_layer=False
    )
    assert core == 24 * 2048 * 5  # Korthikanti's 5as per token
    passes = TRAFFIC_PASSES + (recompute == "full")
    streamed = passes * (saved - tokens * core)
    if recompute == "selective":  # the GELU output rebuilt from the kept fc1 output
        streamed += 2 * tokens * 2 * 4 * 2304
    scores = tokens * 24 * 2048
    again = 0 if recompute == "none" else 9  # full and selective both rerun the core's forward
    assert fwd * bandwidth == pytest.approx(streamed / 3 + 9 * scores)
    assert (fwd + bwd) * bandwidth == pytest.approx(streamed + (9 + 11 + again) * scores)


def test_loss_moves_fifty_two_bytes_per_logit_in_bf16():
    # Forward: cast to FP32 (2 + 4), max (4), subtract (4 + 4), exp (4 + 4), sum (4), divide
    # (4 + 4); backward: scale (4 + 4), cast back (4 + 2).
    assert loss_bytes(BF16) == (38, 14)
