"""What the auto-planner assumes about a training run (``SearchSettings``) and its refusal
(``PlanSearchError``): precision, flash attention, achievable fraction of peak, overlap, and
the framework that runs the layouts (``autoplan.framework``): it prices them and says which
the search may propose."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from overlapkit.autoplan.compute import LAYER_OVER_MATMUL, achievable_fraction, overlap_efficiency
from overlapkit.autoplan.framework import MEGATRON, Framework, framework_named
from overlapkit.autoplan.memory import BF16, MemoryBreakdown, Precision, memory_breakdown
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.step_time import StepOptions
from overlapkit.layout import TrainingLayout
from overlapkit.topology.accelerator import Accelerator
from overlapkit.topology.model import Topology

ATTENTION = ("flash", "softmax")
"""``--attention``: flash attention (never stores the softmax) or the softmax materialised."""


class PlanSearchError(ValueError):
    """No layout satisfies the request; the message says which constraint failed."""


def flash_attention_of(attention: str) -> bool:
    """``flash`` -> True, ``softmax`` -> False (``--attention``, ``ok.plan(attention=)``).

    Raises:
        ValueError: another value, naming it and the valid ones.
    """
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r}; valid: {', '.join(ATTENTION)}")
    return attention == "flash"


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchSettings:
    """What the search assumes about the training run (defaults: bf16, flash attention)."""

    precision: Precision = BF16
    flash_attention: bool = True
    achievable: float | None = None
    """Fraction of dense peak; None: the GPU family's default (``autoplan.compute``)."""
    layer_over_matmul: float = LAYER_OVER_MATMUL
    """The family default's share of the best matmul (``autoplan.compute``; fitted)."""
    overlap_efficiency: float | None = None
    """None: the topology library's default."""
    tp_overlap: float = 0.0
    ep_overlap: float = 0.0
    ep_chunks: int | None = None
    """Token chunks of overlapkit-train's pipelined ep (``StepOptions.ep_chunks``); None: the
    search prices each of the framework's ``ep_chunk_choices`` and keeps the fastest."""
    tp_comm: str | None = None
    """overlapkit-train's tp mode (``StepOptions.tp_comm``); None: the search prices each of
    the framework's ``tp_comm_choices`` and keeps the fastest."""
    tp_chunks: int = 2
    """With ``tp_comm="split"``: the micro-batch's chunks."""
    fsdp_prefetch: int = 1
    accelerator: Accelerator | None = None
    """Overrides the topology's (a measured CPU, another memory size). An accelerator with a
    ``host`` section (``overlapkit calibrate --host``) gives the step model its per-operation
    host costs and overlap efficiency, and its peak counts as achieved."""
    framework: Framework | str = MEGATRON
    """What runs the layouts (``autoplan.framework``; a ``Framework`` or its name in
    ``FRAMEWORKS``): the search proposes only what it runs and prices it as it splits the
    model. Megatron-LM by default."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "framework", framework_named(self.framework))

    @property
    def attention(self) -> str:
        """``flash`` or ``softmax`` (``--attention``)."""
        return ATTENTION[0] if self.flash_attention else ATTENTION[1]

    def step_options(self, topology: Topology, seq_len: int) -> StepOptions:
        accelerator = self.accelerator or topology.accelerator
        if accelerator is None:
            raise PlanSearchError(
                f"topology {topology.name!r} has no accelerator section (GPU memory, peak "
                "TFLOP/s): add one to the topology file (see overlapkit/topology/accelerator.py)"
                ", or pass accelerator= (a measured rate: autoplan.compute.measured_accelerator)"
            )
        dtype = self.precision.matmul_dtype
        accelerator.peak_tflops(dtype)  # refuses fp8 where there is none
        achievable = self.achievable
        host = accelerator.host
        if host is not None and achievable is None:
            achievable = 1.0  # a measured host's peak is its model's own rate, achieved
        overlap = self.overlap_efficiency
        if overlap is None and host is not None:
            overlap = host.overlap_efficiency
        host_terms = {} if host is None else dataclasses.asdict(host)
        host_terms.pop("overlap_efficiency", None)
        return StepOptions(
            seq_len=seq_len,
            accelerator=accelerator,
            achievable=(
                achievable_fraction(accelerator, layer_over_matmul=self.layer_over_matmul)
                if achievable is None
                else achievable
            ),
            matmul_achievable=(
                achievable_fraction(accelerator, dtype, layer_over_matmul=self.layer_over_matmul)
                if achievable is None
                else achievable
            ),
            overlap_efficiency=(
                overlap_efficiency(str(topology.library)) if overlap is None else overlap
            ),
            precision=self.precision,
            flash_attention=self.flash_attention,
            tp_overlap=self.tp_overlap,
            ep_overlap=self.ep_overlap,
            ep_chunks=self.ep_chunks or 1,
            tp_comm=self.tp_comm or "sync",
            tp_chunks=self.tp_chunks,
            framework=self.framework,
            **host_terms,
        )

    def memory(self, model: ModelSpec, layout: TrainingLayout, seq_len: int) -> MemoryBreakdown:
        """``layout``'s peak memory per GPU under these settings, bytes."""
        return memory_breakdown(
            model,
            layout,
            seq_len=seq_len,
            precision=self.precision,
            flash_attention=self.flash_attention,
            fsdp_prefetch=self.fsdp_prefetch,
            vocab_parallel=self.framework.vocab_parallel,
            selective=self.framework.selective,
            fsdp_gathered_stage=self.framework.fsdp_gathered_across_micro_batches,
        )


def with_memory(topology: Topology, gpu_memory_gb: float | None) -> Topology:
    """``topology`` with its GPUs' memory set (``--gpu-memory-gb``)."""
    if gpu_memory_gb is None:
        return topology
    if not gpu_memory_gb > 0:
        raise ValueError(f"--gpu-memory-gb must be > 0, got {gpu_memory_gb!r}")
    if topology.accelerator is None:
        raise PlanSearchError(
            f"--gpu-memory-gb: topology {topology.name!r} has no accelerator section to set the "
            "memory of (peak TFLOP/s are needed too); add one to the topology file"
        )
    return topology.with_accelerator(topology.accelerator.with_memory(gpu_memory_gb))
