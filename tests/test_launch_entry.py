"""``overlapkit-train``'s entry point starts the workers' fork server before it imports anything
heavy itself, except where each Slurm task is one rank and starts no worker."""

from __future__ import annotations

import subprocess
import sys

import pytest

from overlapkit.train.launch.entry import starts_local_workers


def test_the_entry_point_imports_neither_torch_nor_hydra_before_the_server_starts():
    # The server's imports run beside the launcher's only if this module's own are light.
    code = (
        "import sys, overlapkit.train.launch.entry; "
        "print(sorted({'torch', 'hydra', 'overlapkit.train.launch.cli'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.parametrize(
    ("env", "starts"),
    [
        ({}, True),  # not under Slurm
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2"}, True),  # elastic's workers
        ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2"}, False),  # a task per rank
        ({"SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NUM_NODES": "2"}, False),  # refused later
        ({"SLURM_STEP_NUM_TASKS": "", "SLURM_STEP_NUM_NODES": "2"}, True),
    ],
)
def test_the_server_starts_early_unless_each_slurm_task_is_one_rank(env, starts):
    assert starts_local_workers(env) is starts
