"""How fast a device runs a transformer's FLOPs, and how much communication hides behind them.

**Achievable fraction of peak.** A training step's matrix multiplies and attention run at a
fraction of the datasheet's dense peak. ``achievable_fraction`` gives one default per GPU
family: the fraction at which a transformer layer's FLOPs run on one GPU when nothing waits on
the network.
The defaults are the measured best matmul of the family (Stas Bekman's "Maximum Achievable
Matmul FLOPS" table, ml-engineering ``compute/accelerator/README.md``: A100 SXM 267.9 of 312
TFLOPS = 85.9 %, H100 SXM 792.1 of 989 = 80.1 %, B200 1745 of 2250 = 77.6 %) times
``LAYER_OVER_MATMUL``, the share of that a whole layer keeps beyond what the step model prices
(small GEMMs' losses and memory-bound kernels are priced: below). ``LAYER_OVER_MATMUL`` is the
one number fitted to the published runs (``autoplan/data/published_runs.tsv``): it minimises
the squared log error of the rows marked ``fit``
(``autoplan.published_runs.fit_layer_over_matmul``: 0.801, rounded to two digits; 0.779 over
25 rows before the small-layer terms, 0.766 before the medium-size cost model);
``overlapkit plan --auto --validate`` prints every run's error with it, and ``--achievable``
overrides the product (from a measured matmul or step of your own: ``measured_accelerator``
takes a measured rate as the peak, as ``bench/planner_ranking.py`` does on CPU).

**What small GEMMs and memory-bound kernels get** (``gemm_rates``). That rate is the large
GEMMs'; ``autoplan.gemm`` takes wave quantization and, on the families whose GEMM kernels run
one tile per thread block (``SERIAL_TILE_FAMILIES``: A100), the tiles' fixed cost off it.
Kernels bound by device memory run at ``MEMORY_BANDWIDTH_FRACTION`` of the datasheet
bandwidth: a read kernel on an A100 SXM4 80GB reached 1.80 of 2.04 TB/s, 88 % by Nsight
Compute, and the GTC talk that poster cites saw no kernel above about 90 % (NVIDIA developer
forums, "Trouble to Reach Peak Bandwidth of A100", topic 339083).

**Overlap efficiency.** The share of a compute window that data-parallel (and FSDP)
communication can hide in: ``OVERLAP_EFFICIENCY`` per collective library. NCCL runs on its own
SMs beside the compute kernels; gloo's transfers take the same CPU cores as the compute, and
overlapkit's benchmarks measured 0.09-0.46 on this project's two-core machine (README,
"Data-parallel overlap").
"""

from __future__ import annotations

from functools import lru_cache

from overlapkit.autoplan.gemm import GemmRates, tile_k_overhead
from overlapkit.topology.accelerator import Accelerator

MATMUL_FRACTION = {
    "A100-SXM": 267.9 / 312,
    "H100-SXM": 792.1 / 989,
    "H200-SXM": 792.1 / 989,  # same SMs and clocks as H100 SXM; MAMF lists them together
    "H800": 792.1 / 989,  # H100 silicon with fewer NVLink lanes
    "B200": 1745.0 / 2250,
    "B300": 1745.0 / 2250,  # not measured in the table: B200's
    "GB200": 1745.0 / 2250,  # not measured in the table: B200's
    "measured": 1.0,  # measured_accelerator: the peak is a measured rate already
}
FP8_MATMUL_FRACTION = {
    # The same table's FP8 rows: H200 SXM 1453.4 of 1979 (73.4 %), B200 3432.5 of 4500 (76.3 %).
    "H100-SXM": 1453.4 / 1979,
    "H200-SXM": 1453.4 / 1979,
    "H800": 1453.4 / 1979,
    "B200": 3432.5 / 4500,
    "B300": 3432.5 / 4500,
    "GB200": 3432.5 / 4500,
}
DEFAULT_MATMUL_FRACTION = 0.8
"""For a family the table does not list (about H100's)."""
LAYER_OVER_MATMUL = 0.80
"""A transformer layer's FLOP rate over the best matmul's (fitted, see module doc)."""
OVERLAP_EFFICIENCY = {"nccl": 0.9, "gloo": 0.2, "ideal": 1.0}
MEMORY_BANDWIDTH_FRACTION = 0.88
"""Share of the datasheet memory bandwidth a streaming kernel reaches (see module doc)."""
SERIAL_TILE_FAMILIES = frozenset({"A100-SXM"})
"""Families whose cuBLAS GEMM kernels run one output tile per thread block, fill, K loop and
epilogue in turn (Ampere); Hopper's and Blackwell's are persistent and warp-specialised
(``autoplan.gemm``), as is assumed for a family not listed."""


def matmul_fraction(accelerator: Accelerator, dtype: str = "bf16") -> float:
    """The family's best measured matmul as a fraction of ``dtype``'s dense peak."""
    table = FP8_MATMUL_FRACTION if dtype == "fp8" else MATMUL_FRACTION
    default = MATMUL_FRACTION.get(accelerator.name, DEFAULT_MATMUL_FRACTION)
    return table.get(accelerator.name, default)


def achievable_fraction(
    accelerator: Accelerator, dtype: str = "bf16", *, layer_over_matmul: float = LAYER_OVER_MATMUL
) -> float:
    """The default fraction of ``dtype``'s dense peak a transformer layer runs at.

    ``layer_over_matmul`` replaces the fitted ``LAYER_OVER_MATMUL`` (what its fit varies).
    """
    return matmul_fraction(accelerator, dtype) * layer_over_matmul


def achievable_bandwidth(accelerator: Accelerator) -> float | None:
    """Bytes per second a memory-bound kernel moves (None without a datasheet bandwidth)."""
    if not accelerator.memory_bandwidth_GBps:
        return None
    return accelerator.memory_bandwidth_GBps * 1e9 * MEMORY_BANDWIDTH_FRACTION


@lru_cache(maxsize=256)
def gemm_rates(
    accelerator: Accelerator, dtype: str, fraction: float, *, element_bytes: int = 2
) -> GemmRates:
    """How fast ``accelerator`` runs ``dtype`` GEMMs whose large ones reach ``fraction`` of
    the dense peak: wave quantization on its SMs, the memory roofline at the achievable
    bandwidth and, on ``SERIAL_TILE_FAMILIES``, the tiles' fixed cost (``autoplan.gemm``)."""
    peak = accelerator.peak_tflops(dtype) * 1e12
    bandwidth = achievable_bandwidth(accelerator)
    serial = accelerator.name in SERIAL_TILE_FAMILIES and accelerator.sms and bandwidth
    return GemmRates(
        flops_per_s=peak * fraction,
        bytes_per_s=bandwidth,
        element_bytes=element_bytes,
        sms=accelerator.sms,
        k_overhead=tile_k_overhead(peak, bandwidth, element_bytes) if serial else 0.0,
        best_fraction=matmul_fraction(accelerator, dtype),
    )


def overlap_efficiency(library: str) -> float:
    """Share of a compute window that data-parallel communication hides in (see module doc)."""
    return OVERLAP_EFFICIENCY.get(str(library), OVERLAP_EFFICIENCY["nccl"])


def measured_accelerator(tflops: float, *, memory_GB: float, name: str = "measured") -> Accelerator:
    """An ``Accelerator`` whose peak is a measured matmul rate (its achievable fraction is 1)."""
    return Accelerator(name=name, memory_GB=memory_GB, peak_bf16_tflops=tflops)
