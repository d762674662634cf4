"""``overlapkit plan --auto``: the ranked table, why the winner wins, how to run it; and the same
judgment of manual plans (``overlapkit plan --tp 16`` on 8-GPU nodes, a slow or unfitting layout).

The JSON document (keys fixed; extra keys are fine)::

    {"candidates": [{"dims": {"tp", "pp", "dp", "cp", "ep"}, "micro_batch", "num_micro_batches",
                     "virtual_stages", "recompute", "sharding", "step_time_s",
                     "tokens_per_s_per_gpu", "model_tflops_per_gpu", "hardware_tflops_per_gpu",
                     "mfu", "memory_gb_per_gpu", "fits", "breakdown": {...}}, ...],
     "search_s", "searched", "warnings": [...], ...}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from overlapkit.autoplan.auto import AutoPlan, auto_plan
from overlapkit.autoplan.candidate import Candidate, memory_text
from overlapkit.autoplan.framework import OVERLAPKIT_TRAIN
from overlapkit.autoplan.group_costs import domain_size
from overlapkit.autoplan.memory import PRECISIONS
from overlapkit.autoplan.model_spec import ModelSpec
from overlapkit.autoplan.models import load_model
from overlapkit.autoplan.published_runs import render_run_checks, validate
from overlapkit.autoplan.run_config import (
    TRAIN_MODELS,
    torchtitan_config,
    train_lacks,
    train_overrides,
)
from overlapkit.autoplan.search import TIE, price, search
from overlapkit.autoplan.settings import PlanSearchError, SearchSettings, with_memory
from overlapkit.planner.explain import where
from overlapkit.planner.layout import TrainingLayout
from overlapkit.planner.placement import Placement, PlacementError
from overlapkit.planner.placement import plan as place
from overlapkit.topology.model import Topology
from overlapkit.topology.units import format_seconds

SLOW_FACTOR = 1.5
"""A manual layout predicted this much slower than the best gets a warning."""
TIME_PARTS = (
    ("compute", "compute_s"),
    ("tp", "tp_s"),
    ("cp", "cp_s"),
    ("ep", "ep_s"),
    ("pp", "pp_s"),
    ("fsdp", "fsdp_s"),
    ("dp", "dp_s"),
    ("bubble", "bubble_s"),
    ("optimizer", "optimizer_s"),
)


def add_auto_arguments(
    parser: argparse.ArgumentParser, source: argparse._MutuallyExclusiveGroup
) -> None:
    """The ``--auto`` options of ``overlapkit plan``; ``--validate`` replaces the topology."""
    auto = parser.add_argument_group("auto-planner (--auto)")
    auto.add_argument(
        "--auto",
        action="store_true",
        help="choose tp/pp/dp/cp/ep, micro-batching, recomputation and sharding for --model",
    )
    auto.add_argument("--model", metavar="NAME|config.json", help="llama3-8b, ..., or a config")
    auto.add_argument("--global-batch", type=int, metavar="B", help="sequences per step")
    auto.add_argument("--recompute", choices=("none", "selective", "full"), help="fix it")
    auto.add_argument(
        "--gpu-memory-gb", type=float, metavar="G", help="GPU memory (the preset's by default)"
    )
    auto.add_argument(
        "--precision", choices=tuple(PRECISIONS), default="bf16", help="bf16 (default) or fp8"
    )
    auto.add_argument("--candidates", type=int, default=5, metavar="K", help="layouts to list (5)")
    auto.add_argument(
        "--achievable",
        type=float,
        metavar="F",
        help="fraction of the dense peak a layer's FLOPs run at (default: the GPU family's, "
        "autoplan.compute), e.g. from a measured step",
    )
    source.add_argument(
        "--validate",
        action="store_true",
        help="with --auto, instead of a topology: predict every published training run the "
        "planner is checked against (autoplan/data/published_runs.tsv)",
    )


def fixed_from_args(args: argparse.Namespace) -> dict:
    """The sizes and choices the user fixed (unset ones are free under --auto)."""
    fixed = {k: getattr(args, k) for k in ("tp", "pp", "cp", "ep") if getattr(args, k) is not None}
    if args.dp is not None and args.dp != -1:
        fixed["dp"] = args.dp
    if args.dp_shard is not None:
        fixed |= {"sharding": "hsdp", "dp_shard": args.dp_shard}
    if args.recompute is not None:
        fixed["recompute"] = args.recompute
    if args.micro_batch is not None:
        fixed["micro_batch"] = args.micro_batch
    return fixed


def run_validation(args: argparse.Namespace) -> int:
    """``overlapkit plan --auto --validate``: exit 1 when a run expected within ``TOLERANCE``
    misses it, or any published layout is predicted not to fit."""
    checks = validate()
    if args.json:
        print(json.dumps({"checks": [c.to_dict() for c in checks]}, indent=2))
    else:
        print(render_run_checks(checks))
    failed = [
        c
        for c in checks
        if not c.predicted.fits or (not c.within_tolerance and not c.run.explained_miss)
    ]
    return 1 if failed else 0


def run_auto(args: argparse.Namespace, topology: Topology) -> int:
    """``overlapkit plan --auto``."""
    missing = [
        flag
        for flag, value in (("--model", args.model), ("--global-batch", args.global_batch))
        if value is None
    ]
    if missing or args.seq_len is None:
        missing += [] if args.seq_len is not None else ["--seq-len"]
        raise ValueError(f"plan --auto needs {', '.join(missing)}")
    start = time.perf_counter()
    fixed = fixed_from_args(args)
    if args.achievable is not None and not 0 < args.achievable <= 1:
        raise ValueError(f"--achievable must be in (0, 1], got {args.achievable}")
    answer = auto_plan(
        topology,
        args.model,
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        fixed=fixed,
        gpu_memory_gb=args.gpu_memory_gb,
        candidates=args.candidates,
        settings=SearchSettings(precision=PRECISIONS[args.precision], achievable=args.achievable),
    )
    warnings = layout_warnings(answer.topology, answer.model, answer.best, fixed, args.precision)
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps(auto_dict(answer, warnings, elapsed), indent=2))
    else:
        print(render_auto(answer, warnings, elapsed))
    return 0


def auto_dict(answer: AutoPlan, warnings: list[str], elapsed_s: float) -> dict:
    result = answer.result
    placement = answer.placement
    return {
        "candidates": [c.to_dict() for c in result.candidates],
        "search_s": result.search_s,
        "searched": result.searched,
        "timed": result.timed,
        "cost_model_estimates": result.estimates,
        "elapsed_s": elapsed_s,
        "warnings": warnings,
        "model": answer.model.to_dict(),
        "topology": answer.topology.name,
        "world_size": answer.topology.world_size,
        "fixed": result.fixed,
        "placement": {
            "mesh_dim_names": list(placement.mesh_dim_names),
            "shape": list(placement.shape),
            "where": {axis: where(placement, axis) for axis in placement.sizes},
        },
        "run": run_instructions(answer),
    }


def run_instructions(answer: AutoPlan) -> dict:
    """How to run the best layout: overlapkit-train overrides, or a mesh and torchtitan config."""
    layout = answer.best.layout
    topology = answer.topology
    lacks = train_lacks(layout)
    # The sizes the user fixed go in too: without them ok.plan would search them freely.
    fixed = "".join(
        f", {key}={value!r}"
        for key, value in answer.result.fixed.items()
        if key != "recompute_layers"
    )
    out: dict = {
        "mesh_dim_names": list(answer.placement.mesh_dim_names),
        "device_mesh": (
            f"ok.plan(ok.load_topology({topology.name!r}), model={answer.model.name!r}, "
            f"global_batch={answer.global_batch}, seq_len={answer.seq_len}{fixed}, auto=True)"
            ".device_mesh()"
        ),
        "overlapkit_train_lacks": lacks,
        "torchtitan": torchtitan_config(
            layout, seq_len=answer.seq_len, global_batch=answer.global_batch
        ),
    }
    if not lacks:
        overrides = train_overrides(
            layout,
            topology=topology.name,
            nodes=topology.num_nodes,
            ranks_per_node=len(topology.nodes()[0]),
            model=answer.model.name,
        )
        out["overlapkit_train"] = ["overlapkit-train", *overrides]
        if layout.tp > 1:
            out["overlapkit_train_predicted"] = train_prediction(answer)
    return out


def train_prediction(answer: AutoPlan) -> dict:
    """The best layout priced as overlapkit-train runs it (``autoplan.framework``): under tp
    its embeddings and head stay whole on every rank, and all-reduces replace sequence
    parallelism's gathers and scatters. Seconds, GB (1e9 bytes)."""
    settings = dataclasses.replace(answer.settings, framework=OVERLAPKIT_TRAIN)
    candidate = price(
        answer.topology,
        answer.model,
        answer.best.layout,
        seq_len=answer.seq_len,
        settings=settings,
    )
    return {
        "framework": OVERLAPKIT_TRAIN.name,
        "step_time_s": candidate.step.step_s,
        "memory_gb_per_gpu": candidate.memory.total / 1e9,
        "fits": candidate.fits,
    }


