"""A transformer layer's matrix multiplies on one GPU, and the wave quantization they suffer.

A GPU runs a matrix multiply as output tiles spread over its SMs in waves; the last wave is
partly empty when the tile count is not a multiple of the SM count, so a GEMM whose output has
few tiles runs far below peak (NVIDIA, "Matrix Multiplication Background User's Guide": tile
and wave quantization). Splitting a layer over ``tp`` GPUs shrinks each GPU's GEMMs, which is
one reason small layers at tp = 8 reach a lower share of peak than large ones (Korthikanti et
al.'s 22B model at 41.5 % MFU against 56.3 % for 1T). ``wave_efficiency`` is the share of a
GEMM's waves that do work, for ``128 x 256`` tiles (the tile cuBLAS uses for large BF16 GEMMs
on A100 and H100), the better of the two orientations.

``layer_gemms`` lists one layer's GEMMs for ``tokens`` tokens on one GPU of a ``tp`` group:
forward (output ``tokens x N``), and in backward the data gradient (``tokens x K``) and the
weight gradient (``K x N``), each ``2 x tokens x K x N`` FLOPs.
"""

from __future__ import annotations

import math
from functools import lru_cache

from overlapkit.autoplan.model_spec import ModelSpec

TILE = (128, 256)


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

    def mlp(rows: float, ffn: int, count: int) -> None:
        rows = max(1, round(rows))
        up = (2 if model.gated_mlp else 1) * ffn
        out.append((rows, h, max(1, up // tp), count))
        out.append((rows, max(1, ffn // tp), h, count))

    if moe_layer:
        local = max(1, model.experts // ep)
        mlp(m * model.topk * ep / model.experts, model.moe_ffn_hidden, local)
        if model.shared_experts:
            mlp(m, model.moe_ffn_hidden * model.shared_experts, 1)
    else:
        mlp(m, model.ffn_hidden, 1)
    return out


def gemm_seconds(
    m: float,
    k: float,
    n: float,
    *,
    flops_per_s: float,
    bytes_per_s: float | None,
    element_bytes: int,
    sms: int | None,
    batch: int = 1,
) -> float:
    """``batch`` GEMMs of ``m x k`` by ``k x n`` run as one: the slower of their FLOPs (with
    wave losses) and their operands' and results' trip through device memory (a roofline)."""
    waves = wave_efficiency(round(m), round(n), sms, batch)
    compute = 2.0 * batch * m * k * n / (flops_per_s * waves)
    if not bytes_per_s:
        return compute
    return max(compute, batch * element_bytes * (m * k + k * n + m * n) / bytes_per_s)


@lru_cache(maxsize=65536)
def layer_matmul_seconds(
    model: ModelSpec,
    tokens: float,
    *,
    tp: int,
    ep: int,
    cp: int,
    moe_layer: bool,
    flops_per_s: float,
    sms: int | None,
    bytes_per_s: float | None = None,
    element_bytes: int = 2,
) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's GEMMs (``gemm_seconds`` each)."""
    fwd = bwd = 0.0
    kw = dict(
        flops_per_s=flops_per_s, bytes_per_s=bytes_per_s, element_bytes=element_bytes, sms=sms
    )
    for m, k, n, count in layer_gemms(model, tokens, tp=tp, ep=ep, cp=cp, moe_layer=moe_layer):
        fwd += count * gemm_seconds(m, k, n, **kw)
        bwd += count * (gemm_seconds(m, n, k, **kw) + gemm_seconds(k, m, n, **kw))
    return fwd, bwd


@lru_cache(maxsize=65536)
def unfused_attention_seconds(
    model: ModelSpec,
    micro_batch: int,
    seq_len: int,
    *,
    tp: int,
    cp: int,
    flops_per_s: float,
    bytes_per_s: float | None,
    element_bytes: int,
    sms: int | None,
) -> float:
    """Forward seconds of ``QK^T`` and ``(softmax)V`` as batched GEMMs (no flash attention):
    per head an ``s x d`` by ``d x s`` product and an ``s x s`` by ``s x d`` one, whose small
    ``d`` makes them memory-bound on most GPUs."""
    heads = micro_batch * max(1, model.heads // tp)
    queries = seq_len / cp
    kw = dict(
        flops_per_s=flops_per_s, bytes_per_s=bytes_per_s, element_bytes=element_bytes, sms=sms
    )
    scores = gemm_seconds(queries, model.qk_head_dim, seq_len, batch=heads, **kw)
    values = gemm_seconds(queries, seq_len, model.attention_v_dim, batch=heads, **kw)
    return scores + values
