"""``overlapkit plan --auto``'s report for people: what was searched, the ranked table, why #1
wins, where it is placed, and how to run it (``render_auto``, composed of one function a part).
"""

from __future__ import annotations

from overlapkit.autoplan.candidate import Candidate, memory_text
from overlapkit.autoplan.handoff.run_config import TRAIN_MODELS
from overlapkit.autoplan.ok_plan import AutoPlan
from overlapkit.autoplan.pins import recompute_text
from overlapkit.autoplan.search import TIE
from overlapkit.layout import TrainingLayout
from overlapkit.planner.explain import where
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
    if best.step.hidden_share:
        modes = ", ".join(f"parallel.plan.{k}={v}" for k, v in best.step.modes.items())
        hidden = ", ".join(f"{d} {s:.0%}" for d, s in best.step.hidden_share.items())
        lines.append(f"  #1's in-layer overlap ({modes}): communication hidden {hidden}")
    return lines


def render_auto(answer: AutoPlan, warnings: list[str], elapsed_s: float, run: dict) -> str:
    """The ``overlapkit plan --auto`` report (``run``: ``auto_cli.run_instructions(answer)``)."""
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
    *("#", "dims", "mb x m", "v", "schedule", "recompute", "sharding"),
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
        layout.pipeline_schedule or "-",
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
            f"  overlapkit-train keeps the embeddings and head whole on every tp rank (no "
            f"vocabulary parallelism) and cuts and gathers the sequence around its blocks: "
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
