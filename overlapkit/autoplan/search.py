"""The auto-planner's search: every valid layout, pruned by memory, ranked by predicted step time.

Enumerated (``TrainingLayout``): tp dividing a scale-up domain and the attention and key/value
heads; cp dividing the sequence; ep dividing the experts (MoE models); pp with ``pp <= layers``; dp
what is left of the world (``world = pp x dp x ep x cp x tp``, see ``planner.layout``); every block
of the traffic order inside a domain or covering whole ones (``group_costs.blocks_intact``); micro-
batch sizes dividing a replica's sequences per step; interleaving ``v`` (``pp x v <= layers``, the
micro-batches a multiple of pp, as Megatron-LM requires); recomputation none / selective / full (of
as few layers per stage as it takes to fit); sharding ddp, zero1, zero2, fsdp and hsdp (every
proper ``dp_shard`` of dp). Only what the framework runs (``Framework.refusal``) is proposed. A
choice the caller pins (``autoplan.pins``) constrains the search instead of replacing it; a pin the
framework cannot run is refused by name. Memory is checked first (cheap); only layouts that fit are
timed, except with a parallel size fixed, where layouts that fit come first, fastest first, and
when none fits the ones closest to fitting are reported (least memory per GPU, then the fastest).

Candidates are priced analytically per group shape (``autoplan.group_costs``); the rank grid is
built (``ok.plan``) only for the ones shown.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping

from overlapkit.autoplan.candidate import Candidate, SearchResult, memory_text
from overlapkit.autoplan.group_costs import (
    HSDP_ORDER,
    TRAFFIC_ORDER,
    AxisCosts,
    blocks_intact,
    domain_size,
)
from overlapkit.autoplan.memory import (
    MemoryBreakdown,
    layers_per_stage,
)
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.pins import ALL_LAYERS, DIMS, check_pins
from overlapkit.autoplan.settings import PlanSearchError, SearchSettings
from overlapkit.autoplan.step_time import predict_step
from overlapkit.planner.layout import RECOMPUTE, SHARDING, TrainingLayout
from overlapkit.topology.model import Topology

MAX_MICRO_BATCH = 64
MAX_VIRTUAL_STAGES = 8
MIN_TOKENS_PER_CP_RANK = 2048
"""Free search: context parallelism keeps at least this many tokens per rank (Megatron-Bridge's
recipes use cp = 2 at 8,192 tokens; Llama 3 cp = 16 at 131,072: 4,096 and 8,192 per rank)."""
MAX_HSDP_SHARD_DOMAINS = 8
"""Free search: an HSDP shard group spans at most this many scale-up domains."""


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _parallel_sizes(
    topology: Topology, model: ModelSpec, seq_len: int, fixed: dict
) -> list[dict[str, int]]:
    """Every (tp, cp, ep, pp, dp) the request allows, before batch and memory."""
    world = topology.world_size
    d = domain_size(topology)
    fixed_product = math.prod(fixed.get(k, 1) for k in DIMS)
    if world % fixed_product:
        named = " x ".join(f"{k}={fixed[k]}" for k in DIMS if k in fixed)
        raise PlanSearchError(
            f"{named} = {fixed_product} does not divide the {world} GPUs of {topology.name!r}"
        )

    def options(name: str, free: list[int]) -> list[int]:
        return [fixed[name]] if name in fixed else free

    # Tensor parallelism splits the attention heads, and the key/value heads of grouped-query
    # attention with them (Megatron-LM requires num_query_groups % tp == 0).
    if "tp" in fixed and (model.heads % fixed["tp"] or model.kv_heads % fixed["tp"]):
        raise PlanSearchError(
            f"tp={fixed['tp']} does not divide {model.name}'s {model.heads} attention heads "
            f"and {model.kv_heads} key/value heads: tensor parallelism splits them"
        )
    sizes = []
    splits_heads = [t for t in divisors(world) if model.heads % t == 0 and model.kv_heads % t == 0]
    for tp in options("tp", [t for t in splits_heads if t <= d and d % t == 0]):
        if world % tp:
            continue
        cp_free = [
            c
            for c in divisors(world // tp)
            if seq_len % c == 0 and (c == 1 or seq_len // c >= MIN_TOKENS_PER_CP_RANK)
        ]
        for cp in options("cp", cp_free):
            if (world // tp) % cp:
                continue
            rest = world // (tp * cp)
            ep_free = [e for e in divisors(rest) if model.experts % e == 0] if model.is_moe else [1]
            for ep in options("ep", ep_free):
                if rest % ep:
                    continue
                for pp in options("pp", [p for p in divisors(rest // ep) if p <= model.layers]):
                    if (rest // ep) % pp:
                        continue
                    dp = rest // (ep * pp)
                    if "dp" in fixed and fixed["dp"] != dp:
                        continue
                    dims = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep}
                    if any(fixed.get(k, v) != v for k, v in dims.items()):
                        continue
                    if "tp" not in fixed and not blocks_intact(topology, dims, TRAFFIC_ORDER):
                        continue
                    sizes.append(dims)
    return sizes


def _variants(
    dims: dict[str, int], model: ModelSpec, global_batch: int, fixed: dict, domain: int
) -> list[TrainingLayout]:
    replicas = dims["dp"] * dims["ep"]
    if global_batch % replicas:
        return []  # the caller reports indivisible batches
    per_replica = global_batch // replicas
    micro = [b for b in divisors(per_replica) if b <= MAX_MICRO_BATCH]
    if "micro_batch" in fixed:
        micro = [fixed["micro_batch"]] if per_replica % fixed["micro_batch"] == 0 else []
    recompute = list(RECOMPUTE)
    if "recompute" in fixed:
        recompute = [fixed["recompute"]]
    layers = fixed.get("recompute_layers")
    recompute_layers = None if layers in (None, ALL_LAYERS) else layers
    sharding = list(SHARDING) if dims["dp"] * dims["ep"] * dims["cp"] > 1 else ["ddp"]
    if "sharding" in fixed:
        sharding = [fixed["sharding"]]
    pp = dims["pp"]
    out = []
    for b in micro:
        m = per_replica // b
        stages = [1]
        if pp > 1 and m % pp == 0:
            stages += [v for v in range(2, MAX_VIRTUAL_STAGES + 1) if pp * v <= model.layers]
        if "virtual_stages" in fixed:
            v = fixed["virtual_stages"]
            stages = [v] if v == 1 or (pp > 1 and m % pp == 0) else []
        stages = [v for v in stages if every_stage_has_layers(model.layers, pp * v, pp)]
        for v in stages:
            for r in recompute:
                for s in sharding:
                    shards: list[int | None] = [None]
                    if s == "hsdp":
                        inner = dims["ep"] * dims["cp"] * dims["tp"]
                        shards = [
                            z
                            for z in divisors(dims["dp"])
                            if 1 < z < dims["dp"]
                            and (
                                "dp_shard" in fixed or z * inner <= MAX_HSDP_SHARD_DOMAINS * domain
                            )
                        ]
                        if "dp_shard" in fixed:
                            shards = [fixed["dp_shard"]] if fixed["dp_shard"] in shards else []
                    for z in shards:
                        out.append(
                            TrainingLayout(
                                **dims,
                                micro_batch=b,
                                num_micro_batches=m,
                                virtual_stages=v,
                                recompute=r,
                                recompute_layers=recompute_layers if r == "full" else None,
                                sharding=s,
                                dp_shard=z,
                            )
                        )
    # A stage shorter than the pinned number of layers cannot recompute that many.
    return [
        lay
        for lay in out
        if lay.recompute_layers is None or lay.recompute_layers <= layers_per_stage(model, lay)
    ]


def every_stage_has_layers(layers: int, chunks: int, stages: int) -> bool:
    """Whether ``ceil(layers / chunks)`` layers per model chunk leave every stage some layers.

    Chunks at the end may be short or empty (Megatron-LM fills them with the embedding, the loss
    or multi-token-prediction layers: ``--pipeline-model-parallel-layout``); the fullest stage
    sets the step time either way.
    """
    per_chunk = math.ceil(layers / chunks)
    return (stages - 1) * per_chunk < layers


def search(
    topology: Topology,
    model: ModelSpec,
    *,
    global_batch: int,
    seq_len: int,
    fixed: Mapping[str, object] | None = None,
    settings: SearchSettings | None = None,
    candidates: int = 5,
    costs: AxisCosts | None = None,
) -> SearchResult:
    """Rank the layouts of ``model`` on ``topology`` by predicted step time (see module doc).

    Args:
        topology (Topology): with an accelerator section (or ``settings.accelerator``).
        model (ModelSpec): ``autoplan.models.load_model(...)``.
        global_batch (int): sequences per step.
        seq_len (int): tokens per sequence.
        fixed (Mapping): sizes and choices the caller fixes (``{"tp": 8}``,
            ``{"recompute": "full"}``); the rest is searched.
        settings (SearchSettings): precision, attention kernel, efficiencies.
        candidates (int): how many to return. Defaults to 5.

    Returns:
        SearchResult: best first; only layouts that fit, unless a parallel size is fixed
            (then, when none fits, the closest to fitting: least memory per GPU first).

    Raises:
        PlanSearchError: (a ValueError) fixed sizes that do not divide the world, a global
            batch no layout divides, a model that fits nowhere (with the smallest need).
        ValueError: a bad argument, naming it.
    """
    start = time.perf_counter()
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
    if candidates < 1:
        raise ValueError(f"--candidates must be >= 1, got {candidates}")
    fixed = check_pins(fixed or {})
    layers = fixed.get("recompute_layers", ALL_LAYERS)
    if layers != ALL_LAYERS and layers > model.layers:
        raise ValueError(
            f"--recompute full:{layers}: {model.name} has {model.layers} layers (K counts the "
            "layers of each pipeline stage)"
        )
    settings = settings or SearchSettings()
    framework = settings.framework
    options = settings.step_options(topology, seq_len)
    limit = options.accelerator.memory_GB * 1e9
    peak = options.accelerator.peak_tflops(settings.precision.matmul_dtype)
    costs = costs or AxisCosts(topology)
    # With a parallel size fixed the user asks about a layout: report it even if it does not fit.
    dims_fixed = any(k in fixed for k in DIMS)
    sizes = _parallel_sizes(topology, model, seq_len, fixed)

    def measure(layout: TrainingLayout) -> MemoryBreakdown:
        return settings.memory(model, layout, seq_len)

    if not sizes:
        raise PlanSearchError(_no_sizes_message(topology, model, seq_len, fixed))
    searched = timed = refused = 0
    refusals: list[str] | None = None  # what every refused layout lacks
    first_refusal: list[str] = []
    fitting: list[Candidate] = []
    smallest: tuple[float, TrainingLayout, MemoryBreakdown] | None = None
    divisible = False
    for dims in sizes:
        layouts = _variants(dims, model, global_batch, fixed, domain_size(topology))
        divisible = divisible or global_batch % (dims["dp"] * dims["ep"]) == 0
        for layout in layouts:
            lacks = framework.lacks(layout, layers=model.layers)
            if lacks:
                refused += 1
                first_refusal = first_refusal or lacks
                refusals = lacks if refusals is None else [r for r in refusals if r in lacks]
                continue
            searched += 1
            memory = measure(layout)
            if (
                layout.recompute == "full"
                and "recompute_layers" not in fixed
                and framework.partial_full_recompute
            ):
                layout, memory = _fewest_recomputed(layout, memory, measure, limit, model)
            if smallest is None or memory.total < smallest[0]:
                smallest = (memory.total, layout, memory)
            if memory.total > limit and not dims_fixed:
                continue
            timed += 1
            step = predict_step(model, layout, options, costs)
            fitting.append(Candidate(layout, step, memory, limit, seq_len, peak))
    if not divisible:
        raise PlanSearchError(_batch_message(global_batch, sizes))
    if smallest is None and refused:
        lacking = (
            f"does not run {', '.join(refusals)}, which the pins ask for"
            if refusals
            else f"runs none of the layouts the pins allow (one lacks {', '.join(first_refusal)})"
        )
        raise PlanSearchError(
            f"--framework {framework.name} {lacking} ({_fixed_text(fixed)}); drop the pin or "
            "name another --framework"
        )
    if smallest is None:
        raise PlanSearchError(
            f"no variant of the fixed layout exists: {_fixed_text(fixed)} (micro-batch sizes "
            f"dividing the {global_batch} sequences, interleaving (pp > 1, micro-batches a "
            f"multiple of pp) that leaves every pipeline stage some of the {model.layers} "
            "layers, and as many as --recompute full:K's K)"
        )
    if not fitting:
        assert smallest is not None
        total, layout, memory = smallest
        raise PlanSearchError(
            f"{model.name} ({model.params / 1e9:.4g}B parameters) fits nowhere on "
            f"{topology.name} ({topology.world_size} GPUs of {limit / 1e9:.4g} GB): the "
            f"smallest layout ({layout.describe()}) needs {total / 1e9:.4g} GB per GPU "
            f"({memory_text(memory)}). Use more GPUs, a shorter --seq-len, or a larger "
            "--gpu-memory-gb"
        )
    fitting.sort(key=_rank_key)
    return SearchResult(
        candidates=_distinct(fitting, candidates),
        searched=searched,
        timed=timed,
        search_s=time.perf_counter() - start,
        estimates=costs.estimates,
        fixed=fixed,
        refused=refused,
    )


def searched_layouts(
    topology: Topology,
    model: ModelSpec,
    *,
    global_batch: int,
    seq_len: int,
    fixed: Mapping[str, object] | None = None,
    settings: SearchSettings | None = None,
) -> list[TrainingLayout]:
    """Every layout ``search`` would price for this request: those enumerated that the
    framework runs, before memory (and before full recomputation is cut to as few layers as
    fit, so full layouts recompute every layer unless ``recompute_layers`` is pinned)."""
    fixed = check_pins(fixed or {})
    framework = (settings or SearchSettings()).framework
    return [
        layout
        for dims in _parallel_sizes(topology, model, seq_len, fixed)
        for layout in _variants(dims, model, global_batch, fixed, domain_size(topology))
        if not framework.lacks(layout, layers=model.layers)
    ]


def price(
    topology: Topology,
    model: ModelSpec,
    layout: TrainingLayout,
    *,
    seq_len: int,
    settings: SearchSettings,
    costs: AxisCosts | None = None,
) -> Candidate:
    """One layout's predicted step and memory under ``settings``, as the search prices it."""
    options = settings.step_options(topology, seq_len)
    step = predict_step(model, layout, options, costs or AxisCosts(topology))
    return Candidate(
        layout,
        step,
        settings.memory(model, layout, seq_len),
        options.accelerator.memory_GB * 1e9,
        seq_len,
        options.accelerator.peak_tflops(settings.precision.matmul_dtype),
    )


