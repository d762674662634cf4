"""One way to train a model on a topology: parallel sizes, micro-batching, recomputation, sharding.

**How ep relates to dp.** overlapkit keeps ``ok.plan``'s convention: the sizes multiply,
``world = pp x dp x ep x cp x tp``. ``dp`` counts the replicas of an *expert*; the dense
layers are replicated over ``dp x ep x cp`` (the ep ranks of a group read different batches,
so for dense layers ep is more data parallelism). Megatron-LM and torchtitan carve ep out of
the data-parallel size instead (their ``data_parallel_size`` is our ``dp x ep``, their
expert-data-parallel size our ``dp``); ``megatron_dp`` converts. The batch is split over
``dp x ep`` replicas, each running ``num_micro_batches`` micro-batches of ``micro_batch``
sequences per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from overlapkit.validation import check_int

DIMS = ("tp", "pp", "dp", "cp", "ep")
"""The parallel sizes, in ``ok.plan``'s order (``TrainingLayout.dims``)."""
RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation: none; selective = Korthikanti et al.'s, the attention core
(softmax, its dropout, ``QK^T``) is recomputed in backward; full = the forward of
``recompute_layers`` layers of each stage (all by default), keeping only their inputs (Megatron's
``--recompute-granularity full --recompute-method block --recompute-num-layers``)."""
SHARDING = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
"""Data-parallel state: ddp replicates all; zero1 shards optimizer state (Megatron's
distributed optimizer), zero2 also gradients, fsdp (ZeRO-3) also parameters, hsdp shards over
``dp_shard`` ranks and replicates over the rest."""
ONE_F_ONE_B = "1F1B"
INTERLEAVED_1F1B = "Interleaved1F1B"
"""The pipeline schedules a layout runs when it names none (``TrainingLayout.pipeline_schedule``:
by its ``virtual_stages``), torch's names."""
COUNTS = (*DIMS, "micro_batch", "num_micro_batches", "virtual_stages", "dp_shard")
"""The choices that are counts (integers >= 1)."""
Spelling = Callable[[str], str]
"""How a caller spells a choice's name in errors (``--dp-shard``, ``parallel.plan.tp``)."""


def as_named(key: str) -> str:
    """The field's own name (``ok.plan``'s keywords, ``TrainingLayout``'s fields)."""
    return key


def check_choice(key: str, value: object, spell: Spelling = as_named) -> None:
    """One choice of a layout on its own: a count >= 1, a recompute mode, a sharding.

    Raises:
        TypeError: a count that is not an int, naming ``spell(key)``.
        ValueError: a count below 1, an unknown mode, naming ``spell(key)`` and the valid ones.
    """
    if key in COUNTS or key == "recompute_layers":
        check_int(spell(key), value, 1)
    elif key == "schedule":
        if not isinstance(value, str):
            raise TypeError(f"{spell(key)} must be a schedule's name, got {value!r}")
    elif key in ("recompute", "sharding"):
        valid = RECOMPUTE if key == "recompute" else SHARDING
        if value not in valid:
            raise ValueError(f"{spell(key)} {value!r}; valid: {', '.join(valid)}")


