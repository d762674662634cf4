"""A loop that ends right after ``bucketer.step()`` exits 0 with its last step applied.

Before the fix both ranks died of SIGABRT at exit ("terminate called without an active
exception"): a gloo worker completed the last all-reduce while the interpreter finalized and
died taking the GIL to run the future's Python callback (``overlapkit.ddp.reducer``). Each rank
is a real process (``tests/exit_after_step.py``) that ends as a script ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
WORLD_SIZE = 2


@pytest.mark.slow
# "destroy" (dist.destroy_process_group() after the last step) is what tests/nanogpt_style.py
# does under torchrun (tests/test_nanogpt_style.py); here the script just returns.
@pytest.mark.parametrize("mode", ["return"])
def test_loop_ending_in_step_exits_zero_with_the_last_update_applied(mode, tmp_path):
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        WORLD_SIZE,
        is_master=True,
        timeout=timedelta(seconds=60),
        wait_for_workers=False,
    )
    env = {
        **os.environ,
        "WORLD_SIZE": str(WORLD_SIZE),
        "MASTER_PORT": str(store.port),
        "OMP_NUM_THREADS": "1",
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.exit_after_step", mode, str(tmp_path)],
            cwd=REPO,
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    outputs = []
    for proc in ranks:
        try:
            outputs.append(proc.communicate(timeout=120)[0])
        finally:
            proc.kill()
    for rank, proc in enumerate(ranks):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{outputs[rank]}"
        assert "terminate called" not in outputs[rank], outputs[rank]
    for rank in range(WORLD_SIZE):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name, expected in saved["sync"].items():
            assert torch.equal(saved["overlap"][name], expected), (rank, name)
