"""The GPU check's verdicts: PASS/FAIL of each item from the results its runs recorded.

Every ``judge_*`` is a pure function of recorded results returning ``(passed, message)``;
``count_kernels`` and ``hta_overlap_pct`` read what they need from profiler traces.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

HOOK_TOLERANCE = {"fp32": 1e-6, "bf16": 1e-2, "fp16": 1e-2, "bucketer": 1e-6}
"""Largest gradient error, relative to the largest gradient, per path (world size 1)."""
HTA_TOLERANCE_POINTS = 1.0
"""Largest |overlapkit - HTA| whole-trace overlap, percentage points; 0.5 was measured on the
H200 (issue 14) and on synthetic traces (tests/test_trace_hta.py), HTA rounds to whole µs."""
FSDP_TOLERANCE = 1e-4
"""Largest parameter difference from the unsharded reference after 3 steps (fp32; TF32 off)."""


def judge_ddp(results: dict, *, require_cuda: bool) -> tuple[bool, str]:
    """``ddp_nccl``: every path ran on NCCL/CUDA and matched the reference gradients."""
    problems = []
    if require_cuda and (results["backend"], results["device"]) != ("nccl", "cuda"):
        problems.append(f"ran on {results['backend']}/{results['device']}, not nccl/cuda")
    for name, tolerance in HOOK_TOLERANCE.items():
        path = results["paths"].get(name)
        if path is None:
            problems.append(f"{name} did not run")
        elif not path["max_rel_err"] <= tolerance:
            problems.append(f"{name} gradient error {path['max_rel_err']:.2e} > {tolerance:g}")
    errors = ", ".join(f"{k} {v['max_rel_err']:.1e}" for k, v in results["paths"].items())
    return not problems, "; ".join(problems) or (
        f"{results['backend']} world size {results['world_size']}; relative errors {errors}"
    )


def judge_comm_stats(results: dict) -> tuple[bool, str]:
    """``comm_stats``: every record of every path completed with a positive duration."""
    problems = []
    for name, path in results["paths"].items():
        if path["records"] == 0:
            problems.append(f"{name}: no record")
        elif path["complete"] != path["records"]:
            problems.append(f"{name}: {path['complete']}/{path['records']} records complete")
        elif not (path["min_comm_ms"] or 0) > 0:
            problems.append(f"{name}: a duration of {path['min_comm_ms']} ms")
    summary = ", ".join(
        f"{k} {v['records']} records, min {v['min_comm_ms'] or 0:.3g} ms"
        for k, v in results["paths"].items()
    )
    return not problems, "; ".join(problems) or summary


def count_kernels(trace_file: Path) -> int:
    """Events of category ``kernel`` (CUDA kernels) in a profiler trace."""
    opener = gzip.open if trace_file.name.endswith(".gz") else open
    with opener(trace_file, "rt") as fh:
        events = json.load(fh).get("traceEvents", [])
    return sum(1 for e in events if str(e.get("cat", "")).lower() == "kernel")


def judge_report(
    report: dict,
    kernels: int,
    *,
    require_cuda: bool,
    ranks: int = 1,
    hta_overlap_pct: dict[int, float] | None = None,
    our_overlap_pct: dict[int, float] | None = None,
) -> tuple[bool, str]:
    """``report``: steps of every rank with comm and exposed comm; CUDA kernels in the traces.

    With HTA's whole-trace overlap percentage per rank (``hta_overlap_pct``), overlapkit's
    (``our_overlap_pct``, from ``rank_totals``) must agree within ``HTA_TOLERANCE_POINTS``.
    """
    steps = report.get("steps", [])
    problems = []
    if not steps:
        problems.append("no step in the report")
    seen_ranks = sorted({s.get("rank", 0) for s in steps})
    if steps and seen_ranks != list(range(ranks)):
        problems.append(f"steps of ranks {seen_ranks}, expected {list(range(ranks))}")
    if any(not isinstance(s.get("exposed_comm_ms"), (int, float)) for s in steps):
        problems.append("a step without exposed_comm_ms")
    if steps and not all(s["comm_ms"] > 0 for s in steps):
        problems.append("a step with no communication")
    devices = {t.get("device") for t in report.get("traces", [])}
    if require_cuda and (kernels == 0 or devices != {"gpu"}):
        problems.append(f"{kernels} CUDA kernel(s), trace device {sorted(map(str, devices))}")
    summary = ", ".join(
        f"rank {s.get('rank', 0)} step {s['step']}: comm {s['comm_ms']:.3g} ms, exposed "
        f"{s['exposed_comm_ms']:.3g} ms"
        for s in steps
    )
    if hta_overlap_pct is not None:
        ours = our_overlap_pct or {}
        for rank in range(ranks):
            mine, theirs = ours.get(rank), hta_overlap_pct.get(rank)
            if mine is None or theirs is None or abs(mine - theirs) > HTA_TOLERANCE_POINTS:
                problems.append(
                    f"rank {rank}: overlap {mine} % vs HTA's {theirs} % (more than "
                    f"{HTA_TOLERANCE_POINTS} point apart)"
                )
        summary += "; overlap % (overlapkit / HTA): " + ", ".join(
            f"rank {r} {ours.get(r, float('nan')):.2f} / {hta_overlap_pct.get(r, float('nan')):.2f}"
            for r in range(ranks)
        )
    return not problems, "; ".join(problems) or f"{kernels} kernels; {summary}"


def judge_fsdp(results: list[dict], *, require_cuda: bool) -> tuple[bool, str]:
    """``fsdp_cuda``: both ranks' parameters equal the unsharded reference; prefetch bounded."""
    problems = []
    for rank, r in enumerate(results):
        if require_cuda and r.get("backend") != "nccl":
            problems.append(f"rank {rank} ran on {r.get('backend')}, not nccl")
        diff, peak = r["fsdp"]["max_param_diff"], r["fsdp"]["peak_forward_blocks"]
        if diff > FSDP_TOLERANCE:
            problems.append(f"rank {rank}: parameters {diff:.2e} from the reference")
        if peak > 2:
            problems.append(f"rank {rank}: {peak} blocks unsharded at once with prefetch=1")
    diffs = ", ".join(f"{r['fsdp']['max_param_diff']:.1e}" for r in results)
    return not problems, "; ".join(problems) or f"parameter diff per rank {diffs}; peak <= 2"


