"""What each parallel axis communicates per training step, and what the cost model predicts for it.

The model is a GPT-style transformer trained the Megatron-LM way; per rank and per step
(``microbatches`` micro-batches of ``micro_batch`` sequences of ``seq_len`` tokens), with
``L = ceil(layers / pp)`` layers on a pipeline stage and ``b`` bytes per element:

- **tp**: 2 all-reduces forward (after attention and after the MLP) and 2 backward per layer, each
  of the layer's activations ``micro_batch x seq_len/cp x hidden x b``.
- **cp** (ring attention): all-gather of K and V (``2 x micro_batch x seq_len x hidden/tp x b``,
  gathered) in forward and again in backward, and a reduce-scatter of their gradients, per layer.
- **ep**: all-to-all dispatch and combine, forward and backward, per MoE layer (every layer when
  ``ep > 1``); a rank's send buffer is ``micro_batch x seq_len/cp x hidden x topk x b``.
- **dp**: gradients once per step: the dense share (``1 - expert_fraction`` of ``params``, divided
  by tp x pp) all-reduced over every replica (dp x ep x cp), the expert share (divided by
  tp x pp x ep) over dp x cp. Split for HSDP, the shard axis reduce-scatters the gradients once
  and all-gathers the parameters before each forward and backward; the replicate axes
  all-reduce the shard.
- **pp**: send/recv of activations forward and of their gradients backward, per micro-batch.

Sequence parallelism, activation recomputation and overlap are left out: these are the bytes a
step must move, and ``time_s`` is what the cost model predicts for them with nothing hidden.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from overlapkit.cost.estimate import Estimate, available_algorithms, slowest_estimate
from overlapkit.topology.model import Topology

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# Mixtral 8x7B: 45.1 of its 46.7 B parameters are expert weights (8 experts of 5.6 B, 1.6 B shared).
MIXTRAL_EXPERT_FRACTION = 0.966
# A GPT shape from a parameter count: params ~= 12 x layers x hidden^2 with hidden ~= 128 x
# layers (GPT-3 2.7B: 32 x 2560; Llama-2 7B: 32 x 4096), so layers = (params / (12 x 128^2))^(1/3).
_HIDDEN_PER_LAYER = 128


def dtype_bytes(dtype: str) -> int:
    """Bytes per element: ``bf16``, ``fp16``, ``fp32``, ``fp8`` (torch spellings too)."""
    key = str(dtype).lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not known; valid: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """The model and batch whose communication a placement predicts (see module doc).

    ``layers`` and ``hidden`` default to a GPT shape with ``params ~= 12 x layers x hidden^2``
    and ``hidden ~= 128 x layers`` (7e9 -> 33 layers x 4224).

    Raises:
        ValueError: a field out of range, naming it and its value.
    """

    params: float = 7e9
    """Parameters of the whole model (count, not bytes)."""
    dtype: str = "bf16"
    """Activations and gradients on the wire."""
    layers: int | None = None
    hidden: int | None = None
    seq_len: int = 4096
    """Tokens per sequence."""
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel replica."""
    microbatches: int = 8
    """Micro-batches per step (gradient accumulation, pipeline micro-batches). Gradients are
    reduced once per step while tp/cp/ep/pp traffic grows with micro-batches."""
    topk: int = 2
    """Experts each token is sent to (ep > 1)."""
    expert_fraction: float = MIXTRAL_EXPERT_FRACTION
    """Share of ``params`` in expert weights when ep > 1 (Mixtral 8x7B's by default)."""

    def __post_init__(self) -> None:
        if isinstance(self.params, bool) or not self.params > 0:
            raise ValueError(f"Workload.params must be > 0, got {self.params!r}")
        dtype_bytes(self.dtype)
        for name in ("seq_len", "micro_batch", "microbatches", "topk"):
            _check_count(getattr(self, name), f"Workload.{name}")
        if not 0 <= self.expert_fraction < 1:
            raise ValueError(
                f"Workload.expert_fraction must be in [0, 1), got {self.expert_fraction!r}"
            )
        layers, hidden = self.layers, self.hidden
        for name, value in (("layers", layers), ("hidden", hidden)):
            if value is not None:
                _check_count(value, f"Workload.{name}")
        if layers is None and hidden is None:
            layers = max(1, round((self.params / (12 * _HIDDEN_PER_LAYER**2)) ** (1 / 3)))
        if hidden is None:
            hidden = _round_up(math.sqrt(self.params / (12 * layers)), _HIDDEN_PER_LAYER)
        if layers is None:
            layers = max(1, round(self.params / (12 * hidden**2)))
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "hidden", hidden)

    @property
    def bytes_per_element(self) -> int:
        return dtype_bytes(self.dtype)

    def describe(self) -> str:
        return (
            f"{self.params / 1e9:.4g}B params, {self.dtype}, {self.layers} layers x hidden "
            f"{self.hidden}, {self.microbatches} micro-batch(es) of {self.micro_batch} x "
            f"{self.seq_len} tokens per step"
        )

    def to_dict(self) -> dict:
        return {
            name: getattr(self, name)
            for name in (
                "params",
                "dtype",
                "layers",
                "hidden",
                "seq_len",
                "micro_batch",
                "microbatches",
                "topk",
                "expert_fraction",
            )
        }


