"""`recipes/wrap_existing.py` under `torchrun --nproc-per-node 2`: plain DDP, and on overlapkit.

Both forms train the same model on the same data, so they must print the same losses: adopting
overlapkit changes how gradients are reduced and measured, not what is learned.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train_e2e import kill_tree

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "wrap_existing.py"


def _torchrun(tmp_path: Path, *args: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(RECIPE),
        "--steps",
        "12",
        "--logdir",
        str(tmp_path / "prof"),
        *args,
    ]
    scratch = tmp_path / "tmp"  # torchrun's log directories stay inside the test's directory
    scratch.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # torchrun and the workers it started
        out, err = proc.communicate()
        pytest.fail(f"torchrun ran over 150 s: {args}\n{out[-3000:]}\n{err[-5000:]}")
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-5000:]}"
    return out


def _losses(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step\s+(\d+)\s+loss (\d+\.\d+)", stdout)}


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_wrap_existing_trains_the_same_as_plain_ddp_and_reports_exposed_comm(tmp_path):
    plain = _torchrun(tmp_path)
    assert not (tmp_path / "prof").exists()  # the plain form has no profiler
    adopted = _torchrun(tmp_path, "--overlapkit", "ddp")
    plain_losses, adopted_losses = _losses(plain), _losses(adopted)
    assert sorted(plain_losses) == [0, 10, 11]
    assert plain_losses[11] < plain_losses[0] - 0.5
    assert adopted_losses == pytest.approx(plain_losses, abs=2e-4)
    profiled = re.findall(r"profiled step (\d+): .* exposed comm (\d+\.\d+) ms", adopted)
    assert [int(step) for step, _ in profiled] == [2, 3, 4]
    assert sorted(p.name.split(".")[0] for p in (tmp_path / "prof").glob("*.pt.trace.json")) == [
        "rank0",
        "rank1",
    ]
