"""``overlapkit plan --auto``: the ranked table, why the winner wins, how to run it and how to
pin it; and ``--validate``, the check against published runs.

The JSON document's stable keys are listed in docs/json-contracts.md (``plan --auto``)::

    {"candidates": [{"dims": {"tp", "pp", "dp", "cp", "ep"}, "micro_batch", "num_micro_batches",
                     "virtual_stages", "recompute", "recompute_layers", "sharding", "dp_shard",
                     "step_time_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu",
                     "hardware_tflops_per_gpu", "mfu", "memory_gb_per_gpu", "fits",
                     "breakdown": {...}}, ...],
     "framework", "attention", "precision", "search_s", "searched", "warnings": [...],
     "run": {"plan_call", "plan_command", "device_mesh", ...}, ...}
"""

from __future__ import annotations

import argparse
import json
import time

from overlapkit.autoplan.candidate import Candidate, memory_text
from overlapkit.autoplan.framework import (
    FRAMEWORKS,
    OVERLAPKIT_TRAIN,
    TORCHTITAN,
    framework_named,
)
from overlapkit.autoplan.handoff.run_config import TRAIN_MODELS, priced_as, train_overrides
from overlapkit.autoplan.handoff.torchtitan import torchtitan_run
from overlapkit.autoplan.layout_warnings import layout_warnings
from overlapkit.autoplan.memory import PRECISIONS
from overlapkit.autoplan.models import GPT_SPEC
from overlapkit.autoplan.ok_plan import AutoPlan, auto_plan
from overlapkit.autoplan.pins import (
    RECOMPUTE_SPELLING,
    cli_flag,
    pins_from,
    plan_call,
    plan_command,
    recompute_text,
)
from overlapkit.autoplan.published_runs import render_run_checks, validate
from overlapkit.autoplan.search import TIE
from overlapkit.autoplan.settings import ATTENTION, SearchSettings, flash_attention_of
from overlapkit.layout import SHARDING, PartialLayout, TrainingLayout
from overlapkit.planner.explain import where
from overlapkit.topology.model import Topology
from overlapkit.topology.units import format_seconds

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
    """The ``--auto`` options of ``overlapkit plan``; ``--validate`` replaces the topology.

    The choices are checked by the planner (one line naming a bad value), not by argparse.
    """
    auto = parser.add_argument_group("auto-planner (--auto; each choice given is pinned)")
    auto.add_argument(
        "--auto",
        action="store_true",
        help="choose tp/pp/dp/cp/ep, micro-batching, recomputation and sharding for --model",
    )
    auto.add_argument(
        "--model",
        metavar="NAME|config.json|gpt:...",
        help=f"llama3-8b, ..., a Hugging Face config.json, or a Megatron GPT as {GPT_SPEC}",
    )
    auto.add_argument("--global-batch", type=int, metavar="B", help="sequences per step")
    auto.add_argument(
        "--recompute",
        metavar=RECOMPUTE_SPELLING,
        help="pin recomputation; full: the search chooses how many layers of each pipeline "
        "stage, full:K pins K of them, full:all every layer",
    )
    auto.add_argument(
        "--sharding",
        metavar="|".join(SHARDING),
        help="pin the data-parallel sharding (hsdp: with --dp-shard, or searched)",
    )
    auto.add_argument(
        "--virtual-stages", type=int, metavar="V", help="pin interleaving (1: plain 1F1B)"
    )
    auto.add_argument(
        "--attention",
        metavar="|".join(ATTENTION),
        help="price attention as flash attention (default) or the softmax materialised",
    )
    auto.add_argument(
        "--framework",
        metavar="|".join(FRAMEWORKS),
        help="what runs the layouts: only what it runs is searched, priced as it runs it "
        "(default megatron)",
    )
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


def fixed_from_args(args: argparse.Namespace) -> PartialLayout:
    """The choices the user pinned on the command line (unset ones are free under --auto).

    Raises:
        TypeError / ValueError: a bad pin, naming its flag.
    """
    dp = None if args.dp == -1 else args.dp
    sizes = {"tp": args.tp, "pp": args.pp, "dp": dp, "cp": args.cp, "ep": args.ep}
    return pins_from(sizes | choices_from_args(args).given(), spell=cli_flag)


def choices_from_args(args: argparse.Namespace) -> PartialLayout:
    """The pins beyond the parallel sizes: micro-batch, interleaving, recomputation, sharding."""
    choices = {
        "dp_shard": args.dp_shard,
        "micro_batch": args.micro_batch,
        "virtual_stages": args.virtual_stages,
        "recompute": args.recompute,
        "sharding": args.sharding,
    }
    return pins_from(choices, spell=cli_flag)


