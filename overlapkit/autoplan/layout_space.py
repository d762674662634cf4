"""Every layout a search request allows, before the framework, memory and time are asked.

``parallel_sizes``: tp dividing a scale-up domain and the attention and key/value heads; cp
dividing the sequence; ep dividing the experts (MoE models); pp at most the layers; dp what is
left of the world (``world = pp x dp x ep x cp x tp``); every block of the traffic order inside a
domain or covering whole ones (``group_costs.blocks_intact``). ``variants``: micro-batch sizes
dividing a replica's sequences per step; interleaving ``v`` (``pp x v <= layers``), on each
schedule the search proposes where it is priced (``pipeline_schedule.priced``: interleaved 1F1B
with the micro-batches a multiple of pp, as Megatron-LM requires; the zero-bubble schedules,
``pipeline_schedule.schedule_variants``, as torch takes them); recomputation
none / selective / full; sharding ddp, zero1, zero2, fsdp and hsdp (every proper ``dp_shard``
of dp). A pinned choice (``PartialLayout``) replaces the options of its own; the rest stay free.
"""

from __future__ import annotations

import itertools
import math

from overlapkit.autoplan.group_costs import TRAFFIC_ORDER, blocks_intact, domain_size
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.pipeline_schedule import priced, schedule_of, schedule_variants
from overlapkit.autoplan.settings import PlanSearchError
from overlapkit.layout import RECOMPUTE, SHARDING, PartialLayout, TrainingLayout
from overlapkit.topology.model import Topology

