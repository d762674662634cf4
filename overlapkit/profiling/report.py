"""Readable text of a ``RunReport``: per step, per rank table; per rank totals; cross-rank view;
with ``--stragglers`` the stragglers, the clocks and the what-if slowdowns."""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlapkit.profiling.analysis import RunReport, StepMetrics
from overlapkit.profiling.rank_summary import (
    cross_rank,
    rank_percentiles,
    rank_totals,
    slowest_ranks,
)

if TYPE_CHECKING:
    from overlapkit.profiling.stragglers import StragglerReport

MiB = 1024 * 1024
RANKS_LISTED = 32
"""Above this many ranks, the per rank sections list only the slowest ``RANKS_SHOWN``."""
RANKS_SHOWN = 10
STRAGGLERS_LISTED = 20


def _collectives(row: StepMetrics) -> str:
    parts = []
    for kind, stats in row.kinds.items():
        size = "?" if stats.nbytes is None else f"{stats.nbytes / MiB:.2f} MiB"
        exposed = f" ({stats.exposed_ms:.2f} ms exposed)" if kind == "send_recv" else ""
        parts.append(f"{kind} {stats.count}x {size}{exposed}")
    return ", ".join(parts) or "-"


def _dims(row: StepMetrics) -> str:
    """Per parallel dimension: count, time and the exposed part (ms); empty without comm."""
    parts = [
        f"{dim} {stats.count}x {stats.time_ms:.2f} ms ({stats.exposed_ms:.2f} exposed)"
        for dim, stats in row.dims.items()
    ]
    return f"; by dim: {', '.join(parts)}" if parts else ""


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.0f}%"


def _rank_lines(report: RunReport, ranks: list[int]) -> list[str]:
    totals = {t["rank"]: t for t in rank_totals(report.table)}
    shown = ranks
    lines = ["", "per rank, summed over its steps:"]
    if len(ranks) > RANKS_LISTED:
        worst = sorted(rank_percentiles(report.table), key=lambda r: -r["step_ms_p90"])
        shown = [r["rank"] for r in worst[:RANKS_SHOWN]]
        lines[-1] = f"per rank, summed over its steps (the {RANKS_SHOWN} of {len(ranks)} ranks "
        lines[-1] += "with the longest 90th-percentile step; all in --json 'ranks'):"
    for rank in shown:
        total = totals[rank]
        share = "-" if total["overlap_pct"] is None else f"{total['overlap_pct']:.0f}%"
        lines.append(
            f"  rank {total['rank']}: {total['steps']} steps, compute {total['compute_ms']:.2f} "
            f"ms, comm {total['comm_ms']:.2f} ms, exposed {total['exposed_comm_ms']:.2f} ms "
            f"(tail {total['tail_ms']:.2f} ms), comm hidden: {share}"
        )
    return lines


def format_report(
    report: RunReport, *, step_rows: int | None = None, stragglers: StragglerReport | None = None
) -> str:
    """The table printed by ``overlapkit report`` (times in ms).

    Args:
        report (RunReport): the analysis.
        step_rows (int | None): print only this many per rank, per step rows (None: all).
        stragglers (StragglerReport | None): add the straggler sections.
    """
    ranks = sorted(set(report.table["rank"].tolist()))
    steps = report.steps if step_rows is None else report.step_metrics(step_rows)
    lines = [
        f"overlapkit report: {report.run_dir} ({len(report.files)} trace files, "
        f"{len(ranks)} ranks, {len(set(report.table['step'].tolist()))} steps)",
        "",
        f"{'step':>5} {'rank':>4} {'step_ms':>9} {'compute_ms':>10} {'comm_ms':>9} "
        f"{'exposed_ms':>10} {'tail_ms':>8} {'overlap':>7}  collectives",
    ]
    for row in steps:
        lines.append(
            f"{row.step:>5} {row.rank:>4} {row.step_ms:>9.2f} {row.compute_ms:>10.2f} "
            f"{row.comm_ms:>9.2f} {row.exposed_comm_ms:>10.2f} {row.tail_ms:>8.2f} "
            f"{_pct(row.overlap_ratio):>7}  {_collectives(row)}{_dims(row)}"
        )
    if len(steps) < len(report.table):
        lines.append(f"  ... {len(report.table) - len(steps)} more rows (--step-rows)")
    lines += _rank_lines(report, ranks)
    if len(ranks) > 1:
        top = {s["step"]: s["ranks"] for s in slowest_ranks(report.table)}
        lines += [
            "",
            "across ranks (comm spread = max - min comm_ms: time spent waiting for a straggler):",
            f"{'step':>5} {'slowest':>7} {'step_ms min..max':>18} "
            f"{'comm_ms min (rank)':>19} {'max (rank)':>13} {'spread':>8}  slowest ranks",
        ]
        for c in cross_rank(report.table):
            lines.append(
                f"{c.step:>5} {c.slowest_rank:>7} "
                f"{f'{c.fastest_step_ms:.2f}..{c.slowest_step_ms:.2f}':>18} "
                f"{f'{c.min_comm_ms:.2f} ({c.min_comm_rank})':>19} "
                f"{f'{c.max_comm_ms:.2f} ({c.max_comm_rank})':>13} {c.comm_spread_ms:>8.2f}  "
                + ", ".join(str(r["rank"]) for r in top[c.step])
            )
    if stragglers is not None:
        lines += format_stragglers(stragglers)
    if report.skipped:
        lines += ["", "skipped files:"]
        lines += [f"  {s['file']}: {s['reason']}" for s in report.skipped]
    if report.warnings:
        lines += ["", "warnings:"]
        lines += [f"  {w}" for w in report.warnings]
    return "\n".join(lines)


