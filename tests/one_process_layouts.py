"""The 4-rank layouts checked against one process, all in one launch of 4 gloo ranks.

Pipeline layouts (tests/test_pipeline.py), tp, hsdp and ep (test_train_parallel_nd.py), cp
(test_context_parallel.py) and tensor parallel's in-layer modes (test_inlayer_tp.py) each train
on the 4 ranks and compare with one process running the unsplit model; each test module reads
its part of the results (``one_process_layouts`` in tests/conftest.py). A launch costs seconds of
process start-up and process-group set-up for a second or two of training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.multiproc import run_on_ranks

COLLECTIVE_TIMEOUT_S = 30.0
"""Every collective's timeout; the planned mesh groups must have it too (not 30 min)."""


def _every_part(rank: int, world_size: int, profile_dir: str) -> dict[str, Any]:
    from tests.test_context_parallel import _cp_layouts_match_the_whole_sequences
    from tests.test_inlayer_tp import tp_modes_match_one_process
    from tests.test_pipeline import _layouts_match_one_process
    from tests.test_train_parallel_nd import _layouts_match_the_unsharded_model

    return {
        "pipeline": _layouts_match_one_process(rank, world_size, profile_dir),
        "nd": _layouts_match_the_unsharded_model(rank, world_size),
        "cp": _cp_layouts_match_the_whole_sequences(rank, world_size),
        "inlayer_tp": tp_modes_match_one_process(rank, world_size),
    }


def run_one_process_layouts(profile_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every part on 4 ranks (the pipeline's profiled case traced into ``profile_dir``); per
    part, its results in rank order."""
    results = run_on_ranks(
        _every_part,
        4,
        str(profile_dir),
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        total_timeout_s=560,
    )
    return {part: [result[part] for result in results] for part in results[0]}