def judge_train(summary: dict, kernels: int, *, steps: int, require_cuda: bool) -> tuple[bool, str]:
    """``train_cuda``: every step ran, the loss fell, the profiled traces hold CUDA kernels."""
    problems = []
    if summary.get("steps_run") != steps:
        problems.append(f"{summary.get('steps_run')} of {steps} steps ran")
    first, last = summary.get("loss_first"), summary.get("loss_last")
    if first is None or last is None or not last < first:
        problems.append(f"loss {first} -> {last} did not fall")
    if require_cuda and kernels == 0:
        problems.append("no CUDA kernel in the profiled steps")
    step_ms = summary.get("median_step_ms")
    return not problems, "; ".join(problems) or (
        f"{summary.get('parallel')}: {steps} steps, loss {first:.3f} -> {last:.3f}, "
        f"{step_ms if step_ms is None else round(step_ms, 1)} ms/step, {kernels} kernels"
    )


def judge_topo(view_gpu: dict | None, topo: dict, *, require_cuda: bool) -> tuple[bool, str]:
    """``topo_nvml``: NVML described the GPU and detection reports an NCCL topology."""
    problems = []
    if require_cuda and not (view_gpu or {}).get("nvml"):
        problems.append("NVML did not describe the GPU (pynvml / driver missing? see the log)")
    if require_cuda and topo.get("library") != "nccl":
        problems.append(f"detected library {topo.get('library')!r}, not 'nccl'")
    domains = ", ".join(f"{d['kind']} {d['ranks']}" for d in topo.get("domains", []))
    name = (view_gpu or {}).get("name", "no GPU")
    return not problems, "; ".join(problems) or (
        f"{name}; {topo.get('world_size')} device(s), library {topo.get('library')}, "
        f"domains {domains}, nvlinks {len((view_gpu or {}).get('nvlinks', []))}"
    )


def judge_doctor(doc: dict, *, backend: str | None) -> tuple[bool, str]:
    """``doctor``: the JSON holds all 8 checks, none broken; the backend when one is required."""
    from overlapkit.doctor.check import CHECK_NAMES

    names = [c["name"] for c in doc.get("checks", [])]
    problems = []
    if names != list(CHECK_NAMES):
        problems.append(f"checks {names}")
    broken = [c["name"] for c in doc.get("checks", []) if c["value"].startswith("error")]
    if broken:
        problems.append(f"broken: {broken}")
    seen = next(
        (c.get("details", {}).get("backend") for c in doc["checks"] if c["name"] == "topology"),
        None,
    )
    if backend is not None and seen != backend:
        problems.append(f"backend {seen!r}, expected {backend!r}")
    statuses = ", ".join(f"{c['name']} {c['status']}" for c in doc.get("checks", []))
    return not problems, "; ".join(problems) or statuses


def hta_overlap_pct(trace_dir: Path) -> dict[int, float] | None:
    """HTA's whole-trace comm/compute overlap % per rank; None when HTA is not installed."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        return None
    # As tests/test_trace_hta.py: overlapkit keeps the last ProfilerStep, so HTA must too.
    frame = TraceAnalysis(
        trace_dir=str(trace_dir), include_last_profiler_step=True
    ).get_comm_comp_overlap(visualize=False)
    pairs = zip(frame["rank"], frame["comp_comm_overlap_pctg"], strict=True)
    return {int(rank): float(pct) for rank, pct in pairs}