def _check_count(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {value!r}")


def _round_up(value: float, multiple: int) -> int:
    return max(multiple, multiple * math.ceil(value / multiple))


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    """One kind of collective an axis runs per step, and its predicted time."""

    dim: str
    """The parallel dimension it belongs to (``tp``, ``cp``, ``ep``, ``dp``, ``pp``)."""
    collective: str
    what: str
    """What moves, for people."""
    nbytes: float
    """Per call, as nccl-tests counts size (see ``cost``), bytes."""
    count: int
    """Calls per step on each rank."""
    axes: tuple[str, ...]
    """The mesh axes its group spans."""
    estimate: Estimate
    """The slowest of the axis's groups (a step waits for it)."""

    @property
    def time_s(self) -> float:
        """Predicted seconds per call."""
        return self.estimate.time_s

    @property
    def total_s(self) -> float:
        """Predicted seconds per step: ``count x time_s``."""
        return self.count * self.estimate.time_s

    def to_dict(self) -> dict:
        return {
            "dim": self.dim,
            "collective": self.collective,
            "bytes": self.nbytes,
            "time_s": self.time_s,
            "count": self.count,
            "total_s": self.total_s,
            "group_size": self.estimate.group_size,
            "axes": list(self.axes),
            "algorithm": self.estimate.algorithm,
            "what": self.what,
        }


GroupsOf = Callable[[tuple[str, ...]], Sequence[Sequence[int]]]


def step_collectives(
    topology: Topology,
    sizes: Mapping[str, int],
    groups_of: GroupsOf,
    workload: Workload,
    *,
    algorithm: str | None = None,
) -> list[CollectiveCost]:
    """Every collective a training step runs, per axis, with the cost model's time.

    Args:
        topology (Topology): where the ranks are.
        sizes (Mapping[str, int]): mesh axis sizes (``dp`` or ``dp_replicate`` + ``dp_shard``).
        groups_of (Callable): the groups spanned by a tuple of axes (``Placement.groups``).
        workload (Workload): the model and batch.
        algorithm (str): force ``ring``, ``tree``, ``hierarchical`` or ``switch`` wherever it
            can run that collective on that group (like ``NCCL_ALGO``); elsewhere, and by
            default, the cost model's fastest.
    """
    step = _Priced(topology, sizes, groups_of, algorithm)
    activations = _activation_bytes(workload, sizes)
    layer_passes = math.ceil(workload.layers / sizes["pp"]) * workload.microbatches
    _model_parallel(step, workload, layer_passes, activations)
    _data_parallel(step, workload)
    step.add(
        "pp",
        "send_recv",
        "activations fwd + gradients bwd",
        activations,
        2 * workload.microbatches,
        ["pp"],
    )
    return step.collectives


class _Priced:
    """Collects a step's collectives, each priced on the slowest group of its axes."""

    def __init__(
        self,
        topology: Topology,
        sizes: Mapping[str, int],
        groups_of: GroupsOf,
        algorithm: str | None,
    ) -> None:
        self.topology = topology
        self.sizes = sizes
        self.groups_of = groups_of
        self.algorithm = algorithm
        self.collectives: list[CollectiveCost] = []

    def add(
        self, dim: str, collective: str, what: str, nbytes: float, count: int, axes: Sequence[str]
    ) -> None:
        """``count`` calls per step of ``collective`` over the axes of ``axes`` above size 1;
        nothing where all are size 1."""
        axes = tuple(a for a in axes if self.sizes[a] > 1)
        if not axes:
            return
        groups = self.groups_of(axes)
        if collective == "send_recv":
            groups = [pair for g in groups for pair in itertools.pairwise(g)]
        estimate = _slowest(collective, nbytes, self.topology, groups, self.algorithm)
        self.collectives.append(
            CollectiveCost(dim, collective, what, nbytes, count, axes, estimate)
        )


def _activation_bytes(workload: Workload, sizes: Mapping[str, int]) -> float:
    """One micro-batch's activations of one layer on a rank (its cp share of the sequence)."""
    return (
        workload.micro_batch
        * workload.seq_len
        / sizes["cp"]
        * workload.hidden
        * workload.bytes_per_element
    )


def _model_parallel(
    step: _Priced, workload: Workload, layer_passes: int, activations: float
) -> None:
    """tp's all-reduces, cp's K/V gathers and gradient scatters, ep's all-to-alls, each per
    layer and micro-batch of the stage (``layer_passes``)."""
    step.add(
        "tp",
        "all_reduce",
        "layer outputs, 2 fwd + 2 bwd per layer",
        activations,
        4 * layer_passes,
        ["tp"],
    )
    kv = (
        2
        * workload.micro_batch
        * workload.seq_len
        * workload.hidden
        / step.sizes["tp"]
        * workload.bytes_per_element
    )
    step.add("cp", "all_gather", "K and V, fwd + bwd per layer", kv, 2 * layer_passes, ["cp"])
    step.add("cp", "reduce_scatter", "dK and dV, bwd per layer", kv, layer_passes, ["cp"])
    step.add(
        "ep",
        "all_to_all",
        "tokens, dispatch + combine fwd + bwd",
        activations * workload.topk,
        4 * layer_passes,
        ["ep"],
    )


def _data_parallel(step: _Priced, workload: Workload) -> None:
    """Per step, the dense and (with ep) the expert gradients' reduction over their replicas:
    an all-reduce, or under HSDP a reduce-scatter and the parameters' all-gathers over
    ``dp_shard`` and the shards' all-reduce over the replicas."""
    sizes = step.sizes
    tp, ep, pp = sizes["tp"], sizes["ep"], sizes["pp"]
    element = workload.bytes_per_element
    expert = workload.expert_fraction if ep > 1 else 0.0
    dense_grads = workload.params * (1 - expert) / (tp * pp) * element
    expert_grads = workload.params * expert / (tp * pp * ep) * element
    shards = [("dense", dense_grads, ("ep", "cp"))]
    if expert:
        shards.append(("expert", expert_grads, ("cp",)))
    for kind, nbytes, others in shards:
        if "dp_shard" not in sizes:
            step.add("dp", "all_reduce", f"{kind} gradients", nbytes, 1, ["dp", *others])
            continue
        gathers = 2 * workload.microbatches
        step.add("dp", "reduce_scatter", f"{kind} gradients", nbytes, 1, ["dp_shard"])
        step.add("dp", "all_gather", f"{kind} parameters, fwd + bwd", nbytes, gathers, ["dp_shard"])
        shard = nbytes / sizes["dp_shard"]
        replicas = ["dp_replicate", *others]
        step.add("dp", "all_reduce", f"{kind} gradient shards", shard, 1, replicas)


def _slowest(
    collective: str,
    nbytes: float,
    topology: Topology,
    groups: Sequence[Sequence[int]],
    algorithm: str | None,
) -> Estimate:
    if algorithm is not None and algorithm in available_algorithms(collective):
        try:
            return slowest_estimate(
                collective, nbytes=nbytes, topology=topology, groups=groups, algorithm=algorithm
            )
        except ValueError:
            logger.info(
                "%s cannot run %s on these groups; using the fastest", algorithm, collective
            )
    return slowest_estimate(collective, nbytes=nbytes, topology=topology, groups=groups)