def _where(s) -> str:
    if s.cause == "compute":
        return s.op or "-"
    if s.cause == "comm":
        return f"slow transfer in {s.cause_collective}"
    return "-"


def format_stragglers(found: StragglerReport) -> list[str]:
    """The ``--stragglers`` sections (times in ms)."""
    matching = found.matching
    offsets = sorted(matching.offsets_us.items())
    residual = sorted(matching.residual_us.items())
    moved = [f"{r}: {o / 1e3:+.3f}" for r, o in offsets if o != 0.0]
    lines = [
        "",
        f"collectives matched across ranks: {matching.instances}"
        + "".join(f"; unmatched {n} ({why})" for why, n in matching.unmatched.items()),
        "clock offsets (ms, by host): "
        + (", ".join(moved) if moved else "none (one clock)")
        + (
            f"; residual skew median {max(a for _, (a, _) in residual) / 1e3:.3f} ms, "
            f"largest {max(b for _, (_, b) in residual) / 1e3:.3f} ms"
            if residual
            else ""
        ),
    ]
    listed = found.stragglers[:STRAGGLERS_LISTED]
    if not found.stragglers:
        lines += [
            "no stragglers above the noise "
            + ", ".join(f"{k} {v / 1e3:.3f} ms" for k, v in found.thresholds_us.items())
        ]
    else:
        lines += [
            "",
            f"stragglers ({len(found.stragglers)}, costliest first; cost = how much sooner the "
            "run would end without the delay, by replay):",
            f"{'rank':>5} {'step':>5} {'collective':<16} {'cause':<13} {'cost_ms':>9} "
            f"{'excess_ms':>9} {'late_ms':>9}  op / transfer",
        ]
        for s in listed:
            lines.append(
                f"{s.rank:>5} {s.step:>5} {s.collective:<16} {s.cause:<13} {s.cost_ms:>9.2f} "
                f"{s.excess_ms:>9.2f} {s.late_ms:>9.2f}  {_where(s)}"
            )
        if len(found.stragglers) > len(listed):
            lines.append(f"  ... {len(found.stragglers) - len(listed)} more in --json")
        lines += ["", "per rank:"]
        for r in found.per_rank()[:RANKS_SHOWN]:
            causes = ", ".join(f"{c} {n}" for c, n in sorted(r["causes"].items()))
            lines.append(
                f"  rank {r['rank']}: {r['count']} stragglers, "
                f"cost {r['cost_ms']:.2f} ms ({causes})"
            )
    what_if = found.what_if
    if what_if is not None:
        kinds = ", ".join(f"{k} {v:.3f}" for k, v in what_if.per_kind.items())
        worst = sorted(what_if.per_rank.items(), key=lambda kv: -kv[1])[:RANKS_SHOWN]
        m_w = "-" if what_if.m_w is None else f"{what_if.m_w:.2f}"
        lines += [
            "",
            f"what-if: S = {what_if.slowdown:.3f} (replayed {what_if.t_ms:.2f} ms, ideal "
            f"{what_if.t_ideal_ms:.2f} ms; replay error {what_if.replay_error_us:.3f} us); "
            f"S by kind: {kinds}",
            "  S per rank (highest): "
            + ", ".join(f"{r}: {v:.3f}" for r, v in worst)
            + f"; M_W (worst 3% of ranks {what_if.worst_ranks}) = {m_w}",
        ]
    return lines
