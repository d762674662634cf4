"""A transformer layer's matrix multiplies on one GPU: wave quantization and the tiles' fixed cost.

A GPU runs a matrix multiply as ``128 x 256`` output tiles (the tile cuBLAS uses for large BF16
GEMMs on A100 and H100) spread over its SMs in waves. Two losses grow as the GEMM shrinks:

- **Tile and wave quantization** (NVIDIA, "Matrix Multiplication Background User's Guide"):
  a partial tile computes padding, and the last wave is partly empty when the tile count is not
  a multiple of the SM count. ``wave_efficiency`` is the share of the waves' tiles that do work,
  the better of the two orientations. Splitting a layer over ``tp`` GPUs shrinks each GPU's
  GEMMs: one reason small layers at tp = 8 reach a lower share of peak than large ones
  (Korthikanti et al.'s 22B model at 41.5 % MFU against 56.3 % for 1T).
- **The tile's fixed cost** (``tile_efficiency``). Where the GEMM kernels run one tile per
  thread block, the tile fills its operand pipeline, loops over K, then writes its outputs, in
  turn (CUTLASS, "Efficient GEMM in CUDA": the epilogue is a separate phase after the
  mainloop), so every tile pays its first pipeline stage's loads and its output's store on top
  of the K loop, ``k_overhead`` in units of K (``tile_k_overhead``). A GEMM of inner dimension
  ``K`` keeps ``K / (K + k_overhead)`` of the tensor cores' peak; large ``K`` is capped by the
  best measured matmul (power and clocks), which the rates already are. It matters for the
  attention scores (``K`` = the head dimension) and for tp-split projections
  (``K = hidden / tp``). Hopper's and Blackwell's persistent, warp-specialised kernels prefetch
  the next tile and overlap one tile's epilogue with another's mainloop (the same CUTLASS page),
  so there ``k_overhead`` is 0 (``autoplan.compute.gemm_rates``).

``layer_gemms`` lists one layer's GEMMs for ``tokens`` tokens on one GPU of a ``tp`` group:
forward (output ``tokens x N``), and in backward the data gradient (``tokens x K``) and the
weight gradient (``K x N``), each ``2 x tokens x K x N`` FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from overlapkit.autoplan.model_spec import ModelSpec

TILE = (128, 256)
TILE_K = 64
"""K depth of one pipeline stage of that tile's A100 kernel (cuBLAS's
``ampere_bf16_s16816gemm_bf16_128x256_ldg8_f2f_stages_64x3``: 64 deep, 3 stages)."""


@dataclass(frozen=True, slots=True)
class GemmRates:
    """How fast one GPU runs a GEMM: what ``gemm_seconds`` needs besides the shape."""

    flops_per_s: float
    """The large GEMMs' rate: the device's peak times the achievable fraction."""
    bytes_per_s: float | None = None
    """Achievable device-memory bandwidth (None: no memory roofline)."""
    element_bytes: int = 2
    sms: int | None = None
    """Streaming multiprocessors (None: no wave quantization)."""
    k_overhead: float = 0.0
    """A tile's fixed cost in units of K (``tile_k_overhead``; 0: none)."""
    best_fraction: float = 1.0
    """The best measured matmul's share of peak, which caps ``tile_efficiency``."""


def tile_k_overhead(peak_flops_per_s: float, bytes_per_s: float, element_bytes: int) -> float:
    """One tile's fixed cost in units of its K loop: its first pipeline stage's operands
    (``(128 + 256) x TILE_K``) and its ``128 x 256`` outputs through device memory at the SM's
    share of ``bytes_per_s``, against the ``2 x 128 x 256`` FLOPs per unit of K at the SM's share
    of ``peak_flops_per_s`` (the SM count cancels)::

        k_overhead = element_bytes x (128 x 256 + (128 + 256) x TILE_K) / (2 x 128 x 256)
                     x peak_flops_per_s / bytes_per_s

    A100 SXM4 80GB (312 TFLOP/s, 0.88 x 2039 GB/s achievable): 1.75 x 173.9 = 304.
    """
    tm, tn = TILE
    fixed_bytes = element_bytes * (tm * tn + (tm + tn) * TILE_K)
    return fixed_bytes * peak_flops_per_s / (bytes_per_s * 2 * tm * tn)


def tile_efficiency(k: float, k_overhead: float, best_fraction: float) -> float:
    """Share of the best matmul's rate a GEMM of inner dimension ``k`` keeps when every tile
    pays ``k_overhead``: ``min(1, k / (k + k_overhead) / best_fraction)`` (1 without overhead)."""
    if not k_overhead or k <= 0:
        return 1.0
    return min(1.0, k / (k + k_overhead) / best_fraction)


@lru_cache(maxsize=65536)
def wave_efficiency(rows: int, cols: int, sms: int | None, batch: int = 1) -> float:
    """Share of the waves of tiles that do work for ``batch`` outputs of ``rows x cols`` run
    as one (batched) GEMM; 1 without an SM count."""
    if not sms or rows < 1 or cols < 1:
        return 1.0
    best = 0.0
    for tr, tc in (TILE, TILE[::-1]):
        tiles = batch * math.ceil(rows / tr) * math.ceil(cols / tc)
        waves = math.ceil(tiles / sms)
        useful = batch * (rows * cols) / (tr * tc * waves * sms)
        best = max(best, useful)
    return min(1.0, best)