def _cell_dims(layout: TrainingLayout) -> str:
    dims = " ".join(f"{k}{v}" for k, v in layout.dims.items() if v > 1 or k == "dp")
    return dims


def _time_parts(candidate: Candidate) -> dict[str, float]:
    return {name: getattr(candidate.step, attr) for name, attr in TIME_PARTS}


def why_best(ranked: list[Candidate]) -> list[str]:
    """Why the first candidate wins: its lead over the best layout of other parallel sizes, or,
    when none fits (sizes fixed), that it comes closest to fitting."""
    best = ranked[0]
    lines = []
    others = [c for c in ranked[1:] if c.layout.dims != best.layout.dims] or ranked[1:]
    others = [c for c in others if c.step.step_s > best.step.step_s * (1 + TIE)] or others
    if not best.fits:
        lines.append(
            f"why #1: nothing listed fits in {best.memory_limit / 1e9:.3g} GB; #1 comes closest "
            f"({best.memory.total / 1e9:.3g} GB per GPU"
            + (f", #2 {ranked[1].memory.total / 1e9:.3g} GB" if len(ranked) > 1 else "")
            + ")"
        )
    elif others:
        second = others[0]
        gap = second.step.step_s / best.step.step_s - 1
        parts = _time_parts(best)
        rival = _time_parts(second)
        deltas = sorted(((rival[k] - parts[k], k) for k in parts), key=lambda d: -abs(d[0]))
        shown = ", ".join(
            f"{k} {'+' if delta > 0 else '-'}{format_seconds(abs(delta))}"
            for delta, k in deltas[:3]
            if abs(delta) > 1e-6
        )
        rank = ranked.index(second) + 1
        lines.append(
            f"why #1: {gap * 100:.3g} % faster than #{rank} ({_cell_dims(second.layout)}, "
            f"{second.layout.sharding}); #{rank} minus #1: {shown or 'nothing measurable'}"
        )
    parts = _time_parts(best)
    top = sorted(parts.items(), key=lambda kv: -kv[1])
    lines.append(
        "  #1's step: "
        + ", ".join(f"{k} {format_seconds(v)}" for k, v in top if v > 0)
        + f" (MFU {best.mfu:.1%}; memory {best.memory.total / 1e9:.3g} of "
        f"{best.memory_limit / 1e9:.3g} GB: {memory_text(best.memory)})"
    )
    return lines


