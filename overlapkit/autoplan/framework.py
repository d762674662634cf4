"""A training framework: which layouts it runs, and how a step of one costs under it.

``--framework`` (``SearchSettings.framework``) means both: the search proposes only what the
framework runs (``Framework.lacks``; a pinned value it cannot run is refused by name) and prices
each layout as that framework splits the model. ``FRAMEWORKS`` holds those ``--framework``
accepts: ``MEGATRON`` (the default, what the published runs used: runs every layout the search
enumerates but torch's zero-bubble schedules), ``OVERLAPKIT_TRAIN`` (its refusals are
``overlapkit.layout.overlapkit_train``'s table, the one overlapkit-train's checks raise from)
and ``TORCHTITAN`` (0.3.0, the framework ``autoplan.handoff.torchtitan`` hands a layout to).
How each splits a step: docs/auto-planner.md
("What each framework runs").
"""

from __future__ import annotations

from dataclasses import dataclass

from overlapkit.autoplan.selective import (
    ATTENTION_CORE,
    SDPA_KERNEL,
    TORCHTITAN_OP_SAC,
    SelectiveRecompute,
)
from overlapkit.layout import TrainingLayout
from overlapkit.layout import overlapkit_train as train_table
from overlapkit.layout.overlapkit_train import Job, Refused


@dataclass(frozen=True, slots=True, kw_only=True)
class Framework:
    """A framework that runs layouts: which it does not run (``refused``), and how it splits
    and synchronises a step of the others (the pricing fields). docs/auto-planner.md ("What
    each framework runs") says what each of the three registered ones does."""

    name: str
    refused: tuple[Refused, ...] = ()
    """The combinations it does not run, first refusal first (``Framework.lacks``)."""
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
    plain_row_biases: bool = False
    """With ``dtensor_parameters``: the row-parallel linears' biases stay plain tensors (added on
    the sequence shard, their gradients summed over tp once per step: overlapkit-train's
    ``overlapkit.inlayer.sequence_parallel``); False: replicated DTensors."""
    sp_stage_gathers: int = 0
    """With sequence parallelism, all-gathers per micro-batch and stage outside the layers
    (overlapkit-train: the sequence cut before the first block, whose backward gathers, and
    gathered after the last)."""
    tp_comm_choices: tuple[str, ...] = ("sync",)
    """How its tp collectives can meet their matmuls (overlapkit-train's
    ``parallel.plan.tp_comm``); the search prices each and keeps the fastest."""
    ep_chunk_choices: tuple[int, ...] = (1,)
    """Token chunks its MoE layers' all-to-alls can be pipelined in with the experts; the search
    prices each and keeps the fastest (overlapkit-train's ``parallel.plan.ep_chunks``)."""
    selective: SelectiveRecompute = ATTENTION_CORE
    """What its selective recomputation recomputes, and so what it costs."""
    fsdp_gathered_across_micro_batches: bool = False
    """Under pp, FSDP keeps a stage's parameters gathered for the whole step, its gradients
    unsharded in the reduce dtype, reduced once (torchtitan); False: gathered and reduced per
    micro-batch."""
    grad_sync_every_micro_batch: bool = False
    """With pp = 1, gradients are reduced after every micro-batch's backward (False: once per
    step, after the last)."""
    zero_on_fsdp: bool = False
    """Its zero1 / zero2 are FSDP2 with the parameters kept gathered (``ok.fsdp(zero=)``):
    priced with FSDP2's traffic per block and its DTensor parameters; False: Megatron-LM's
    distributed optimizer."""
    fsdp_reduces_once_per_step: bool = False
    """Its FSDP (fsdp, hsdp) keeps the gradients unsharded over a step's micro-batches and
    reduce-scatters them after the last backward (FSDP2 under ``no_sync``); False: after each
    micro-batch's backward."""
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
    zero_bubble_schedules: bool = False
    """Runs torch's zero-bubble pipeline schedules (``TrainingLayout.schedule``): the search
    proposes them where the table plans them (``pipeline_schedule.schedule_variants``); False:
    1F1B and interleaved 1F1B only, a layout naming another refused."""

    def lacks(self, layout: TrainingLayout, *, layers: int | None = None) -> list[str]:
        """What of ``layout`` this framework does not run, in words (empty: it runs it).

        Args:
            layout (TrainingLayout): on the pipeline schedule the planner prices for it.
            layers (int | None): the model's layers, for the pipeline's stage split (None: not
                checked).
        """
        return train_table.lacks(Job.planned(layout, layers), self.refused)

    def refusal(self, layout: TrainingLayout, *, layers: int | None = None) -> str | None:
        """Why this framework does not run ``layout`` (one line), or None when it runs it."""
        lacks = self.lacks(layout, layers=layers)
        return f"{self.name} does not run {', '.join(lacks)}" if lacks else None