def settings_from_args(args: argparse.Namespace) -> SearchSettings:
    """``--precision``, ``--attention``, ``--framework`` and ``--achievable`` as settings.

    Raises:
        ValueError: a bad value, naming the flag.
    """
    if args.achievable is not None and not 0 < args.achievable <= 1:
        raise ValueError(f"--achievable must be in (0, 1], got {args.achievable}")
    try:
        framework = framework_named(args.framework or "megatron")
        flash = flash_attention_of(args.attention or "flash")
    except ValueError as err:
        raise ValueError(f"--{err}") from None
    return SearchSettings(
        precision=PRECISIONS[args.precision],
        flash_attention=flash,
        framework=framework,
        achievable=args.achievable,
    )


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
    answer = auto_plan(
        topology,
        args.model,
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        fixed=fixed,
        gpu_memory_gb=args.gpu_memory_gb,
        candidates=args.candidates,
        settings=settings_from_args(args),
    )
    warnings = layout_warnings(answer.topology, answer.model, answer.best, fixed, answer.settings)
    run = run_instructions(answer, topology=args.topology, fabric=args.fabric)
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps(auto_dict(answer, warnings, elapsed, run), indent=2))
    else:
        print(render_auto(answer, warnings, elapsed, run))
    return 0


def auto_dict(answer: AutoPlan, warnings: list[str], elapsed_s: float, run: dict) -> dict:
    """``overlapkit plan --auto --json`` (docs/json-contracts.md)."""
    result = answer.result
    placement = answer.placement
    settings = answer.settings
    return {
        "candidates": [c.to_dict() for c in result.candidates],
        "framework": settings.framework.name,
        "attention": settings.attention,
        "precision": settings.precision.name,
        "search_s": result.search_s,
        "searched": result.searched,
        "timed": result.timed,
        "refused": result.refused,
        "cost_model_estimates": result.estimates,
        "elapsed_s": elapsed_s,
        "warnings": warnings,
        "model": answer.model.to_dict() | {"source": answer.model_source},
        "topology": answer.topology.name,
        "world_size": answer.topology.world_size,
        "fixed": result.fixed.given(),
        "placement": {
            "mesh_dim_names": list(placement.mesh_dim_names),
            "shape": list(placement.shape),
            "where": {axis: where(placement, axis) for axis in placement.sizes},
        },
        "run": run,
    }


def setting_pins(answer: AutoPlan) -> dict:
    """The settings the search ran under, as ``ok.plan`` keywords (the defaults of precision,
    GPU memory and achievable fraction left out)."""
    settings = answer.settings
    out: dict = {"attention": settings.attention, "framework": settings.framework.name}
    if settings.precision.name != "bf16":
        out["precision"] = settings.precision.name
    if answer.gpu_memory_gb is not None:
        out["gpu_memory_gb"] = answer.gpu_memory_gb
    if settings.achievable is not None:
        out["achievable"] = settings.achievable
    return out


def run_instructions(
    answer: AutoPlan, *, topology: str | None = None, fabric: str | None = None
) -> dict:
    """How to run the best layout and how to price exactly it again.

    ``plan_call`` / ``plan_command``: the ``ok.plan(..., auto=True)`` call and the ``overlapkit
    plan --auto`` command with every choice of the best pinned (``topology``: what
    ``load_topology`` was given, its name by default); its mesh; the ``torchtitan.train``
    arguments (``autoplan.handoff.torchtitan``) and, under another framework, the layout priced as
    torchtitan runs it; overlapkit-train overrides where overlapkit-train runs it.
    """
    layout = answer.best.layout
    topo = answer.topology
    where_from = dict(topology=topology or topo.name, fabric=fabric)
    batch = dict(global_batch=answer.global_batch, seq_len=answer.seq_len)
    settings = setting_pins(answer)
    call = plan_call(layout, model=answer.model_source, settings=settings, **where_from, **batch)
    lacks = OVERLAPKIT_TRAIN.lacks(layout, layers=answer.model.layers)
    out: dict = {
        "plan_call": call,
        "plan_command": plan_command(
            layout,
            model=answer.model_source or answer.model.name,
            settings=settings,
            **where_from,
            **batch,
        ),
        "mesh_dim_names": list(answer.placement.mesh_dim_names),
        "device_mesh": f"{call}.device_mesh()",
        "overlapkit_train_lacks": lacks,
        "torchtitan": torchtitan_run(
            layout,
            answer.model,
            precision=answer.settings.precision.name,
            placement=answer.placement,
            **batch,
        ).to_dict(),
    }
    if answer.settings.framework != TORCHTITAN:
        refused = TORCHTITAN.lacks(layout)
        out["torchtitan_predicted"] = (
            {"framework": TORCHTITAN.name, "lacks": refused}
            if refused
            else priced_as(answer, TORCHTITAN)
        )
    if not lacks:
        overrides = train_overrides(
            layout,
            topology=topology or topo.name,
            nodes=topo.num_nodes,
            ranks_per_node=len(topo.nodes()[0]),
            model=answer.model.name,
            layers=answer.model.layers,
        )
        out["overlapkit_train"] = ["overlapkit-train", *overrides]
        if layout.tp > 1 and answer.settings.framework != OVERLAPKIT_TRAIN:
            out["overlapkit_train_predicted"] = priced_as(answer, OVERLAPKIT_TRAIN)
    return out


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


