"""Cross-check against HolisticTraceAnalysis (an optional test extra; skipped without it).

HTA's ``get_comm_comp_overlap`` gives one whole-trace percentage per rank for GPU traces: the
share of NCCL kernel time covered by compute kernels. Summed over steps, overlapkit's
``1 - exposed / comm`` is the same quantity, so on random GPU traces they must agree within
0.5 points (HTA rounds timestamps to whole µs; overlapkit does not). By default HTA leaves out
the kernels of the last ``ProfilerStep``; overlapkit keeps them, so the comparison passes
``include_last_profiler_step=True``.
"""

from __future__ import annotations

import logging
import random

import pytest

from bench.harness.synthetic_traces import TraceBuilder
from overlapkit.profiling.analysis import analyze_run, rank_totals

hta_trace_analysis = pytest.importorskip(
    "hta.trace_analysis", reason="HolisticTraceAnalysis is not installed (optional extra)"
)

NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
STEP_US = 10_000.0


def _random_rank_trace(rank: int, seed: int, steps: int = 5) -> TraceBuilder:
    rng = random.Random(seed * 100 + rank)
    t = TraceBuilder(rank=rank, world_size=2)
    for n in range(steps):
        start = 1_000_000.0 + n * STEP_US
        t.step(n + 10, start, start + STEP_US)
        for stream in (7, 8):  # two compute streams
            cursor = start + rng.uniform(0, 300)
            while cursor < start + STEP_US * 0.8:
                dur = round(rng.uniform(20, 900), 3)
                t.kernel(
                    f"gemm_{stream}",
                    cursor,
                    cursor + dur,
                    launch_at=max(start + 1, cursor - 15),
                    stream=stream,
                )
                cursor += dur + round(rng.expovariate(1 / 250), 3)
        cursor = start + rng.uniform(0, 2000)
        while cursor < start + STEP_US * 0.95:  # may run past the step's end
            dur = round(rng.uniform(50, 1500), 3)
            t.kernel(
                NCCL,
                cursor,
                cursor + dur,
                launch_at=max(start + 1, cursor - 40),
                stream=20,
                collective="allreduce",
                nelems=4096,
            )
            cursor += dur + round(rng.expovariate(1 / 600), 3)
    return t


def _hta_overlap_pct(trace_dir) -> dict[int, float]:
    logging.getLogger("hta").setLevel(logging.ERROR)
    analysis = hta_trace_analysis.TraceAnalysis(
        trace_dir=str(trace_dir), include_last_profiler_step=True
    )
    df = analysis.get_comm_comp_overlap(visualize=False)
    return dict(zip(df["rank"], df["comp_comm_overlap_pctg"], strict=True))


def _our_overlap_pct(steps) -> dict[int, float]:
    return {t["rank"]: t["overlap_pct"] for t in rank_totals(steps)}


@pytest.mark.filterwarnings("ignore:The inplace keyword")  # HTA's own pandas usage
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_whole_trace_overlap_matches_hta_within_half_a_point(tmp_path, seed):
    for rank in range(2):
        _random_rank_trace(rank, seed).write(tmp_path / f"rank{rank}.{seed}.pt.trace.json")
    ours = _our_overlap_pct(analyze_run(tmp_path).steps)
    theirs = _hta_overlap_pct(tmp_path)
    assert set(ours) == set(theirs) == {0, 1}
    for rank in (0, 1):
        assert 5 < ours[rank] < 95  # a real mix of hidden and exposed comm
        assert ours[rank] == pytest.approx(theirs[rank], abs=0.5)
