"""What one device can hold and compute: memory, peak dense TFLOP/s, memory bandwidth.

A preset's optional ``accelerator:`` section fills it (vendor specifications; each preset cites
its figures)::

    accelerator:
      name: H100-SXM              # the family the planner keys its defaults by
      memory: 80GB                # per device (10^9 bytes)
      peak_bf16_tflops: 989       # dense (no sparsity)
      peak_fp8_tflops: 1979       # dense; omit where there is no FP8 tensor core
      memory_bandwidth: 3.35TB/s
      sms: 132                    # streaming multiprocessors (GEMM wave quantization)

``overlapkit plan --gpu-memory-gb`` overrides the memory (DGX A100 ships with 40 or 80 GB per
GPU, H100 with 80 or 96). Peaks are the datasheet's dense figures; what a training step
achieves of them is the planner's business (``autoplan.compute``).

A measured host (``overlapkit calibrate --host``: CPU ranks that compute on the host) also has a
``host:`` section (``HostCosts``), and its peak is the measured rate of a model's forward and
backward on every rank at once, which the planner takes as achieved::

    accelerator:
      name: measured-cpu
      memory: 16GB
      peak_bf16_tflops: 0.0142    # the measured rate (the ranks compute in fp32)
      host:
        collective_overhead: 1.9ms
        tp_layer_dispatch: 3.4ms
        optimizer_tensor: 41us
        optimizer_dtensor: 310us
        optimizer_param: 8ns
        overlap_efficiency: 0.55
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostCosts:
    """What a step costs the host per operation where the ranks compute on it (CPU), seconds.

    Measured by ``overlapkit calibrate --host``; the planner's ``StepOptions`` fields of the same
    names (``autoplan.step_time``) describe each. On GPUs the host runs ahead of the kernels and
    these are 0 (no section).

    Raises:
        ValueError: a negative figure, or an overlap efficiency outside [0, 1], naming it.
    """

    collective_overhead_s: float = 0.0
    """One collective call between ranks that come from computing, beyond its transfer."""
    tp_layer_dispatch_s: float = 0.0
    """One pass through a tensor-parallel layer, beyond its FLOPs and collectives."""
    optimizer_tensor_s: float = 0.0
    """The optimizer step per plain parameter tensor."""
    optimizer_dtensor_s: float = 0.0
    """The optimizer step per DTensor parameter."""
    optimizer_param_s: float | None = None
    """The optimizer step's arithmetic per parameter; None: memory-bound."""
    overlap_efficiency: float | None = None
    """Share of a forward and backward that gradient traffic hides behind; None: the
    collective library's default."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and not value >= 0:
                raise ValueError(f"accelerator.host: {field.name} must be >= 0, got {value!r}")
        if self.overlap_efficiency is not None and self.overlap_efficiency > 1:
            raise ValueError(
                f"accelerator.host: overlap_efficiency must be in [0, 1], got "
                f"{self.overlap_efficiency!r}"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class Accelerator:
    """One device's capacity and speed (vendor specification, per device).

    Raises:
        ValueError: a figure that is not positive, naming it.
    """

    name: str
    """Family name (``A100-SXM``, ``H100-SXM``, ``B200``, ...); the planner's defaults key."""
    memory_GB: float
    """Device memory, GB (10^9 bytes)."""
    peak_bf16_tflops: float
    """Dense BF16 tensor-core peak, TFLOP/s."""
    peak_fp8_tflops: float | None = None
    """Dense FP8 tensor-core peak, TFLOP/s; None where the device has none."""
    memory_bandwidth_GBps: float | None = None
    """Device memory bandwidth, GB/s."""
    sms: int | None = None
    """Streaming multiprocessors: GEMM tiles run in waves of this many (``autoplan.gemm``)."""
    host: HostCosts | None = None
    """A measured host's per-operation costs; None for a device (a GPU's host runs ahead)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("accelerator.name must be a non-empty string")
        for field in (
            "memory_GB",
            "peak_bf16_tflops",
            "peak_fp8_tflops",
            "memory_bandwidth_GBps",
            "sms",
        ):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"accelerator {self.name!r}: {field} must be > 0, got {value!r}")

    def peak_tflops(self, dtype: str) -> float:
        """Dense peak for ``dtype`` (``bf16``/``fp16``/``fp8``), TFLOP/s.

        Raises:
            ValueError: ``fp8`` on a device without an FP8 peak.
        """
        if dtype == "fp8":
            if self.peak_fp8_tflops is None:
                raise ValueError(
                    f"accelerator {self.name!r} has no FP8 peak (peak_fp8_tflops); train in bf16 "
                    "or add accelerator.peak_fp8_tflops to the topology file"
                )
            return self.peak_fp8_tflops
        return self.peak_bf16_tflops

    def with_memory(self, memory_GB: float) -> Accelerator:
        """The same device with ``memory_GB`` of memory (``--gpu-memory-gb``)."""
        return dataclasses.replace(self, memory_GB=memory_GB)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "memory_GB": self.memory_GB,
            "peak_bf16_tflops": self.peak_bf16_tflops,
            "peak_fp8_tflops": self.peak_fp8_tflops,
            "memory_bandwidth_GBps": self.memory_bandwidth_GBps,
            "sms": self.sms,
            "host": None if self.host is None else self.host.to_dict(),
        }