def check_pairs(choices: Mapping[str, object], spell: Spelling = as_named) -> None:
    """Choices that go with another: ``recompute_layers`` with full, ``dp_shard`` with hsdp.

    A choice absent from ``choices`` (free) is not checked against.

    Raises:
        ValueError: the pair that disagrees, both spelled.
    """
    layers, mode = choices.get("recompute_layers"), choices.get("recompute", "full")
    if layers is not None and mode != "full":
        raise ValueError(
            f"{spell('recompute_layers')}={layers!r} goes with {spell('recompute')}=full, "
            f"got {mode!r}"
        )
    shard, sharding = choices.get("dp_shard"), choices.get("sharding", "hsdp")
    if shard is not None and sharding != "hsdp":
        raise ValueError(
            f"{spell('dp_shard')}={shard} goes with {spell('sharding')}=hsdp, got {sharding!r}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingLayout:
    """A complete training layout: what the auto-planner chooses, what a run trains with.

    Raises:
        TypeError / ValueError: a size that is not an integer >= 1, an unknown recompute or
            sharding mode, ``recompute_layers`` without full, ``dp_shard`` that is not a proper
            divisor of ``dp`` for hsdp (or given without hsdp), ``virtual_stages`` or
            ``schedule`` without pp, naming it.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel replica."""
    num_micro_batches: int = 1
    virtual_stages: int = 1
    """Interleaved 1F1B: model chunks per pipeline rank (1: plain 1F1B)."""
    recompute: str = "none"
    recompute_layers: int | None = None
    """full: layers recomputed of each model chunk, the ``virtual_stages`` chunks of a pipeline
    rank each (None: all of them), as Megatron-LM's ``--recompute-num-layers`` and
    overlapkit-train's ``train.recompute_layers`` count them."""
    sharding: str = "ddp"
    dp_shard: int | None = None
    """hsdp: ranks of one shard group (the inner dp axis)."""
    schedule: str | None = None
    """The pipeline schedule, torch's name (``parallel.plan.schedule``: InterleavedZeroBubble,
    ZBVZeroBubble, DualPipeV); None: 1F1B, or interleaved 1F1B with ``virtual_stages > 1``."""

    def __post_init__(self) -> None:
        choices = {f.name: getattr(self, f.name) for f in fields(self)}
        for key, value in choices.items():
            if value is not None:
                check_choice(key, value)
        check_pairs(choices)
        if self.virtual_stages > 1 and self.pp == 1:
            raise ValueError(
                f"virtual_stages ({self.virtual_stages}) must be 1 without pipeline parallelism"
            )
        if self.schedule is not None and self.pp == 1:
            raise ValueError(f"schedule ({self.schedule}) needs pipeline parallelism (pp > 1)")
        if self.sharding == "hsdp" and (
            self.dp_shard is None or not 1 < self.dp_shard < self.dp or self.dp % self.dp_shard
        ):
            raise ValueError(
                f"hsdp needs dp_shard dividing dp ({self.dp}) with 1 < dp_shard < dp, "
                f"got {self.dp_shard}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp * self.ep

    @property
    def dims(self) -> dict[str, int]:
        """``{"tp", "pp", "dp", "cp", "ep"}`` (ok.plan's convention, see module doc)."""
        return {name: getattr(self, name) for name in DIMS}

    @property
    def batch_replicas(self) -> int:
        """Data-parallel replicas that read different batches: ``dp x ep``."""
        return self.dp * self.ep

    @property
    def megatron_dp(self) -> int:
        """Megatron-LM's / torchtitan's data-parallel size for these sizes: ``dp x ep``."""
        return self.dp * self.ep

    @property
    def global_batch(self) -> int:
        """Sequences per step."""
        return self.micro_batch * self.num_micro_batches * self.batch_replicas

    @property
    def sequence_parallel(self) -> bool:
        """Megatron sequence parallelism: on whenever tp > 1 (same traffic, less memory)."""
        return self.tp > 1

    @property
    def pipeline_schedule(self) -> str | None:
        """The schedule its pipeline runs: ``schedule``, else 1F1B, or interleaved 1F1B with
        ``virtual_stages > 1``; None without a pipeline."""
        if self.pp == 1:
            return None
        if self.schedule is not None:
            return self.schedule
        return INTERLEAVED_1F1B if self.virtual_stages > 1 else ONE_F_ONE_B

    @property
    def pipeline_chunks(self) -> int:
        """Model chunks the pipeline cuts the layers into: ``pp x virtual_stages``."""
        return self.pp * self.virtual_stages

    def describe(self) -> str:
        dims = " ".join(f"{k}={v}" for k, v in self.dims.items())
        shard = f"hsdp(shard {self.dp_shard})" if self.sharding == "hsdp" else self.sharding
        stages = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        recompute = self.recompute
        if self.recompute_layers is not None:
            recompute += f"({self.recompute_layers} layers)"
        schedule = f" {self.schedule}" if self.schedule else ""
        return (
            f"{dims} mb={self.micro_batch}x{self.num_micro_batches}{stages}{schedule} "
            f"recompute={recompute} {shard}"
        )

    def recomputed_share(self, stage_layers: int) -> float:
        """Share of a pipeline rank's ``stage_layers`` layers whose forward is recomputed (full
        recomputation: ``recompute_layers`` of each of its ``virtual_stages`` chunks)."""
        if self.recompute != "full":
            return 0.0
        if self.recompute_layers is None:
            return 1.0
        return min(1.0, self.recompute_layers * self.virtual_stages / stage_layers)