def render_auto(answer: AutoPlan, warnings: list[str], elapsed_s: float) -> str:
    result = answer.result
    topology = answer.topology
    lines = [
        f"auto-plan {answer.model.describe()}",
        f"on {topology.name}: {topology.world_size} GPUs "
        f"({answer.best.memory_limit / 1e9:.3g} GB each), global batch {answer.global_batch} x "
        f"{answer.seq_len} tokens; searched {result.searched} layouts ({result.timed} timed, "
        f"{result.estimates} cost-model estimates) in {result.search_s:.2f} s",
        "",
    ]
    header = ["#", "dims", "mb x m", "v", "recompute", "sharding", "step s", "tok/s/GPU"]
    header += ["MFU", "GB/GPU", "fits"]
    rows = []
    for i, c in enumerate(result.candidates, 1):
        lay = c.layout
        shard = f"hsdp/{lay.dp_shard}" if lay.sharding == "hsdp" else lay.sharding
        recompute = lay.recompute + (
            f"({lay.recompute_layers})" if lay.recompute_layers is not None else ""
        )
        rows.append(
            [
                str(i),
                _cell_dims(lay),
                f"{lay.micro_batch}x{lay.num_micro_batches}",
                str(lay.virtual_stages),
                recompute,
                shard,
                f"{c.step.step_s:.4g}",
                f"{c.tokens_per_s_per_gpu:.4g}",
                f"{c.mfu:.1%}",
                f"{c.memory.total / 1e9:.3g}",
                "yes" if c.fits else "NO",
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    lines += ["", *why_best(result.candidates)]
    placement = answer.placement
    lines.append(
        "  placed: "
        + "; ".join(
            f"{axis} {where(placement, axis)}"
            for axis, size in reversed(placement.sizes.items())
            if size > 1
        )
    )
    lines += [f"warning: {w}" for w in warnings]
    run = run_instructions(answer)
    lines.append("")
    if "overlapkit_train" in run:
        lines.append("run it: " + " ".join(run["overlapkit_train"]))
        if "overlapkit_train_predicted" in run:
            predicted = run["overlapkit_train_predicted"]
            lines.append(
                f"  overlapkit-train keeps the embeddings and head whole on every tp rank and "
                f"all-reduces where Megatron's sequence parallelism gathers and scatters: "
                f"{predicted['step_time_s']:.4g} s per step predicted "
                f"({predicted['step_time_s'] / answer.best.step.step_s - 1:+.1%}), "
                f"{predicted['memory_gb_per_gpu']:.3g} GB per GPU"
                + ("" if predicted["fits"] else " (does not fit)")
            )
        if answer.model.name not in TRAIN_MODELS:
            lines.append(
                f"  (overlapkit-train's model zoo is {', '.join(TRAIN_MODELS)}: point "
                f"model._target_ at your {answer.model.name} module)"
            )
    else:
        lines.append(
            "overlapkit-train lacks " + ", ".join(run["overlapkit_train_lacks"]) + "; run it "
            "with the planner's DeviceMesh (dims " + ", ".join(run["mesh_dim_names"]) + "):"
        )
        lines.append(f"  mesh = {run['device_mesh']}")
        lines.append("  or a torchtitan job config:")
        lines += ["    " + line for line in run["torchtitan"].splitlines()]
    lines.append(f"({elapsed_s:.2f} s)")
    return "\n".join(lines)


def layout_warnings(
    topology: Topology,
    model: ModelSpec | None,
    chosen: Candidate | None,
    fixed: dict,
    precision: str = "bf16",
) -> list[str]:
    """Warnings for a layout the user fixed: tp over the network, slow, or not fitting."""
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
    if model is not None and any(k in fixed for k in ("tp", "pp", "dp", "cp", "ep")):
        try:
            free = search(
                topology,
                model,
                global_batch=chosen.layout.global_batch,
                seq_len=chosen.seq_len,
                settings=SearchSettings(precision=PRECISIONS[precision]),
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


def manual_warnings(args: argparse.Namespace, placement: Placement) -> list[str]:
    """``overlapkit plan --tp ...`` without --auto: judge the layout as the auto-planner would.

    Always: a tp group over the network. With ``--model`` and ``--global-batch``: slower than
    ``SLOW_FACTOR`` x the best, or not fitting.
    """
    topology = placement.topology
    sizes = placement.dims
    domain = domain_size(topology)
    out = []
    if args.model is None or args.global_batch is None:
        if sizes["tp"] > domain:
            tp = [c for c in placement.collectives() if c.dim == "tp"]
            total = sum(c.total_s for c in tp)
            inside = place_inside(placement, domain)
            note = ""
            if inside is not None:
                comm = inside.collectives()
                inside_s = sum(c.total_s for c in comm if c.dim == "tp")
                grads_s = sum(c.total_s for c in comm if c.dim == "dp")
                w = placement.workload
                note = (
                    f", {total / inside_s:.3g}x tp={domain} inside a domain for the same "
                    f"{w.micro_batch * w.microbatches} sequences per step "
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
    model = load_model(args.model)
    topo = with_memory(topology, args.gpu_memory_gb)
    fixed = {k: sizes[k] for k in ("tp", "pp", "cp", "ep")} | {"dp": sizes["dp"]}
    if "dp_shard" in sizes:
        fixed |= {"sharding": "hsdp", "dp_shard": sizes["dp_shard"]}
    seq_len = args.seq_len or placement.workload.seq_len
    chosen = search(
        topo,
        model,
        global_batch=args.global_batch,
        seq_len=seq_len,
        fixed=fixed,
        settings=SearchSettings(precision=PRECISIONS[args.precision]),
        candidates=1,
    ).best
    return layout_warnings(topo, model, chosen, fixed, args.precision)


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