MAX_MICRO_BATCH = 64
MAX_VIRTUAL_STAGES = 8
MIN_TOKENS_PER_CP_RANK = 2048
"""Free search: context parallelism keeps at least this many tokens per rank (Megatron-Bridge's
recipes use cp = 2 at 8,192 tokens; Llama 3 cp = 16 at 131,072: 4,096 and 8,192 per rank)."""
MAX_HSDP_SHARD_DOMAINS = 8
"""Free search: an HSDP shard group spans at most this many scale-up domains."""


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, increasing."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def parallel_sizes(
    topology: Topology, model: ModelSpec, seq_len: int, pins: PartialLayout
) -> list[dict[str, int]]:
    """Every ``{"tp", "pp", "dp", "cp", "ep"}`` the request allows (see module doc), in order
    of tp, then cp, ep and pp.

    Raises:
        PlanSearchError: pinned sizes that do not divide the world; a pinned tp that does not
            split the heads.
    """
    world = topology.world_size
    _check_pinned_sizes(topology, model, pins)
    free = _free_sizes(topology, model, seq_len)
    options = [[getattr(pins, axis)] if getattr(pins, axis) else free[axis] for axis in free]
    sizes = []
    for tp, cp, ep, pp in itertools.product(*options):
        if world % (tp * cp * ep * pp):
            continue
        dims = {"tp": tp, "pp": pp, "dp": world // (tp * cp * ep * pp), "cp": cp, "ep": ep}
        if pins.dp not in (None, dims["dp"]):
            continue
        if pins.tp is None and not blocks_intact(topology, dims, TRAFFIC_ORDER):
            continue
        sizes.append(dims)
    return sizes


def _check_pinned_sizes(topology: Topology, model: ModelSpec, pins: PartialLayout) -> None:
    pinned = pins.sizes
    product = math.prod(pinned.values())
    if topology.world_size % product:
        named = " x ".join(f"{k}={v}" for k, v in pinned.items())
        raise PlanSearchError(
            f"{named} = {product} does not divide the {topology.world_size} GPUs of "
            f"{topology.name!r}"
        )
    # Tensor parallelism splits the attention heads, and the key/value heads of grouped-query
    # attention with them (Megatron-LM requires num_query_groups % tp == 0).
    if pins.tp is not None and (model.heads % pins.tp or model.kv_heads % pins.tp):
        raise PlanSearchError(
            f"tp={pins.tp} does not divide {model.name}'s {model.heads} attention heads "
            f"and {model.kv_heads} key/value heads: tensor parallelism splits them"
        )


def _free_sizes(topology: Topology, model: ModelSpec, seq_len: int) -> dict[str, list[int]]:
    """What each of tp, cp, ep, pp may be when not pinned (in this order)."""
    world = divisors(topology.world_size)
    domain = domain_size(topology)
    return {
        "tp": [
            tp
            for tp in world
            if model.heads % tp == 0 and model.kv_heads % tp == 0 and domain % tp == 0
        ],
        "cp": [
            cp
            for cp in world
            if seq_len % cp == 0 and (cp == 1 or seq_len // cp >= MIN_TOKENS_PER_CP_RANK)
        ],
        "ep": [ep for ep in world if model.experts % ep == 0] if model.is_moe else [1],
        "pp": [pp for pp in world if pp <= model.layers],
    }


def variants(
    dims: dict[str, int],
    model: ModelSpec,
    global_batch: int,
    pins: PartialLayout,
    domain: int,
    *,
    zero_bubble: bool = False,
) -> list[TrainingLayout]:
    """Every layout of parallel sizes ``dims`` the pins allow (see module doc); none when the
    batch does not split over the ``dp x ep`` replicas. ``zero_bubble``: also on torch's
    zero-bubble schedules (``Framework.zero_bubble_schedules``)."""
    replicas = dims["dp"] * dims["ep"]
    if global_batch % replicas:
        return []  # the caller reports indivisible batches
    per_replica = global_batch // replicas
    out = []
    for micro_batch in _micro_batches(per_replica, pins):
        micro_batches = per_replica // micro_batch
        for virtual_stages, recompute, (sharding, dp_shard) in itertools.product(
            _stage_counts(dims["pp"], micro_batches, model.layers, pins),
            [pins.recompute] if pins.recompute else RECOMPUTE,
            _shardings(dims, pins, domain),
        ):
            out.append(
                TrainingLayout(
                    **dims,
                    micro_batch=micro_batch,
                    num_micro_batches=micro_batches,
                    virtual_stages=virtual_stages,
                    recompute=recompute,
                    recompute_layers=pins.layers_recomputed if recompute == "full" else None,
                    sharding=sharding,
                    dp_shard=dp_shard,
                )
            )
    # A model chunk shorter than the pinned number of layers cannot recompute that many.
    return [
        scheduled
        for layout in out
        if layout.recompute_layers is None
        or layout.recompute_layers <= chunk_layers(model.layers, layout)
        for scheduled in (layout, *(schedule_variants(layout) if zero_bubble else ()))
        if priced(schedule_of(scheduled), scheduled)
        and pins.schedule in (None, scheduled.pipeline_schedule)
    ]


def chunk_layers(layers: int, layout: TrainingLayout) -> int:
    """Layers of the fullest model chunk: ``ceil(layers / (pp x v))``."""
    return math.ceil(layers / layout.pipeline_chunks)


def _micro_batches(per_replica: int, pins: PartialLayout) -> list[int]:
    if pins.micro_batch is not None:
        return [pins.micro_batch] if per_replica % pins.micro_batch == 0 else []
    return [size for size in divisors(per_replica) if size <= MAX_MICRO_BATCH]


def _stage_counts(pp: int, micro_batches: int, layers: int, pins: PartialLayout) -> list[int]:
    """Interleaving: with pp > 1 and at least pp micro-batches (which schedule prices which
    count, ``variants`` asks ``pipeline_schedule.priced``)."""
    interleaves = pp > 1 and micro_batches >= pp
    if pins.virtual_stages is not None:
        counts = [pins.virtual_stages] if pins.virtual_stages == 1 or interleaves else []
    else:
        more = range(2, MAX_VIRTUAL_STAGES + 1) if interleaves else range(0)
        counts = [1, *(count for count in more if pp * count <= layers)]
    return [count for count in counts if every_stage_has_layers(layers, pp * count, pp)]


def _shardings(
    dims: dict[str, int], pins: PartialLayout, domain: int
) -> list[tuple[str, int | None]]:
    """``(sharding, dp_shard)`` pairs: hsdp once per shard group size the pins allow (a pinned
    ``dp_shard`` is hsdp's)."""
    spread = dims["dp"] * dims["ep"] * dims["cp"] > 1
    shardings = [pins.sharding] if pins.sharding else SHARDING if spread else ("ddp",)
    if pins.dp_shard:
        shardings = [sharding for sharding in shardings if sharding == "hsdp"]
    inner = dims["ep"] * dims["cp"] * dims["tp"]
    shards = [
        shard
        for shard in divisors(dims["dp"])
        if 1 < shard < dims["dp"]
        and (
            pins.dp_shard == shard
            if pins.dp_shard
            else shard * inner <= MAX_HSDP_SHARD_DOMAINS * domain
        )
    ]
    return [
        (sharding, dp_shard)
        for sharding in shardings
        for dp_shard in (shards if sharding == "hsdp" else [None])
    ]


def every_stage_has_layers(layers: int, chunks: int, stages: int) -> bool:
    """Whether ``ceil(layers / chunks)`` layers per model chunk leave every stage some layers.

    Chunks at the end may be short or empty (Megatron-LM fills them with the embedding, the loss
    or multi-token-prediction layers: ``--pipeline-model-parallel-layout``); the fullest stage
    sets the step time either way.
    """
    per_chunk = math.ceil(layers / chunks)
    return (stages - 1) * per_chunk < layers


def no_sizes_message(
    topology: Topology, model: ModelSpec, seq_len: int, pins: PartialLayout
) -> str:
    """Why ``parallel_sizes`` found none: the constraints, with the sizes pinned."""
    given = " ".join(f"--{k} {v}" for k, v in pins.sizes.items()) or "no fixed sizes"
    return (
        f"no parallel layout of {model.name} on {topology.name} ({topology.world_size} GPUs, "
        f"scale-up domains of {domain_size(topology)}) satisfies {given}: tp must divide a "
        f"domain, cp divide --seq-len {seq_len}, ep divide the {model.experts} experts, "
        f"pp be at most the {model.layers} layers"
    )


def batch_message(global_batch: int, sizes: list[dict[str, int]]) -> str:
    """Why no size tuple splits ``global_batch``: the replica counts there are."""
    replicas = sorted({dims["dp"] * dims["ep"] for dims in sizes})
    shown = ", ".join(map(str, replicas[:8])) + (", ..." if len(replicas) > 8 else "")
    return (
        f"--global-batch {global_batch} is not divisible by the data-parallel replicas "
        f"(dp x ep) of any layout here ({shown}); use a multiple of one of them"
    )
