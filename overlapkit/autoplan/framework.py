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
- ``OVERLAPKIT_TRAIN``: overlapkit-train (``overlapkit/train/parallel.py``). It runs ddp, fsdp
  and hsdp, tensor parallelism (``parallel=tp_dp``) and expert parallelism (``parallel=ep_dp``)
  with ddp; not pipeline or context parallelism, activation recomputation, ZeRO-1/2, tp with
  ep, nor tp or ep under FSDP (``overlapkit/train/mesh.py`` refuses the last ones). Its
  ``apply_tensor_parallel`` is torch's ``parallelize_module`` on every block: ``q``, ``k``,
  ``v`` and the MLP's first layer column-wise, ``proj`` and the MLP's second layer row-wise. The
  activations between the blocks stay replicated, so forward all-reduces the output of each
  row-wise layer (2 per layer) and backward the input gradient of each column-wise layer (4:
  ``q``, ``k`` and ``v`` are separate modules). The profiler counts 24 all-reduces in a
  forward and backward of 4-layer gpt_tiny at tp = 2. The embeddings, the norms and the head
  stay replicated: every tp rank computes the whole output layer. The split parameters are
  DTensors, and so are the experts ``shard_experts`` splits over ep. Its MoE layers are not
  split over tp; that case is not modelled (overlapkit-train runs moe_tiny under ep).

- ``TORCHTITAN``: torchtitan 0.3.0 (``autoplan.torchtitan`` hands a layout over to it). Its
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
for Megatron-LM and overlapkit-train the attention core (Megatron-LM's
``--recompute-granularity selective``), for torchtitan its op policy (every second matmul).

DTensor parameters matter where the host runs the optimizer step tensor by tensor (CPU ranks:
``StepOptions.optimizer_dtensor_s``); on GPUs the difference is not priced (the defaults are 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from overlapkit.autoplan.selective import ATTENTION_CORE, TORCHTITAN_OP_SAC, SelectiveRecompute
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

    def lacks(self, layout: TrainingLayout) -> list[str]:
        """What of ``layout`` this framework does not run, in words (empty: it runs it)."""
        out = []
        if layout.cp > 1 and not self.context_parallel:
            out.append(f"context parallelism (cp={layout.cp})")
        if layout.pp > 1 and not self.pipeline_parallel:
            out.append(f"pipeline parallelism (pp={layout.pp})")
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
        fsdp = layout.sharding in ("fsdp", "hsdp")
        if layout.tp > 1 and layout.ep > 1 and not self.tp_with_ep:
            out.append("tensor and expert parallelism together")
        if layout.tp > 1 and fsdp and not self.tp_under_fsdp:
            out.append("tensor parallelism under FSDP")
        if layout.ep > 1 and fsdp and not self.ep_under_fsdp:
            out.append("expert parallelism under FSDP")
        spread = [f"{k}={v}" for k, v in (("cp", layout.cp), ("ep", layout.ep)) if v > 1]
        if spread and layout.sharding == "ddp" and not self.ddp_with_cp_or_ep:
            out.append(f"ddp with {' and '.join(spread)}")
        if spread and layout.sharding == "hsdp" and not self.hsdp_with_cp_or_ep:
            out.append(f"hsdp with {' and '.join(spread)}")
        return out

    def refusal(self, layout: TrainingLayout) -> str | None:
        """Why this framework does not run ``layout`` (one line), or None when it runs it."""
        lacks = self.lacks(layout)
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
    pipeline_parallel=False,
    context_parallel=False,
    recompute=("none",),
    sharding=("ddp", "fsdp", "hsdp"),
    tp_with_ep=False,
    tp_under_fsdp=False,
    ep_under_fsdp=False,
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
