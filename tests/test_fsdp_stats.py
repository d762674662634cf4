"""Memory accounting math and the async reduce-scatter guard of ok.fsdp (no processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlapkit.fsdp import UnshardEvent, unshard_peaks
from overlapkit.fsdp.reduce_scatter import async_reduce_scatter_blocker
from overlapkit.fsdp.stats import ROOT

MiB = 2**20


def _events(*spec: tuple[str, int, str]) -> list[UnshardEvent]:
    return [
        UnshardEvent(kind, block, phase, float(i)) for i, (kind, block, phase) in enumerate(spec)
    ]


def _prefetch_forward(blocks: int, depth: int) -> list[tuple[str, int, str]]:
    """The forward event order of explicit prefetch ``depth`` (0: gather right before use)."""
    if depth == 0:
        return [
            (kind, i, "forward")
            for i in range(blocks)
            for kind in ("all_gather", "compute", "reshard")
        ]
    spec = [("all_gather", b, "forward") for b in range(min(depth, blocks))]  # the root's
    for i in range(blocks):
        if i + depth < blocks:
            spec.append(("all_gather", i + depth, "forward"))
        spec += [("compute", i, "forward"), ("reshard", i, "forward")]
    return spec


def test_peaks_count_the_computing_block_plus_the_prefetched_ones():
    sizes = [4 * MiB] * 6
    for depth in (0, 1, 2):
        peaks = unshard_peaks(_events(*_prefetch_forward(6, depth)), sizes)
        assert peaks["forward"] == (1 + depth, (1 + depth) * 4 * MiB)
        assert peaks["backward"] == (0, 0)


def test_peaks_use_the_bytes_of_the_live_blocks_not_the_largest():
    sizes = [1, 10, 100]
    events = _events(
        ("all_gather", 0, "forward"),
        ("all_gather", 1, "forward"),
        ("reshard", 0, "forward"),
        ("all_gather", 2, "forward"),
    )
    assert unshard_peaks(events, sizes)["forward"] == (2, 110)


def test_peaks_are_per_phase_and_ignore_the_root():
    events = _events(
        ("all_gather", ROOT, "forward"),
        ("all_gather", 0, "forward"),
        ("compute", 0, "forward"),
        ("reshard", 0, "forward"),
        ("all_gather", 0, "backward"),
        ("all_gather", 1, "backward"),
        ("all_gather", 2, "backward"),
    )
    peaks = unshard_peaks(events, [5, 5, 5])
    assert peaks == {"forward": (1, 5), "backward": (3, 15)}


def test_blocks_held_from_the_previous_step_count():
    events = _events(("held", 0, "forward"), ("held", 1, "forward"), ("all_gather", 2, "forward"))
    assert unshard_peaks(events, [1, 1, 1])["forward"] == (3, 3)


def test_reduce_scatter_blocks_when_fsdp_divides_after_a_sum():
    reason = async_reduce_scatter_blocker([], dist.ReduceOp.SUM, torch.float32, group_size=2)
    assert "divides" in reason
    assert async_reduce_scatter_blocker([], dist.ReduceOp.AVG, torch.float32, 2) is None


def test_reduce_scatter_blocks_while_parameters_are_unsharded():
    plain = [torch.nn.Parameter(torch.zeros(2))]
    reason = async_reduce_scatter_blocker(plain, dist.ReduceOp.AVG, torch.float32, 2)
    assert "unsharded" in reason