def render_auto(
    answer: AutoPlan, warnings: list[str], elapsed_s: float, run: dict | None = None
) -> str:
    """The ``overlapkit plan --auto`` report (``run``: ``run_instructions(answer)``)."""
    run = run or run_instructions(answer)
    lines = [
        *header_lines(answer),
        "",
        *candidate_table(answer.result.candidates),
        "",
        *why_best(answer.result.candidates),
        placement_line(answer),
        *(f"warning: {w}" for w in warnings),
        "",
        "#1 pinned (prices exactly it): " + " ".join(run["plan_command"]),
        f"  from Python: plan = {run['plan_call']}",
        *overlapkit_train_lines(answer, run),
        *torchtitan_lines(answer, run),
        f"({elapsed_s:.2f} s)",
    ]
    return "\n".join(lines)


def header_lines(answer: AutoPlan) -> list[str]:
    """What was searched: the model, the topology and batch, the counts, the settings."""
    result, topology, settings = answer.result, answer.topology, answer.settings
    refused = (
        f", {result.refused} more that {settings.framework.name} does not run left out"
        if result.refused
        else ""
    )
    return [
        f"auto-plan {answer.model.describe()}",
        f"on {topology.name}: {topology.world_size} GPUs "
        f"({answer.best.memory_limit / 1e9:.3g} GB each), global batch {answer.global_batch} x "
        f"{answer.seq_len} tokens; searched {result.searched} layouts ({result.timed} timed, "
        f"{result.estimates} cost-model estimates{refused}) in {result.search_s:.2f} s",
        f"as {settings.framework.name} runs them, {settings.attention} attention, "
        f"{settings.precision.name}",
    ]


TABLE_HEADER = (
    *("#", "dims", "mb x m", "v", "recompute", "sharding"),
    *("step s", "tok/s/GPU", "MFU", "GB/GPU", "fits"),
)


def candidate_row(rank: int, candidate: Candidate) -> list[str]:
    """One line of the ranked table, as cells (``TABLE_HEADER``)."""
    layout = candidate.layout
    shard = f"hsdp/{layout.dp_shard}" if layout.sharding == "hsdp" else layout.sharding
    tokens = candidate.tokens_per_s_per_gpu
    return [
        str(rank),
        _cell_dims(layout),
        f"{layout.micro_batch}x{layout.num_micro_batches}",
        str(layout.virtual_stages),
        recompute_text(layout),
        shard,
        f"{candidate.step.step_s:.4g}",
        f"{tokens:.4g}" if tokens < 1e4 else f"{tokens:.0f}",
        f"{candidate.mfu:.1%}",
        f"{candidate.memory.total / 1e9:.3g}",
        "yes" if candidate.fits else "NO",
    ]


def candidate_table(candidates: list[Candidate]) -> list[str]:
    """The ranked table, right-aligned columns."""
    rows = [list(TABLE_HEADER)] + [candidate_row(i, c) for i, c in enumerate(candidates, 1)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_HEADER))]
    return [
        "  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]


def placement_line(answer: AutoPlan) -> str:
    """Where #1's groups sit (``explain.where``), outermost axis last."""
    placement = answer.placement
    return "  placed: " + "; ".join(
        f"{axis} {where(placement, axis)}"
        for axis, size in reversed(placement.sizes.items())
        if size > 1
    )


def overlapkit_train_lines(answer: AutoPlan, run: dict) -> list[str]:
    """How to run #1 with overlapkit-train (its ``run it:`` line and price), or what it lacks."""
    if "overlapkit_train" not in run:
        return [
            "overlapkit-train lacks " + ", ".join(run["overlapkit_train_lacks"]) + "; run it "
            "with the planner's DeviceMesh (dims " + ", ".join(run["mesh_dim_names"]) + "):",
            "  mesh = plan.device_mesh()",
            "  or search only what overlapkit-train runs: --framework overlapkit-train",
        ]
    lines = ["run it: " + " ".join(run["overlapkit_train"])]
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
    return lines


def torchtitan_lines(answer: AutoPlan, run: dict) -> list[str]:
    """The torchtitan launch of the best layout, what of it does not transfer, and (under
    another framework) its price as torchtitan runs it."""
    titan = run["torchtitan"]
    topology = answer.topology
    launch = (
        f"torchrun --nnodes {topology.num_nodes} --nproc-per-node {len(topology.nodes()[0])} "
        "-m torchtitan.train"
    )
    lines = [f"or with torchtitan {titan['version']}: {launch} " + " ".join(titan["args"])]
    predicted = run.get("torchtitan_predicted")
    if predicted and "lacks" in predicted:
        lines.append(
            "  priced as torchtitan runs it: not searched, --framework torchtitan does not run "
            + ", ".join(predicted["lacks"])
        )
    elif predicted:
        lines.append(
            f"  as torchtitan runs it (--framework torchtitan): "
            f"{predicted['step_time_s']:.4g} s per step predicted "
            f"({predicted['step_time_s'] / answer.best.step.step_s - 1:+.1%}), "
            f"{predicted['memory_gb_per_gpu']:.3g} GB per GPU"
            + ("" if predicted["fits"] else " (does not fit: search with --framework torchtitan)")
        )
    return lines + [f"  torchtitan: {w}" for w in titan["warnings"]]