def layer_gemms(
    model: ModelSpec, tokens: float, *, tp: int, ep: int, cp: int, moe_layer: bool
) -> list[tuple[float, int, int, int]]:
    """One layer's GEMMs on one GPU: ``(M, K, N, count)`` with output ``M x N`` forward.

    ``tokens`` is the micro-batch's tokens of one replica; the GPU computes ``tokens / cp``
    of them. Routed experts: each of the GPU's ``experts / ep`` experts multiplies the tokens
    routed to it, ``tokens / cp x topk x ep / experts`` on average.
    """
    h = model.hidden
    m = max(1, round(tokens / cp))
    out = [
        (m, h, max(1, (model.q_dim + model.kv_dim + model.v_dim) // tp), 1),
        (m, max(1, model.heads * model.attention_v_dim // tp), h, 1),
    ]

    if moe_layer:
        out += routed_expert_gemms(model, tokens, tp=tp, ep=ep, cp=cp)
        if model.shared_experts:
            out += _mlp_gemms(model, m, model.moe_ffn_hidden * model.shared_experts, 1, tp)
    else:
        out += _mlp_gemms(model, m, model.ffn_hidden, 1, tp)
    return out


def _mlp_gemms(
    model: ModelSpec, rows: float, ffn: int, count: int, tp: int
) -> list[tuple[float, int, int, int]]:
    """An MLP's up (gated: two) and down projections on ``rows`` rows, ``count`` of them."""
    rows = max(1, round(rows))
    up = (2 if model.gated_mlp else 1) * ffn
    return [
        (rows, model.hidden, max(1, up // tp), count),
        (rows, max(1, ffn // tp), model.hidden, count),
    ]


def routed_expert_gemms(
    model: ModelSpec, tokens: float, *, tp: int, ep: int, cp: int
) -> list[tuple[float, int, int, int]]:
    """The GEMMs of one GPU's routed experts (``layer_gemms``' terms): each of its
    ``experts / ep`` experts on the ``tokens / cp x topk x ep / experts`` rows routed to it."""
    m = max(1, round(tokens / cp))
    local = max(1, model.experts // ep)
    return _mlp_gemms(model, m * model.topk * ep / model.experts, model.moe_ffn_hidden, local, tp)


def gemms_pass_seconds(
    gemms: list[tuple[float, int, int, int]], rates: GemmRates
) -> tuple[float, float]:
    """(forward, backward) seconds of ``gemms`` (``gemm_pass_seconds`` each, times its count)."""
    fwd = bwd = 0.0
    for m, k, n, count in gemms:
        forward, backward = gemm_pass_seconds(m, k, n, rates)
        fwd += count * forward
        bwd += count * backward
    return fwd, bwd


def gemm_seconds(m: float, k: float, n: float, rates: GemmRates, *, batch: int = 1) -> float:
    """``batch`` GEMMs of ``m x k`` by ``k x n`` run as one: the slower of their FLOPs (with
    wave and tile losses) and their operands' and results' trip through device memory (a
    roofline)."""
    waves = wave_efficiency(round(m), round(n), rates.sms, batch)
    tile = tile_efficiency(k, rates.k_overhead, rates.best_fraction)
    compute = 2.0 * batch * m * k * n / (rates.flops_per_s * waves * tile)
    if not rates.bytes_per_s:
        return compute
    moved = batch * rates.element_bytes * (m * k + k * n + m * n)
    return max(compute, moved / rates.bytes_per_s)


def gemm_pass_seconds(m: float, k: float, n: float, rates: GemmRates) -> tuple[float, float]:
    """(forward, backward) seconds of a linear layer's GEMM of output ``m x n``: backward is
    the data gradient (``m x n`` by ``n x k``) and the weight gradient (``k x m`` by ``m x n``)."""
    forward = gemm_seconds(m, k, n, rates)
    return forward, gemm_seconds(m, n, k, rates) + gemm_seconds(k, m, n, rates)


@lru_cache(maxsize=65536)
def layer_matmul_seconds(
    model: ModelSpec,
    tokens: float,
    *,
    tp: int,
    ep: int,
    cp: int,
    moe_layer: bool,
    rates: GemmRates,
) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's GEMMs (``gemm_pass_seconds`` each)."""
    return gemms_pass_seconds(
        layer_gemms(model, tokens, tp=tp, ep=ep, cp=cp, moe_layer=moe_layer), rates
    )


@lru_cache(maxsize=65536)
def unfused_attention_seconds(
    model: ModelSpec, micro_batch: int, seq_len: int, *, tp: int, cp: int, rates: GemmRates
) -> tuple[float, float]:
    """(forward, backward) seconds of ``QK^T`` and ``(softmax)V`` as batched GEMMs (no flash
    attention). Per head, forward: scores ``S = Q K^T`` (``s x d`` by ``d x s``) and the output
    ``P V`` (``s x s`` by ``s x d``); backward: ``dP = dO V^T`` (inner dimension ``d``),
    ``dV = P^T dO``, ``dQ = dS K`` and ``dK = dS^T Q`` (inner dimension ``s``). The products
    of inner dimension ``d`` write an ``s x s`` result from a short K loop: memory-bound on most
    GPUs, and the tiles' fixed cost weighs on them."""
    heads = micro_batch * max(1, model.heads // tp)
    queries, d, dv = seq_len / cp, model.qk_head_dim, model.attention_v_dim

    def bmm(m: float, k: float, n: float) -> float:
        return gemm_seconds(m, k, n, rates, batch=heads)

    forward = bmm(queries, d, seq_len) + bmm(queries, seq_len, dv)
    backward = (
        bmm(queries, dv, seq_len)  # dP = dO V^T
        + bmm(seq_len, queries, dv)  # dV = P^T dO
        + bmm(queries, seq_len, d)  # dQ = dS K
        + bmm(seq_len, queries, d)  # dK = dS^T Q
    )
    return forward, backward
