"""Readable text of a ``RunReport``: per step, per rank table; per rank totals; cross-rank view."""

from __future__ import annotations

from overlapkit.profiling.analysis import RunReport, StepMetrics, cross_rank, rank_totals

MiB = 1024 * 1024


def _collectives(row: StepMetrics) -> str:
    parts = []
    for kind, stats in row.kinds.items():
        size = "?" if stats.nbytes is None else f"{stats.nbytes / MiB:.2f} MiB"
        exposed = f" ({stats.exposed_ms:.2f} ms exposed)" if kind == "send_recv" else ""
        parts.append(f"{kind} {stats.count}x {size}{exposed}")
    return ", ".join(parts) or "-"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.0f}%"


def format_report(report: RunReport) -> str:
    """The table printed by ``overlapkit report`` (times in ms)."""
    ranks = sorted({r.rank for r in report.steps})
    lines = [
        f"overlapkit report: {report.run_dir} ({len(report.files)} trace files, "
        f"{len(ranks)} ranks, {len({r.step for r in report.steps})} steps)",
        "",
        f"{'step':>5} {'rank':>4} {'step_ms':>9} {'compute_ms':>10} {'comm_ms':>9} "
        f"{'exposed_ms':>10} {'tail_ms':>8} {'overlap':>7}  collectives",
    ]
    for row in report.steps:
        lines.append(
            f"{row.step:>5} {row.rank:>4} {row.step_ms:>9.2f} {row.compute_ms:>10.2f} "
            f"{row.comm_ms:>9.2f} {row.exposed_comm_ms:>10.2f} {row.tail_ms:>8.2f} "
            f"{_pct(row.overlap_ratio):>7}  {_collectives(row)}"
        )
    lines += ["", "per rank, summed over its steps:"]
    for total in rank_totals(report.steps):
        share = "-" if total["overlap_pct"] is None else f"{total['overlap_pct']:.0f}%"
        lines.append(
            f"  rank {total['rank']}: {total['steps']} steps, compute {total['compute_ms']:.2f} "
            f"ms, comm {total['comm_ms']:.2f} ms, exposed {total['exposed_comm_ms']:.2f} ms "
            f"(tail {total['tail_ms']:.2f} ms), comm hidden: {share}"
        )
    if len(ranks) > 1:
        lines += [
            "",
            "across ranks (comm spread = max - min comm_ms: time spent waiting for a straggler):",
            f"{'step':>5} {'slowest':>7} {'step_ms min..max':>18} "
            f"{'comm_ms min (rank)':>19} {'max (rank)':>13} {'spread':>8}",
        ]
        for c in cross_rank(report.steps):
            lines.append(
                f"{c.step:>5} {c.slowest_rank:>7} "
                f"{f'{c.fastest_step_ms:.2f}..{c.slowest_step_ms:.2f}':>18} "
                f"{f'{c.min_comm_ms:.2f} ({c.min_comm_rank})':>19} "
                f"{f'{c.max_comm_ms:.2f} ({c.max_comm_rank})':>13} {c.comm_spread_ms:>8.2f}"
            )
    if report.skipped:
        lines += ["", "skipped files:"]
        lines += [f"  {s['file']}: {s['reason']}" for s in report.skipped]
    if report.warnings:
        lines += ["", "warnings:"]
        lines += [f"  {w}" for w in report.warnings]
    return "\n".join(lines)
