"""A training framework: which layouts it runs, and how a step of one costs under it.

``--framework`` (``SearchSettings.framework``) means both: the search proposes only what the
framework runs (``Framework.refusal``: a pinned value it cannot run is refused by name), and
prices each layout as that framework splits the model. The registry ``FRAMEWORKS`` (name ->
``Framework``) holds those ``--framework`` accepts:

- ``MEGATRON`` (the default; what the published runs used): runs every layout the search
  enumerates. Megatron-LM's tensor parallelism with sequence parallelism (Korthikanti et al.,
  MLSys'23): each layer's attention and MLP split over tp, an all-gather before and a
  reduce-scatter after each of them, in forward and in backward; the embedding and the output
  layer split over the vocabulary; the parameters plain tensors (FSDP2's excepted, which are
  always DTensors).
- ``OVERLAPKIT_TRAIN``: overlapkit-train (``overlapkit/train``), priced as it runs each
  dimension, and searched only where it runs it (``lacks``: what ``overlapkit/train/parallel``'s
  ``mesh.py``, ``pipeline_stages.py`` and ``context_parallel.py`` refuse before launch):

  - **tp**: torch's ``parallelize_module`` on every block (``apply_tensor_parallel``): ``q``,
    ``k``, ``v`` and the MLP's first layer column-wise, ``proj`` and the MLP's second layer
    row-wise. The activations between the blocks stay replicated, so forward all-reduces the
    output of each row-wise layer (2 per layer) and backward the input gradient of each
    column-wise layer (4: ``q``, ``k`` and ``v`` are separate modules); the profiler counts 24
    all-reduces in a forward and backward of 4-layer gpt_tiny at tp = 2. The embeddings, the
    norms and the head stay whole on every tp rank. The split parameters are DTensors, and so
    are the experts ``shard_experts`` splits over ep. Its MoE layers are not split over tp.
  - **pp**: ``torch.distributed.pipelining``'s 1F1B (interleaved with ``v > 1``), bubble
    ``(p - 1) / (v m + p - 1)`` of the step as for Megatron-LM; only where ``p x v`` divides the
    layers and a step has at least ``p`` micro-batches. The tied embedding and head are summed
    by one all-reduce between the first and last stage after backward, on the critical path.
    ``ok.fsdp`` under a pipeline reduce-scatters after the schedule (torch's ``PipelineStage``
    runs FSDP2's post-backward itself), exposed.
  - **cp**: K and V all-gathered before each layer's attention and their gradients
    reduce-scattered in backward (``flex_cp_allgather`` on gloo: a call each for K and for V),
    the attention waiting for both; torch's ``context_parallel`` on CUDA gathers K and V (in
    one buffer) again in backward.
  - **zero1 / zero2**: ``ok.fsdp(zero=1|2)``, FSDP2 with the parameters kept gathered for the
    step: per block one all-gather per step, one reduce-scatter per step (ZeRO-1) or per
    micro-batch (ZeRO-2); its parameters are DTensors. Its FSDP (ZeRO-3) reduce-scatters once
    per step too (the loop's ``no_sync`` keeps the gradients unsharded until the last
    micro-batch's backward).
  - **selective recomputation**: ``SDPA_KERNEL`` (``autoplan.selective``): only the SDPA kernel
    is rerun in backward.
  - **refused**: pp with ep or cp, ZeRO-2 under pp, cp with ep or HSDP, tp with ep, and tp or ep
    under FSDP (fsdp, hsdp, zero1, zero2): ``parallelize_module``'s DTensor shards under FSDP2
    would need 2-D (dp, tp) shards that ``ok.fsdp``'s gloo all-gather and reduce-scatter do not
    handle, and expert shards are reduced over another group than the dense parameters, which
    one FSDP mesh cannot express; both are kept out of its search.

- ``TORCHTITAN``: torchtitan 0.3.0 (``autoplan.handoff.torchtitan`` hands a layout over to it). Its
  tensor parallelism is Megatron-style with sequence parallelism (``enable_sequence_parallel``,
  on by default) and a vocabulary-parallel embedding and head (loss parallel); the split
  parameters are DTensors. Data parallelism is always FSDP2 (``apply_fsdp_to_decoder``): ddp
  is a replicate mesh with a shard group of 1, hsdp ``dp_replicate x dp_shard``; FSDP2 prefetches
  the next block implicitly (its all-gather is issued when the CPU reaches that block), and
  explicitly, one block ahead, only when ep > 1 (MoE's device-to-host syncs would stall the
  implicit one): one block ahead either way, as priced (``SearchSettings.fsdp_prefetch`` 1).
  What it does not run, or not as the search prices it, is refused: ZeRO-1/2 (it has
  none), full recomputation of some layers (its full AC wraps every block), tensor with
  expert parallelism (0.3.0 has no expert tensor parallelism: its ep ranks come out of
  ``dp_shard x cp x tp`` and hold whole experts), ep or cp with ddp (ep needs FSDP's shard
  group, and cp > 1 always shards the parameters over ``dp_shard x cp``), and hsdp with ep or
  cp (its shard group then spans ``dp_shard x cp`` and lends ep ranks, where the search's hsdp
  shards over ``dp_shard`` alone). Priced as it runs: its selective policy
  (``TORCHTITAN_OP_SAC``); under pp the schedule keeps a stage's parameters gathered from the
  first micro-batch's forward to the last one's backward, gradients accumulated unsharded in
  fp32 and reduce-scattered once (torchtitan's default ``fsdp_reshard_after_forward`` under pp
  and torch's pipeline stages); with pp = 1 every micro-batch's backward reduces the
  gradients (no ``no_sync`` in its accumulation loop), ddp's and hsdp's replica all-reduces
  included.

"Selective" recomputation is the framework's policy (``selective``, ``autoplan.selective``):
for Megatron-LM the attention core (its ``--recompute-granularity selective``), for
overlapkit-train the SDPA kernel, for torchtitan its op policy (every second matmul).

DTensor parameters matter where the host runs the optimizer step tensor by tensor (CPU ranks:
``StepOptions.optimizer_dtensor_s``); on GPUs the difference is not priced (the defaults are 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from overlapkit.autoplan.selective import (
    ATTENTION_CORE,
    SDPA_KERNEL,
    TORCHTITAN_OP_SAC,
    SelectiveRecompute,
)
from overlapkit.planner.layout import RECOMPUTE, SHARDING, TrainingLayout


@dataclass(frozen=True, slots=True, kw_only=True)
class Framework:
    """What a framework runs, and how it runs tensor and expert parallelism (see module doc)."""

    name: str
    sequence_parallel: bool
    """tp: an all-gather and a reduce-scatter around attention and around the MLP, forward and
    backward (Megatron-LM's sequence parallelism); False: all-reduces (the next two fields)."""
    tp_forward_all_reduces: int = 0
    """Without sequence parallelism: all-reduces per layer in forward (row-wise outputs)."""
    tp_backward_all_reduces: int = 0
    """Without sequence parallelism: all-reduces per layer in backward (column-wise inputs)."""
    vocab_parallel: bool
    """The embedding and the output layer split over tp; False: replicated on every tp rank."""
    dtensor_parameters: bool
    """The parameters split over tp or ep are DTensors (torch's ``parallelize_module``)."""
    selective: SelectiveRecompute = ATTENTION_CORE
    """What its selective recomputation recomputes, and so what it costs."""
    pipeline_parallel: bool = True
    """Runs pp > 1."""
    context_parallel: bool = True
    """Runs cp > 1."""
    recompute: tuple[str, ...] = RECOMPUTE
    """The recomputation modes it runs (full: any number of layers per stage)."""
    sharding: tuple[str, ...] = SHARDING
    """The data-parallel shardings it runs."""
    tp_with_ep: bool = True
    """Runs tp > 1 and ep > 1 together."""
    tp_under_fsdp: bool = True
    """Runs tp > 1 with fsdp or hsdp sharding."""
    ep_under_fsdp: bool = True
    """Runs ep > 1 with fsdp or hsdp sharding."""
    partial_full_recompute: bool = True
    """Full recomputation of some of a stage's layers (False: of every layer only)."""
    ddp_with_cp_or_ep: bool = True
    """Runs cp > 1 or ep > 1 with ddp sharding."""
    hsdp_with_cp_or_ep: bool = True
    """Runs cp > 1 or ep > 1 with hsdp sharding, its shard group ``dp_shard`` alone."""
    fsdp_gathered_across_micro_batches: bool = False
    """Under pp, FSDP keeps a stage's parameters gathered for the whole step, its gradients
    unsharded in the reduce dtype, reduced once (torchtitan); False: gathered and reduced per
    micro-batch."""
    grad_sync_every_micro_batch: bool = False
    """With pp = 1, gradients are reduced after every micro-batch's backward (False: once per
    step, after the last)."""
    zero_on_fsdp: bool = False
    """Its zero1 / zero2 are FSDP2 with the parameters kept gathered (``ok.fsdp(zero=)``):
    refused where FSDP is (``tp_under_fsdp``, ``ep_under_fsdp``), priced with FSDP2's traffic
    per block and its DTensor parameters; False: Megatron-LM's distributed optimizer."""
    fsdp_reduces_once_per_step: bool = False
    """Its FSDP (fsdp, hsdp) keeps the gradients unsharded over a step's micro-batches and
    reduce-scatters them after the last backward (FSDP2 under ``no_sync``); False: after each
    micro-batch's backward."""
    pp_with_ep: bool = True
    """Runs pp > 1 with ep > 1."""
    pp_with_cp: bool = True
    """Runs pp > 1 with cp > 1."""
    pp_with_zero2: bool = True
    """Runs pp > 1 with zero2 sharding."""
    cp_with_ep: bool = True
    """Runs cp > 1 with ep > 1."""
    cp_with_hsdp: bool = True
    """Runs cp > 1 with hsdp sharding."""
    equal_stages_only: bool = False
    """Runs a pipeline only where ``pp x v`` divides the layers (every model chunk alike)."""
    micro_batches_below_stages: bool = True
    """Runs a pipeline with fewer micro-batches per step than stages."""
    cp_all_gather: bool = False
    """Context parallelism by all-gathering K and V before each layer's attention (exposed),
    their gradients reduce-scattered in backward; False: Megatron-LM's ring, hidden behind
    the attention."""
    tied_embedding_all_reduce: bool = False
    """Under pp a model with a tied embedding and head sums the two copies' gradients with one
    all-reduce between the first and last stage after backward (priced, exposed). False: not
    priced (Megatron-LM does the same all-reduce; its validation table was fitted without it)."""
    fsdp_reduce_after_pipeline: bool = False
    """Under pp, FSDP's gradient reduction runs after the whole schedule (torch's
    ``PipelineStage`` runs FSDP2's post-backward itself), with no backward left to hide it."""

    def lacks(self, layout: TrainingLayout, *, layers: int | None = None) -> list[str]:
        """What of ``layout`` this framework does not run, in words (empty: it runs it).

        ``layers``: the model's layers, for the pipeline's stage split (None: not checked).
        """
        out = []
        pp, cp, ep, tp = layout.pp, layout.cp, layout.ep, layout.tp
        if cp > 1 and not self.context_parallel:
            out.append(f"context parallelism (cp={cp})")
        if pp > 1 and not self.pipeline_parallel:
            out.append(f"pipeline parallelism (pp={pp})")
        if layout.recompute not in self.recompute:
            out.append(f"activation recomputation ({layout.recompute})")
        elif layout.recompute_layers is not None and not self.partial_full_recompute:
            out.append(
                f"full recomputation of {layout.recompute_layers} layers of a stage (only of "
                "every layer)"
            )
        if layout.sharding not in self.sharding:
            what = "optimizer-state sharding" if layout.sharding.startswith("zero") else "sharding"
            out.append(f"{layout.sharding} {what}")
        fsdp = layout.sharding in ("fsdp", "hsdp") or (
            self.zero_on_fsdp and layout.sharding in ("zero1", "zero2")
        )
        under = f"FSDP ({layout.sharding})" if layout.sharding.startswith("zero") else "FSDP"
        pairs = (
            (tp > 1 and ep > 1 and not self.tp_with_ep, "tensor and expert parallelism together"),
            (tp > 1 and fsdp and not self.tp_under_fsdp, f"tensor parallelism under {under}"),
            (ep > 1 and fsdp and not self.ep_under_fsdp, f"expert parallelism under {under}"),
            (pp > 1 and ep > 1 and not self.pp_with_ep, "pipeline with expert parallelism"),
            (pp > 1 and cp > 1 and not self.pp_with_cp, "pipeline with context parallelism"),
            (
                pp > 1 and layout.sharding == "zero2" and not self.pp_with_zero2,
                "zero2 under a pipeline",
            ),
            (cp > 1 and ep > 1 and not self.cp_with_ep, "context with expert parallelism"),
            (cp > 1 and layout.sharding == "hsdp" and not self.cp_with_hsdp, "cp with hsdp"),
        )
        out += [what for refused, what in pairs if refused]
        spread = [f"{k}={v}" for k, v in (("cp", cp), ("ep", ep)) if v > 1]
        if spread and layout.sharding == "ddp" and not self.ddp_with_cp_or_ep:
            out.append(f"ddp with {' and '.join(spread)}")
        if spread and layout.sharding == "hsdp" and not self.hsdp_with_cp_or_ep:
            out.append(f"hsdp with {' and '.join(spread)}")
        if pp > 1 and not self.micro_batches_below_stages and layout.num_micro_batches < pp:
            out.append(
                f"a pipeline of {pp} stages with {layout.num_micro_batches} micro-batches per "
                "step (fewer than its stages)"
            )
        chunks = pp * layout.virtual_stages
        if pp > 1 and self.equal_stages_only and layers is not None and layers % chunks:
            out.append(f"{layers} layers in {chunks} pipeline chunks (unequal stages)")
        return out

    def refusal(self, layout: TrainingLayout, *, layers: int | None = None) -> str | None:
        """Why this framework does not run ``layout`` (one line), or None when it runs it."""
        lacks = self.lacks(layout, layers=layers)
        return f"{self.name} does not run {', '.join(lacks)}" if lacks else None


MEGATRON = Framework(
    name="megatron", sequence_parallel=True, vocab_parallel=True, dtensor_parameters=False
)
OVERLAPKIT_TRAIN = Framework(
    name="overlapkit-train",
    sequence_parallel=False,
    tp_forward_all_reduces=2,
    tp_backward_all_reduces=4,
    vocab_parallel=False,
    dtensor_parameters=True,
    selective=SDPA_KERNEL,
    tp_with_ep=False,
    tp_under_fsdp=False,
    ep_under_fsdp=False,
    zero_on_fsdp=True,
    fsdp_reduces_once_per_step=True,
    pp_with_ep=False,
    pp_with_cp=False,
    pp_with_zero2=False,
    cp_with_ep=False,
    cp_with_hsdp=False,
    equal_stages_only=True,
    micro_batches_below_stages=False,
    cp_all_gather=True,
    tied_embedding_all_reduce=True,
    fsdp_reduce_after_pipeline=True,
)
TORCHTITAN = Framework(
    name="torchtitan",
    sequence_parallel=True,
    vocab_parallel=True,
    dtensor_parameters=True,
    selective=TORCHTITAN_OP_SAC,
    sharding=("ddp", "fsdp", "hsdp"),
    tp_with_ep=False,
    partial_full_recompute=False,
    ddp_with_cp_or_ep=False,
    hsdp_with_cp_or_ep=False,
    fsdp_gathered_across_micro_batches=True,
    grad_sync_every_micro_batch=True,
)
FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (MEGATRON, OVERLAPKIT_TRAIN, TORCHTITAN)}
"""The frameworks ``--framework`` names (a new one is added here, with its refusal)."""


def framework_named(framework: str | Framework) -> Framework:
    """The registered framework of that name (a ``Framework`` is returned as it is).

    Raises:
        ValueError: an unknown name, the known ones listed.
    """
    if isinstance(framework, Framework):
        return framework
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework {framework!r}; valid: {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[framework]
