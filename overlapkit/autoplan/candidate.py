"""A priced layout (``Candidate``: its predicted step and memory) and the search's ranked answer
(``SearchResult``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from overlapkit.autoplan.memory import MemoryBreakdown
from overlapkit.autoplan.step_time import StepTime
from overlapkit.layout import PartialLayout, TrainingLayout


@dataclass(frozen=True, slots=True)
class Candidate:
    """A priced layout: its predicted step and memory."""

    layout: TrainingLayout
    step: StepTime
    memory: MemoryBreakdown
    memory_limit: float
    """The GPU's memory, bytes."""
    seq_len: int
    peak_tflops: float
    """The precision's dense peak, TFLOP/s (what MFU divides by)."""

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory_limit

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.layout.global_batch * self.seq_len / (self.step.step_s * self.layout.world_size)

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.step.model_flops / (self.step.step_s * self.layout.world_size) / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        return self.step.hardware_flops / (self.step.step_s * self.layout.world_size) / 1e12

    @property
    def mfu(self) -> float:
        return self.model_tflops_per_gpu / self.peak_tflops

    def to_dict(self) -> dict:
        """One entry of ``overlapkit plan --auto --json``'s ``candidates`` (keys fixed)."""
        return {
            **layout_dict(self.layout),
            "step_time_s": self.step.step_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu,
            "memory_gb_per_gpu": self.memory.total / 1e9,
            "fits": self.fits,
            "breakdown": {"time": self.step.to_dict(), "memory": self.memory.to_dict()},
        }


def layout_dict(layout: TrainingLayout) -> dict:
    """A layout's choices as ``--json`` spells them (``dims``, ``micro_batch``, ...)."""
    return {
        "dims": layout.dims,
        "micro_batch": layout.micro_batch,
        "num_micro_batches": layout.num_micro_batches,
        "virtual_stages": layout.virtual_stages,
        "recompute": layout.recompute,
        "recompute_layers": layout.recompute_layers,
        "sharding": layout.sharding,
        "dp_shard": layout.dp_shard,
        "schedule": layout.schedule,
    }


def layout_from_dict(record: dict) -> TrainingLayout:
    """The layout ``layout_dict`` wrote (a recorded one read back)."""
    fields = {k: v for k, v in record.items() if k != "dims"}
    return TrainingLayout(**record["dims"], **fields)


@dataclass(slots=True)
class SearchResult:
    """The ranked candidates (best first) and what the search did."""

    candidates: list[Candidate]
    searched: int
    """Layouts considered (memory checked)."""
    timed: int
    """Layouts whose step time was predicted."""
    search_s: float
    estimates: int
    """Cost-model estimates made (the rest came from the per-shape cache)."""
    fixed: PartialLayout = field(default_factory=PartialLayout)
    """The pins the search honoured (``--json``'s ``fixed``: ``fixed.given()``)."""
    refused: int = 0
    """Layouts left out because the framework does not run them (``Framework.refusal``)."""

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


def memory_text(memory: MemoryBreakdown) -> str:
    """``weights 16.1, grads 1, ... GB``: the parts above 5 MB."""
    parts = [
        f"{name.removesuffix('_gb')} {value:.3g}"
        for name, value in memory.to_dict().items()
        if name != "total_gb" and value > 0.005
    ]
    return ", ".join(parts) + " GB"