def _fewest_recomputed(
    layout: TrainingLayout,
    full: MemoryBreakdown,
    measure,
    limit: float,
    model: ModelSpec,
) -> tuple[TrainingLayout, MemoryBreakdown]:
    """Full recomputation of only as many layers per stage as it takes to fit.

    Memory is affine in the number of recomputed layers, so the count comes from the memory
    without recomputation and with all of it, then is checked.
    """
    if full.total > limit:
        return layout, full
    stage_layers = layers_per_stage(model, layout)
    none = measure(dataclasses.replace(layout, recompute="none"))
    if none.total <= limit or none.total <= full.total:
        return layout, full  # recomputation is not needed: the none variant is searched too
    k = max(1, math.ceil(stage_layers * (none.total - limit) / (none.total - full.total)))
    while k < stage_layers:
        partial = dataclasses.replace(layout, recompute_layers=k)
        memory = measure(partial)
        if memory.total <= limit:
            return partial, memory
        k += 1
    return layout, full


TIE = 1e-3
"""Step times within this fraction count as a tie, broken by the simpler layout."""


def _rank_key(candidate: Candidate) -> tuple:
    # What does not fit comes after what does, the closest to fitting first (least memory per
    # GPU, then the faster): with sizes fixed and nothing fitting, that is the variant to try.
    if not candidate.fits:
        return (True, candidate.memory.total, candidate.step.step_s)
    # Equal predictions (cp = 2 with twice the micro-batch computes the same as cp = 1) go
    # to the layout with fewer parallel dimensions, then to the less sharded one, then to
    # fewer micro-batches (each launches every kernel again: on a measured host, whose rate
    # is one micro-batch size's, the model does not see that).
    lay = candidate.layout
    dims = sum(size > 1 for name, size in lay.dims.items() if name != "dp")
    return (
        False,
        round(math.log(candidate.step.step_s) / math.log1p(TIE)),
        dims,
        SHARDING.index(lay.sharding),
        lay.num_micro_batches,
        candidate.step.step_s,
    )


