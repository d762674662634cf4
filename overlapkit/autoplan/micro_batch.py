"""One micro-batch on the slowest pipeline stage, and its model-parallel collectives.

``StageMicroBatch`` is what every term of ``autoplan.step_time`` prices; ``tensor_parallel``,
``context_parallel``, ``expert_parallel`` and ``pipeline_parallel`` give the seconds of its tp,
cp, ep and pp collectives on the layout's groups (``group_costs.LayoutCollectives``), in
total and on the critical path. What each counts, and why: docs/auto-planner.md, "The model
of a step".
"""

from __future__ import annotations

from dataclasses import dataclass

from overlapkit.autoplan.framework import Framework
from overlapkit.autoplan.gemm import (
    GemmRates,
    gemm_seconds,
    gemms_pass_seconds,
    layer_gemms,
    routed_expert_gemms,
)
from overlapkit.autoplan.group_costs import LayoutCollectives
from overlapkit.autoplan.memory import Precision, layers_per_stage
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.pipelined_comm import (
    one_sided_exposed,
    pipelined_exposed,
    ring_exposed,
)
from overlapkit.layout import TrainingLayout

BACKWARD_OVER_FORWARD = 2
"""A backward pass costs twice its forward: each forward GEMM has two in backward (the
gradients of its input and of its weight, the same FLOPs each). Flash attention's backward,
and the window cp's ring hides behind, are priced at that ratio too."""
ALL_TO_ALLS_PER_MOE_PASS = 2
"""Expert parallelism moves each token twice per pass through an MoE layer: dispatch to its
experts' ranks, and the combine back."""
SEQUENCE_PARALLEL_GATHERS = 2
"""Sequence parallelism gathers the sequence before attention and before the MLP, and
reduce-scatters after each: two of each per layer pass (Korthikanti et al.)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMicroBatch:
    """One micro-batch of one data-parallel replica on the slowest pipeline stage.

    Build it with ``StageMicroBatch.of``; the derived fields are computed there once.
    """

    model: ModelSpec
    layout: TrainingLayout
    framework: Framework
    precision: Precision
    seq_len: int
    layers: int
    """The stage's layers (``memory.layers_per_stage``)."""
    tokens: int
    """``micro_batch x seq_len``: the replica's tp x cp group shares their work."""
    recomputed: float
    """Share of the stage's layers whose forward runs again in backward (full recomputation,
    0 to 1)."""
    moe_layers: float
    """The stage's MoE layers (an average where the model interleaves them); 0 if dense."""

    @classmethod
    def of(
        cls,
        model: ModelSpec,
        layout: TrainingLayout,
        *,
        framework: Framework,
        precision: Precision,
        seq_len: int,
    ) -> StageMicroBatch:
        layers = layers_per_stage(model, layout)
        return cls(
            model=model,
            layout=layout,
            framework=framework,
            precision=precision,
            seq_len=seq_len,
            layers=layers,
            tokens=layout.micro_batch * seq_len,
            recomputed=layout.recomputed_share(layers),
            moe_layers=layers * (model.moe_layers / model.layers) if model.is_moe else 0.0,
        )

    @property
    def activation_bytes(self) -> int:
        return self.precision.activation_bytes


@dataclass(frozen=True, slots=True)
class CommSeconds:
    """One micro-batch's collectives of one dimension, seconds."""

    total_s: float
    """Every call's time, hidden or not."""
    exposed_s: float
    """On the critical path."""