ZERO_BUBBLE_REFUSED = Refused(
    when=lambda job: job.layout.schedule is not None,
    lacks="torch's {schedule} pipeline schedule",
)
"""A framework without ``zero_bubble_schedules`` (Megatron-LM's own zero-bubble schedules are
not torch's, and not priced here)."""
MEGATRON = Framework(
    name="megatron",
    refused=(ZERO_BUBBLE_REFUSED,),
    sequence_parallel=True,
    vocab_parallel=True,
    dtensor_parameters=False,
)
OVERLAPKIT_TRAIN = Framework(
    name="overlapkit-train",
    refused=train_table.REFUSED,
    sequence_parallel=True,
    vocab_parallel=False,
    dtensor_parameters=True,
    plain_row_biases=True,
    selective=SDPA_KERNEL,
    zero_on_fsdp=True,
    fsdp_reduces_once_per_step=True,
    cp_all_gather=True,
    tied_embedding_all_reduce=True,
    fsdp_reduce_after_pipeline=True,
    zero_bubble_schedules=True,
    ep_chunk_choices=(1, 2, 4),
    sp_stage_gathers=2,
    tp_comm_choices=("sync", "split", "ring"),
)
"""Its tp is sequence-parallel (``overlapkit.inlayer.sequence_parallel``), counted on gpt_tiny
(tests/test_inlayer_tp.py): per layer pass 2 all-gathers (q, k and v share one) and 2
reduce-scatters, and per stage the sequence cut and the final gather; ``tp_comm`` ``split`` and
``ring`` and ``ep_chunks`` pipeline them with the matmuls (``autoplan.pipelined_comm``)."""
TORCHTITAN_REFUSED = (
    Refused(
        when=lambda job: job.layout.sharding not in ("ddp", "fsdp", "hsdp"),
        lacks="{sharding} optimizer-state sharding",
    ),
    Refused(
        when=lambda job: job.layout.recompute_layers is not None,
        lacks="full recomputation of {recompute_layers} layers of a stage (only of every layer)",
    ),
    Refused(
        when=lambda job: job.layout.tp > 1 and job.layout.ep > 1,
        lacks="tensor and expert parallelism together",
    ),
    Refused(
        when=lambda job: job.layout.sharding == "ddp" and max(job.layout.cp, job.layout.ep) > 1,
        lacks="ddp with {spread}",
    ),
    Refused(
        when=lambda job: job.layout.sharding == "hsdp" and max(job.layout.cp, job.layout.ep) > 1,
        lacks="hsdp with {spread}",
    ),
)
"""torchtitan 0.3.0 has no ZeRO-1/2, recomputes every block under full AC, has no expert tensor
parallelism, shards over ``dp_shard x cp`` (so ep and cp need FSDP's shard group) and lends ep
ranks from that group (so its hsdp is not the search's with ep or cp)."""
TORCHTITAN = Framework(
    name="torchtitan",
    refused=TORCHTITAN_REFUSED,
    sequence_parallel=True,
    vocab_parallel=True,
    dtensor_parameters=True,
    selective=TORCHTITAN_OP_SAC,
    fsdp_gathered_across_micro_batches=True,
    grad_sync_every_micro_batch=True,
    zero_bubble_schedules=True,
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