def _distinct(ranked: list[Candidate], count: int) -> list[Candidate]:
    """The best ``count`` that differ: at most two per parallel-size tuple, and none that ties
    with a listed one of the same tp, pp, ep, recomputation and sharding (cp traded for
    micro-batch size computes the same)."""
    out: list[Candidate] = []
    per_dims: dict[tuple, int] = {}
    for candidate in ranked:
        lay = candidate.layout
        key = tuple(lay.dims.values())
        kind = (lay.tp, lay.pp, lay.ep, lay.recompute, lay.sharding)
        if per_dims.get(key, 0) >= 2:
            continue
        if any(
            (o.layout.tp, o.layout.pp, o.layout.ep, o.layout.recompute, o.layout.sharding) == kind
            and candidate.step.step_s <= o.step.step_s * (1 + TIE)
            for o in out
        ):
            continue
        per_dims[key] = per_dims.get(key, 0) + 1
        out.append(candidate)
        if len(out) == count:
            break
    return out


def _fixed_text(fixed: dict) -> str:
    pins = {k: v for k, v in fixed.items() if k != "recompute_layers"}
    if "recompute_layers" in fixed:
        pins["recompute"] = f"full:{fixed['recompute_layers']}"
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in pins.items()) or "none fixed"


def _batch_message(global_batch: int, sizes: list[dict[str, int]]) -> str:
    replicas = sorted({s["dp"] * s["ep"] for s in sizes})
    shown = ", ".join(map(str, replicas[:8])) + (", ..." if len(replicas) > 8 else "")
    return (
        f"--global-batch {global_batch} is not divisible by the data-parallel replicas "
        f"(dp x ep) of any layout here ({shown}); use a multiple of one of them"
    )


def _no_sizes_message(topology: Topology, model: ModelSpec, seq_len: int, fixed: dict) -> str:
    given = " ".join(f"--{k} {v}" for k, v in fixed.items() if k in DIMS) or "no fixed sizes"
    return (
        f"no parallel layout of {model.name} on {topology.name} ({topology.world_size} GPUs, "
        f"scale-up domains of {domain_size(topology)}) satisfies {given}: tp must divide a "
        f"domain, cp divide --seq-len {seq_len}, ep divide the {model.experts} experts, "
        f"pp be at most the {model.layers} layers"
    )


def order_for(layout: TrainingLayout) -> tuple[str, ...]:
    """The mesh axis order the placement of ``layout`` uses."""
    return HSDP_ORDER if layout.sharding == "hsdp" else TRAFFIC_ORDER