def tensor_parallel(
    stage: StageMicroBatch,
    collectives: LayoutCollectives,
    *,
    overlap: float,
    mode: str = "sync",
    chunks: int = 2,
    rates: GemmRates | None = None,
) -> CommSeconds:
    """tp's collectives of the micro-batch's activations, in forward, backward and a recomputed
    forward; ``overlap`` is the share hidden (async TP), the rest exposed.

    With sequence parallelism 2 all-gathers + 2 reduce-scatters per layer pass (a gloo
    reduce-scatter is an all-reduce of the whole input: ``Library.moves_host_tensors``), and
    the framework's ``sp_stage_gathers`` per stage (overlapkit-train cuts the sequence before
    the first block and gathers it after the last); without, the framework's all-reduces of the
    replicated activations. ``mode`` (overlapkit-train's ``parallel.plan.tp_comm``, with
    ``rates``) prices ``split`` and ``ring`` from their pipelines (``_overlapped_pass``).
    """
    framework, layout = stage.framework, stage.layout
    tp_bytes = stage.tokens / layout.cp * stage.model.hidden * stage.activation_bytes
    gather = collectives("all_gather", tp_bytes, "tp")
    sequence_parallel = framework.sequence_parallel
    if sequence_parallel:
        scatter = collectives(_scatter_kind(collectives), tp_bytes, "tp")
        forward = backward = SEQUENCE_PARALLEL_GATHERS * (gather + scatter)
    else:
        all_reduce = collectives("all_reduce", tp_bytes, "tp")
        forward = framework.tp_forward_all_reduces * all_reduce
        backward = framework.tp_backward_all_reduces * all_reduce
    passes = 2 + stage.recomputed  # forwards (one recomputed) and the backward
    extra = framework.sp_stage_gathers * gather if sequence_parallel else 0.0
    if layout.recompute == "selective" and sequence_parallel:
        # The policy's recomputed forward gathers its sequence-parallel inputs again.
        extra += stage.layers * framework.selective.tp_all_gathers_recomputed * gather
    if sequence_parallel and mode != "sync" and rates is not None and layout.tp > 1:
        per_pass, exposed_pass = _overlapped_pass(stage, collectives, mode, chunks, rates)
        return CommSeconds(
            stage.layers * passes * per_pass + extra, stage.layers * passes * exposed_pass + extra
        )
    total = stage.layers * ((1 + stage.recomputed) * forward + backward) + extra
    return CommSeconds(total, (1 - overlap) * total)


def _scatter_kind(collectives: LayoutCollectives) -> str:
    """gloo runs a reduce-scatter as an all-reduce of the whole input (its trace says so)."""
    return "all_reduce" if collectives.library.moves_host_tensors else "reduce_scatter"


def _overlapped_pass(
    stage: StageMicroBatch, collectives: LayoutCollectives, mode: str, chunks: int, rates
) -> tuple[float, float]:
    """(every collective's seconds, exposed seconds) of one layer pass under ``split`` or
    ``ring``: its four fused steps (all-gather + q/k/v, projection + reduce-scatter, all-gather
    + MLP up, MLP down + reduce-scatter), each collective hidden under the other chunks' part of
    its GEMM (``pipelined_comm``); exposed also carries what the GEMMs lose run in pieces
    (``gemm``'s wave and tile model) and every piece's call (the extra launches)."""
    layout, model = stage.layout, stage.model
    tp_bytes = stage.tokens / layout.cp * model.hidden * stage.activation_bytes
    pieces = chunks if mode == "split" else layout.tp
    dims = dict(tp=layout.tp, ep=layout.ep, cp=layout.cp, moe_layer=False)
    whole = layer_gemms(model, stage.tokens, **dims)[:4]
    part = layer_gemms(model, stage.tokens / pieces, **dims)[:4]
    kinds = ("all_gather", _scatter_kind(collectives)) * 2
    total = exposed = 0.0
    for kind, (m, k, n, _), (pm, pk, pn, _) in zip(kinds, whole, part, strict=True):
        full_s, piece_s = gemm_seconds(m, k, n, rates), gemm_seconds(pm, pk, pn, rates)
        exposed += max(0.0, pieces * piece_s - full_s)
        if mode == "split":
            comm = collectives(kind, tp_bytes / pieces, "tp")
            total += pieces * comm
            exposed += one_sided_exposed(comm, piece_s, pieces)
        else:
            comm = collectives("send_recv", tp_bytes / pieces, "tp")
            total += (pieces - 1) * comm
            exposed += ring_exposed(comm, piece_s, pieces)
    return total, exposed


def context_parallel(
    stage: StageMicroBatch, collectives: LayoutCollectives, *, ring_window_s: float
) -> CommSeconds:
    """cp's K and V traffic: a ring hidden behind each layer's attention (``ring_window_s``, one
    layer's, already times the overlap efficiency), or, where the framework gathers K and V
    before the attention (``Framework.cp_all_gather``), on the critical path.

    A gathering framework's host path (``Library.moves_host_tensors``: overlapkit-train's
    ``cplib::flex_cp_allgather``) gathers K and V and reduce-scatters their gradients with a
    call each; its CUDA path (torch's ``context_parallel``) gathers both in one buffer, again
    in backward.
    """
    model, layout, act = stage.model, stage.layout, stage.activation_bytes
    layers, recomputed = stage.layers, stage.recomputed
    kv_bytes = stage.tokens * (model.kv_dim + model.v_dim) * act / layout.tp
    kv_gather = collectives("all_gather", kv_bytes, "cp")
    kv_scatter = collectives("reduce_scatter", kv_bytes, "cp")
    if stage.framework.cp_all_gather and collectives.library.moves_host_tensors:
        k_v = [stage.tokens * dim * act / layout.tp for dim in (model.kv_dim, model.v_dim)]
        gather = sum(collectives("all_gather", nbytes, "cp") for nbytes in k_v)
        scatter = sum(collectives("reduce_scatter", nbytes, "cp") for nbytes in k_v)
        total = layers * ((1 + recomputed) * gather + scatter)
        return CommSeconds(total, total)
    if stage.framework.cp_all_gather:
        total = layers * ((2 + recomputed) * kv_gather + kv_scatter)
        return CommSeconds(total, total)
    per_layer = 2 * kv_gather + kv_scatter
    return CommSeconds(layers * per_layer, layers * max(0.0, per_layer - ring_window_s))


