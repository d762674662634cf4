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

from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation: none; selective = Korthikanti et al.'s, the attention core
(softmax, its dropout, ``QK^T``) is recomputed in backward; full = the forward of
``recompute_layers`` layers of each stage (all by default), keeping only their inputs (Megatron's
``--recompute-granularity full --recompute-method block --recompute-num-layers``)."""
SHARDING = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
"""Data-parallel state: ddp replicates all; zero1 shards optimizer state (Megatron's
distributed optimizer), zero2 also gradients, fsdp (ZeRO-3) also parameters, hsdp shards over
``dp_shard`` ranks and replicates over the rest."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingLayout:
    """A complete training layout (the auto-planner's candidate).

    Raises:
        ValueError: a size < 1, an unknown recompute or sharding mode, ``dp_shard`` that is
            not a proper divisor of ``dp`` for hsdp (or given without hsdp), naming it.
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
    """full: layers of each pipeline stage recomputed (None: all of them)."""
    sharding: str = "ddp"
    dp_shard: int | None = None
    """hsdp: ranks of one shard group (the inner dp axis)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep", "micro_batch", "num_micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.virtual_stages < 1 or (self.virtual_stages > 1 and self.pp == 1):
            raise ValueError(
                f"virtual_stages ({self.virtual_stages}) must be 1 without pipeline parallelism"
            )
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute {self.recompute!r}; valid: {', '.join(RECOMPUTE)}")
        if self.recompute_layers is not None and (
            self.recompute != "full" or self.recompute_layers < 1
        ):
            raise ValueError(
                f"recompute_layers ({self.recompute_layers}) needs recompute full and >= 1"
            )
        if self.sharding not in SHARDING:
            raise ValueError(f"sharding {self.sharding!r}; valid: {', '.join(SHARDING)}")
        if self.sharding == "hsdp":
            if self.dp_shard is None or not 1 < self.dp_shard < self.dp or self.dp % self.dp_shard:
                raise ValueError(
                    f"hsdp needs dp_shard dividing dp ({self.dp}) with 1 < dp_shard < dp, "
                    f"got {self.dp_shard}"
                )
        elif self.dp_shard is not None:
            raise ValueError(f"dp_shard ({self.dp_shard}) goes with sharding hsdp only")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp * self.ep

    @property
    def dims(self) -> dict[str, int]:
        """``{"tp", "pp", "dp", "cp", "ep"}`` (ok.plan's convention, see module doc)."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp, "ep": self.ep}

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

    def describe(self) -> str:
        dims = " ".join(f"{k}={v}" for k, v in self.dims.items())
        shard = f"hsdp(shard {self.dp_shard})" if self.sharding == "hsdp" else self.sharding
        stages = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        recompute = self.recompute
        if self.recompute_layers is not None:
            recompute += f"({self.recompute_layers} layers)"
        return (
            f"{dims} mb={self.micro_batch}x{self.num_micro_batches}{stages} "
            f"recompute={recompute} {shard}"
        )

    def recomputed_share(self, stage_layers: int) -> float:
        """Share of a stage's layers whose forward is recomputed (full recomputation)."""
        if self.recompute != "full":
            return 0.0
        if self.recompute_layers is None:
            return 1.0
        return min(1.0, self.recompute_layers / stage_layers)
