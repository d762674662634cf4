"""``overlapkit plan --auto``: its options, the search run, how to run the winner and how to pin
it (``run_instructions``), the report (``auto_report``) or JSON; and ``--validate``, the check
against published runs.

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

from overlapkit.autoplan.auto_report import render_auto
from overlapkit.autoplan.framework import (
    FRAMEWORKS,
    OVERLAPKIT_TRAIN,
    TORCHTITAN,
    framework_named,
)
from overlapkit.autoplan.handoff.run_config import priced_as, train_overrides
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
)
from overlapkit.autoplan.pipeline_schedule import SHAPES
from overlapkit.autoplan.published_runs import render_run_checks, validate
from overlapkit.autoplan.settings import ATTENTION, SearchSettings, flash_attention_of
from overlapkit.layout import SHARDING, PartialLayout
from overlapkit.planner.explain import where
from overlapkit.topology.model import Topology


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
        "--schedule",
        metavar="|".join(SHAPES),
        help="pin the pipeline schedule (torch's name; searched among those the framework runs)",
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
    """The pins beyond the parallel sizes: micro-batch, interleaving, recomputation, sharding,
    the pipeline schedule."""
    choices = {
        "dp_shard": args.dp_shard,
        "micro_batch": args.micro_batch,
        "virtual_stages": args.virtual_stages,
        "recompute": args.recompute,
        "sharding": args.sharding,
        "schedule": args.schedule,
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
            modes=answer.best.step.modes if answer.settings.framework == OVERLAPKIT_TRAIN else None,
        )
        out["overlapkit_train"] = ["overlapkit-train", *overrides]
        if layout.tp > 1 and answer.settings.framework != OVERLAPKIT_TRAIN:
            out["overlapkit_train_predicted"] = priced_as(answer, OVERLAPKIT_TRAIN)
    return out