def expert_parallel(
    stage: StageMicroBatch,
    collectives: LayoutCollectives,
    *,
    overlap: float,
    chunks: int = 1,
    rates: GemmRates | None = None,
) -> CommSeconds:
    """ep's all-to-alls of each token's ``topk`` copies per MoE layer, forward, backward and a
    recomputed forward; ``overlap`` is the share hidden (DualPipe-style), the rest exposed.

    With ``chunks > 1`` (overlapkit-train's ``parallel.plan.ep_chunks``, ``rates`` given) each
    pass is priced as its pipeline (``pipelined_comm``): ``2 x chunks`` all-to-alls of a
    ``chunks``-th of the bytes each (every call's latency and overhead counted: the extra
    launches), hidden under the other chunks' expert GEMMs, forward and backward; the exposed
    part also carries what the experts lose running ``chunks`` GEMMs of a ``chunks``-th of the
    rows (``gemm``'s wave and tile model) instead of one.
    """
    layout, model = stage.layout, stage.model
    ep_bytes = (
        stage.tokens
        / (layout.cp * layout.tp)
        * model.hidden
        * model.dispatch_copies
        * stage.activation_bytes
    )
    passes = 2 + stage.recomputed
    if chunks == 1 or rates is None or layout.ep == 1:
        calls = ALL_TO_ALLS_PER_MOE_PASS * passes
        total = stage.moe_layers * calls * collectives("all_to_all", ep_bytes, "ep")
        return CommSeconds(total, (1 - overlap) * total)
    comm = collectives("all_to_all", ep_bytes / chunks, "ep")
    whole = routed_expert_gemms(model, stage.tokens, tp=layout.tp, ep=layout.ep, cp=layout.cp)
    full_fwd, full_bwd = gemms_pass_seconds(whole, rates)
    part_fwd, part_bwd = gemms_pass_seconds(
        routed_expert_gemms(model, stage.tokens / chunks, tp=layout.tp, ep=layout.ep, cp=layout.cp),
        rates,
    )
    forwards = 1 + stage.recomputed
    exposed = forwards * pipelined_exposed(comm, part_fwd, chunks)
    exposed += pipelined_exposed(comm, part_bwd, chunks)
    lost = forwards * (chunks * part_fwd - full_fwd) + (chunks * part_bwd - full_bwd)
    total = stage.moe_layers * passes * ALL_TO_ALLS_PER_MOE_PASS * chunks * comm
    return CommSeconds(total, stage.moe_layers * (exposed + max(0.0, lost)))


def pipeline_parallel(
    stage: StageMicroBatch, collectives: LayoutCollectives
) -> tuple[float, float]:
    """(per micro-batch, per step) seconds of pp's sends, all exposed.

    Per micro-batch the activation sent forward and its gradient sent back, per model chunk;
    per step, where the framework sums a tied embedding and head between the first and last
    stage (``Framework.tied_embedding_all_reduce``), that all-reduce after backward (2 ranks:
    as long as sending the gradient once).
    """
    model, layout, framework = stage.model, stage.layout, stage.framework
    if layout.pp == 1:
        return 0.0, 0.0
    pp_bytes = stage.tokens / layout.cp * model.hidden * stage.activation_bytes / layout.tp
    per_micro_batch = 2 * layout.virtual_stages * collectives("send_recv", pp_bytes, "pp")
    if not (model.tied_embeddings and framework.tied_embedding_all_reduce):
        return per_micro_batch, 0.0
    vocab_rows = model.vocab_size / (layout.tp if framework.vocab_parallel else 1)
    grad_bytes = vocab_rows * model.hidden * stage.precision.grad_reduce_bytes
    return per_micro_batch, collectives("send_recv", grad_bytes, "pp")
