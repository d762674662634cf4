"""Warnings for a layout the user chose: tp over the network, slower than the best, not fitting.

``overlapkit plan --auto`` with sizes pinned (``layout_warnings``) and a manual ``overlapkit plan
--tp ...`` (``manual_warnings``) get the same judgment: the chosen layout is compared with the
best the search finds under the same settings (framework, attention, precision).
"""

from __future__ import annotations

import dataclasses

from overlapkit.autoplan.candidate import Candidate, memory_text
from overlapkit.autoplan.group_costs import domain_size
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.search import TIE, search
from overlapkit.autoplan.settings import PlanSearchError, SearchSettings, with_memory
from overlapkit.layout import DIMS, PartialLayout
from overlapkit.planner.placement import Placement, PlacementError
from overlapkit.planner.placement import plan as place
from overlapkit.topology.model import Topology
from overlapkit.topology.units import format_seconds

SLOW_FACTOR = 1.5
"""A chosen layout predicted this much slower than the best gets a warning."""


def layout_warnings(
    topology: Topology,
    model: ModelSpec | None,
    chosen: Candidate | None,
    pins: PartialLayout,
    settings: SearchSettings,
) -> list[str]:
    """Warnings for a layout the user pinned: tp over the network, slow, or not fitting (with
    parallel sizes among the ``pins``: the best layout found with nothing pinned, under
    ``settings``)."""
    out = []
    if chosen is None:
        return out
    layout = chosen.layout
    domain = domain_size(topology)
    if layout.tp > domain:
        out.append(
            f"tp={layout.tp} spans {layout.tp // domain} scale-up domains of {domain}: its "
            f"collectives cross the network, {format_seconds(chosen.step.tp_s)} of exposed tp "
            f"communication per step predicted"
        )
    if not chosen.fits:
        out.append(
            f"predicted not to fit: {chosen.memory.total / 1e9:.3g} GB per GPU of "
            f"{chosen.memory_limit / 1e9:.3g} ({memory_text(chosen.memory)})"
        )
    if model is not None and pins.sizes:
        try:
            free = search(
                topology,
                model,
                global_batch=chosen.layout.global_batch,
                seq_len=chosen.seq_len,
                settings=settings,
                candidates=1,
            ).best
        except PlanSearchError:
            free = None
        if free is not None:
            ratio = chosen.step.step_s / free.step.step_s
            best = (
                f"{free.layout.describe()} ({free.step.step_s:.4g} s per step, "
                f"{free.memory.total / 1e9:.3g} GB per GPU)"
            )
            if not chosen.fits and free.fits:
                out.append(f"the best layout the planner finds that fits: {best}")
            elif ratio >= SLOW_FACTOR or (layout.tp > domain and ratio > 1 + TIE):
                out.append(
                    f"predicted {ratio:.3g}x slower than the best layout the planner finds: {best}"
                )
    return out


def manual_warnings(
    placement: Placement,
    *,
    model: ModelSpec | None,
    global_batch: int | None,
    seq_len: int | None,
    gpu_memory_gb: float | None,
    pins: PartialLayout,
    settings: SearchSettings,
) -> list[str]:
    """``overlapkit plan --tp ...`` without --auto: judge the layout as the auto-planner would.

    Always: a tp group over the network. With ``model`` and ``global_batch``: slower than
    ``SLOW_FACTOR`` x the best, or not fitting (the placement's sizes and the other ``pins``
    fixed, priced under ``settings``).
    """
    topology = placement.topology
    sizes = placement.dims
    domain = domain_size(topology)
    out = []
    if model is None or global_batch is None:
        if sizes["tp"] > domain:
            tp = [c for c in placement.collectives() if c.dim == "tp"]
            total = sum(c.total_s for c in tp)
            inside = place_inside(placement, domain)
            note = ""
            if inside is not None:
                comm = inside.collectives()
                inside_s = sum(c.total_s for c in comm if c.dim == "tp")
                grads_s = sum(c.total_s for c in comm if c.dim == "dp")
                workload = placement.workload
                note = (
                    f", {total / inside_s:.3g}x tp={domain} inside a domain for the same "
                    f"{workload.micro_batch * workload.microbatches} sequences per step "
                    f"({format_seconds(inside_s)}, and {format_seconds(grads_s)} of gradient "
                    f"all-reduce that overlaps backward); better: tp={domain} "
                    f"dp={inside.dims['dp']} pp={inside.dims['pp']}"
                )
            out.append(
                f"tp={sizes['tp']} spans {sizes['tp'] // domain} scale-up domains of {domain}: its "
                f"all-reduces cross the network, {format_seconds(total)} per step predicted for "
                f"{placement.workload.describe()}{note}"
            )
        return out
    topo = with_memory(topology, gpu_memory_gb)
    chosen_sizes = {k: sizes[k] for k in DIMS}
    if "dp_shard" in sizes:
        chosen_sizes |= {"sharding": "hsdp", "dp_shard": sizes["dp_shard"]}
    fixed = PartialLayout(**(pins.given() | chosen_sizes))
    chosen = search(
        topo,
        model,
        global_batch=global_batch,
        seq_len=seq_len or placement.workload.seq_len,
        fixed=fixed,
        settings=settings,
        candidates=1,
    ).best
    return layout_warnings(topo, model, chosen, fixed, settings)


def place_inside(placement: Placement, domain: int) -> Placement | None:
    """The same world and batch with tp shrunk to one domain, the rest to dp.

    ``tp / domain`` times as many replicas share the step's sequences, so each runs that share
    of the micro-batches (the workload is per replica). None when the sequences do not split
    evenly, or the sizes do not place.
    """
    sizes = placement.dims
    factor = sizes["tp"] // domain
    workload = placement.workload
    if workload.microbatches % factor == 0:
        workload = dataclasses.replace(workload, microbatches=workload.microbatches // factor)
    elif workload.micro_batch % factor == 0:
        workload = dataclasses.replace(workload, micro_batch=workload.micro_batch // factor)
    else:
        return None
    try:
        return place(
            placement.topology,
            tp=domain,
            ep=sizes["ep"],
            cp=sizes["cp"],
            pp=sizes["pp"],
            dp=sizes["dp"] * factor,
            workload=workload,
        )
    except PlacementError:
        return None
