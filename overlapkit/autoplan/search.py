"""The auto-planner's search: every layout a request allows (``autoplan.layout_space``) that the
framework runs (``Framework.lacks``), pruned by memory, ranked by predicted step time.

Memory is checked first (cheap); only layouts that fit are timed, except with a parallel size
pinned, where the layouts that fit come first, fastest first, and when none fits the ones
closest to fitting are reported (least memory per GPU, then the fastest). Candidates are priced
analytically per group shape (``autoplan.group_costs``); the rank grid is built (``ok.plan``)
only for the ones shown.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from overlapkit.autoplan.candidate import Candidate, SearchResult, memory_text
from overlapkit.autoplan.group_costs import AxisCosts, domain_size
from overlapkit.autoplan.layout_space import (
    batch_message,
    chunk_layers,
    no_sizes_message,
    parallel_sizes,
    variants,
)
from overlapkit.autoplan.memory import MemoryBreakdown
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.pins import cli_flag, pins_from, pins_text
from overlapkit.autoplan.pipeline_schedule import SHAPES, ZERO_BUBBLE_SCHEDULES
from overlapkit.autoplan.settings import PlanSearchError, SearchSettings
from overlapkit.autoplan.step_time import StepOptions, predict_step
from overlapkit.layout import SHARDING, PartialLayout, TrainingLayout
from overlapkit.topology.model import Topology

Pins = PartialLayout | Mapping[str, object] | None
"""What the caller fixes: a ``PartialLayout``, or its keywords (``{"tp": 8}``); None: nothing."""


def as_pins(fixed: Pins) -> PartialLayout:
    """``fixed`` as a ``PartialLayout`` (a mapping checked as ``ok.plan``'s keywords)."""
    return fixed if isinstance(fixed, PartialLayout) else pins_from(fixed or {})


@dataclass(frozen=True, slots=True)
class Pricing:
    """How the search prices a layout of ``model`` on ``topology`` under ``settings``."""

    topology: Topology
    model: ModelSpec
    seq_len: int
    settings: SearchSettings
    options: StepOptions
    costs: AxisCosts

    @classmethod
    def of(
        cls,
        topology: Topology,
        model: ModelSpec,
        seq_len: int,
        settings: SearchSettings,
        costs: AxisCosts | None = None,
    ) -> Pricing:
        """The pricing of ``model`` on ``topology`` (``costs``: a cache to share; None: a new one).

        Raises:
            PlanSearchError: a topology without an accelerator section
                (``SearchSettings.step_options``).
        """
        options = settings.step_options(topology, seq_len)
        return cls(topology, model, seq_len, settings, options, costs or AxisCosts(topology))

    @property
    def memory_limit(self) -> float:
        """The GPU's memory, bytes."""
        return self.options.accelerator.memory_GB * 1e9

    def modes(self, layout: TrainingLayout) -> list[StepOptions]:
        """The step options of each in-layer mode to price ``layout`` in: every one of the
        framework's ``ep_chunk_choices`` with ep > 1 and ``tp_comm_choices`` with tp > 1 (``split``
        where ``tp_chunks`` divides the micro-batch), unless the settings fix them."""
        settings, framework = self.settings, self.settings.framework
        chunks = [self.options.ep_chunks]
        if layout.ep > 1 and settings.ep_chunks is None:
            chunks = list(framework.ep_chunk_choices)
        comms = [self.options.tp_comm]
        if layout.tp > 1 and settings.tp_comm is None:
            comms = [
                c
                for c in framework.tp_comm_choices
                if c != "split" or layout.micro_batch % settings.tp_chunks == 0
            ]
        return [
            dataclasses.replace(self.options, ep_chunks=n, tp_comm=c) for n in chunks for c in comms
        ]

    def memory(self, layout: TrainingLayout) -> MemoryBreakdown:
        return self.settings.memory(self.model, layout, self.seq_len)

    def candidate(self, layout: TrainingLayout, memory: MemoryBreakdown) -> Candidate:
        """``layout`` timed in its fastest mode (``modes``), with its ``memory``."""
        step = min(
            (
                predict_step(self.model, layout, options, self.costs)
                for options in self.modes(layout)
            ),
            key=lambda priced: priced.step_s,
        )
        peak = self.options.accelerator.peak_tflops(self.settings.precision.matmul_dtype)
        return Candidate(layout, step, memory, self.memory_limit, self.seq_len, peak)


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
    pricing = Pricing.of(topology, model, seq_len, settings, costs)
    return pricing.candidate(layout, pricing.memory(layout))


@dataclass
class _Tally:
    """What the search met: the layouts the framework refused, those measured and timed."""

    searched: int = 0
    timed: int = 0
    refused: int = 0
    lacked_by_all: list[str] | None = None
    """What every refused layout lacks (None: none refused yet)."""
    lacked_first: list[str] = field(default_factory=list)
    smallest: tuple[TrainingLayout, MemoryBreakdown] | None = None
    """The layout needing the least memory per GPU."""
    priced: list[Candidate] = field(default_factory=list)

    def refuse(self, lacks: list[str]) -> None:
        self.refused += 1
        self.lacked_first = self.lacked_first or lacks
        common = self.lacked_by_all
        self.lacked_by_all = lacks if common is None else [r for r in common if r in lacks]

    def measured(self, layout: TrainingLayout, memory: MemoryBreakdown) -> None:
        self.searched += 1
        if self.smallest is None or memory.total < self.smallest[1].total:
            self.smallest = (layout, memory)


def search(
    topology: Topology,
    model: ModelSpec,
    *,
    global_batch: int,
    seq_len: int,
    fixed: Pins = None,
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
        fixed (PartialLayout | Mapping): what the caller pins (``PartialLayout(tp=8)``,
            ``{"recompute": "full"}``); the rest is searched.
        settings (SearchSettings): precision, attention kernel, efficiencies, framework.
        candidates (int): how many to return. Defaults to 5.

    Returns:
        SearchResult: best first; only layouts that fit, unless a parallel size is pinned
            (then, when none fits, the closest to fitting: least memory per GPU first).

    Raises:
        PlanSearchError: (a ValueError) pinned sizes that do not divide the world, a global
            batch no layout divides, pins the framework does not run, a model that fits
            nowhere (with the smallest need).
        ValueError: a bad argument, naming it.
    """
    start = time.perf_counter()
    pins = _checked_request(model, global_batch, seq_len, candidates, as_pins(fixed))
    pricing = Pricing.of(topology, model, seq_len, settings or SearchSettings(), costs)
    framework = pricing.settings.framework
    if pins.schedule in ZERO_BUBBLE_SCHEDULES and not framework.zero_bubble_schedules:
        raise PlanSearchError(
            f"--schedule {pins.schedule}: {framework.name} does not run torch's zero-bubble "
            "schedules; --framework overlapkit-train or torchtitan does"
        )
    sizes = parallel_sizes(topology, model, seq_len, pins)
    if not sizes:
        raise PlanSearchError(no_sizes_message(topology, model, seq_len, pins))
    tally = _Tally()
    zero_bubble = framework.zero_bubble_schedules
    domain = domain_size(topology)
    for dims in sizes:
        for layout in variants(dims, model, global_batch, pins, domain, zero_bubble=zero_bubble):
            _consider(layout, pricing, pins, tally)
    if not any(global_batch % (dims["dp"] * dims["ep"]) == 0 for dims in sizes):
        raise PlanSearchError(batch_message(global_batch, sizes))
    _refuse_when_empty(tally, pricing, pins, global_batch)
    tally.priced.sort(key=_rank_key)
    return SearchResult(
        candidates=_distinct(tally.priced, candidates),
        searched=tally.searched,
        timed=tally.timed,
        search_s=time.perf_counter() - start,
        estimates=pricing.costs.estimates,
        fixed=pins,
        refused=tally.refused,
    )


def _checked_request(
    model: ModelSpec, global_batch: int, seq_len: int, candidates: int, pins: PartialLayout
) -> PartialLayout:
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{cli_flag(name)} must be an integer >= 1, got {value!r}")
    if candidates < 1:
        raise ValueError(f"--candidates must be >= 1, got {candidates}")
    layers = pins.layers_recomputed
    if layers is not None and layers > model.layers:
        raise ValueError(
            f"--recompute full:{layers}: {model.name} has {model.layers} layers (K counts the "
            "layers of each pipeline stage's model chunk)"
        )
    if pins.schedule is not None and pins.schedule not in SHAPES:
        raise ValueError(
            f"--schedule {pins.schedule!r} is not a schedule the planner prices; valid: "
            f"{', '.join(SHAPES)}"
        )
    return pins


def _consider(layout: TrainingLayout, pricing: Pricing, pins: PartialLayout, tally: _Tally) -> None:
    """Refuse, measure and (when it fits, or sizes are pinned) time ``layout``."""
    framework = pricing.settings.framework
    lacks = framework.lacks(layout, layers=pricing.model.layers)
    if lacks:
        tally.refuse(lacks)
        return
    memory = pricing.memory(layout)
    if layout.recompute == "full" and pins.recompute_layers is None:
        layout, memory = _fewest_recomputed(layout, memory, pricing)
    tally.measured(layout, memory)
    if memory.total > pricing.memory_limit and not pins.sizes:
        return
    tally.timed += 1
    tally.priced.append(pricing.candidate(layout, memory))


def _fewest_recomputed(
    layout: TrainingLayout, full: MemoryBreakdown, pricing: Pricing
) -> tuple[TrainingLayout, MemoryBreakdown]:
    """Full recomputation of only as many layers of each model chunk as it takes to fit (where
    the framework recomputes some layers of a chunk).

    Memory is affine in the number of recomputed layers, so the count comes from the memory
    without recomputation and with all of it, then is checked.
    """
    limit, framework = pricing.memory_limit, pricing.settings.framework
    some = dataclasses.replace(layout, recompute_layers=1)
    if full.total > limit or framework.lacks(some, layers=pricing.model.layers):
        return layout, full
    layers = chunk_layers(pricing.model.layers, layout)
    none = pricing.memory(dataclasses.replace(layout, recompute="none"))
    if none.total <= limit or none.total <= full.total:
        return layout, full  # recomputation is not needed: the none variant is searched too
    count = max(1, math.ceil(layers * (none.total - limit) / (none.total - full.total)))
    while count < layers:
        partial = dataclasses.replace(layout, recompute_layers=count)
        memory = pricing.memory(partial)
        if memory.total <= limit:
            return partial, memory
        count += 1
    return layout, full


def _refuse_when_empty(
    tally: _Tally, pricing: Pricing, pins: PartialLayout, global_batch: int
) -> None:
    """Raise why nothing was priced: the framework, the pins, or the memory."""
    model, topology = pricing.model, pricing.topology
    if tally.smallest is None and tally.refused:
        common = tally.lacked_by_all
        lacking = (
            f"does not run {', '.join(common)}, which the pins ask for"
            if common
            else f"runs none of the layouts the pins allow (one lacks "
            f"{', '.join(tally.lacked_first)})"
        )
        raise PlanSearchError(
            f"--framework {pricing.settings.framework.name} {lacking} ({pins_text(pins)}); "
            "drop the pin or name another --framework"
        )
    if tally.smallest is None:
        raise PlanSearchError(
            f"no variant of the fixed layout exists: {pins_text(pins)} (micro-batch sizes "
            f"dividing the {global_batch} sequences, interleaving (pp > 1, micro-batches a "
            f"multiple of pp) that leaves every pipeline stage some of the {model.layers} "
            "layers, and as many as --recompute full:K's K)"
        )
    if not tally.priced:
        layout, memory = tally.smallest
        limit = pricing.memory_limit
        raise PlanSearchError(
            f"{model.name} ({model.params / 1e9:.4g}B parameters) fits nowhere on "
            f"{topology.name} ({topology.world_size} GPUs of {limit / 1e9:.4g} GB): the "
            f"smallest layout ({layout.describe()}) needs {memory.total / 1e9:.4g} GB per GPU "
            f"({memory_text(memory)}). Use more GPUs, a shorter --seq-len, or a larger "
            "--gpu-memory-gb"
        )


def searched_layouts(
    topology: Topology,
    model: ModelSpec,
    *,
    global_batch: int,
    seq_len: int,
    fixed: Pins = None,
    settings: SearchSettings | None = None,
) -> list[TrainingLayout]:
    """Every layout ``search`` would price for this request: those enumerated that the
    framework runs, before memory (and before full recomputation is cut to as few layers as
    fit, so full layouts recompute every layer unless ``recompute_layers`` is pinned)."""
    pins = as_pins(fixed)
    framework = (settings or SearchSettings()).framework
    return [
        layout
        for dims in parallel_sizes(topology, model, seq_len, pins)
        for layout in variants(
            dims,
            model,
            global_batch,
            pins,
            domain_size(topology),
            zero_bubble=framework.zero_bubble_schedules,
        )
        if not framework.lacks(layout, layers=model.layers)
    ]


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
    layout = candidate.layout
    dims = sum(size > 1 for name, size in layout.dims.items() if name != "dp")
    return (
        False,
        round(math.log(candidate.step.step_s) / math.log1p(TIE)),
        dims,
        SHARDING.index(layout.sharding),
        layout.num_micro_batches,
        candidate.step.step_s,
    )


def _kind(layout: TrainingLayout) -> tuple:
    """What a tie within ``TIE`` must differ in to be listed: tp, pp, ep, recompute, sharding."""
    return (layout.tp, layout.pp, layout.ep, layout.recompute, layout.sharding)


def _distinct(ranked: list[Candidate], count: int) -> list[Candidate]:
    """The best ``count`` that differ: at most two per parallel-size tuple, and none that ties
    with a listed one of the same ``_kind`` (cp traded for micro-batch size computes the
    same)."""
    out: list[Candidate] = []
    per_dims: dict[tuple, int] = {}
    for candidate in ranked:
        key = tuple(candidate.layout.dims.values())
        if per_dims.get(key, 0) >= 2:
            continue
        if any(
            _kind(listed.layout) == _kind(candidate.layout)
            and candidate.step.step_s <= listed.step.step_s * (1 + TIE)
            for listed in out
        ):
            continue
        per_dims[key] = per_dims.get(key, 0) + 1
        out.append(candidate)
        if len(out) == count:
            break
    return out
