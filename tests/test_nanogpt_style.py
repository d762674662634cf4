"""nanoGPT's training loop adopted to ``GradBucketer(optimizer=)`` (``tests/nanogpt_style.py``)
under real torchrun, ``grad_clip`` 1.0 and 0.0: exit 0, and losses, checkpoints and final
parameters bitwise those of the synchronous form."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def nanogpt_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("nanogpt")
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "tests.nanogpt_style",
            str(out),
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, out


@pytest.mark.slow
def test_nanogpt_style_loop_exits_zero_under_torchrun(nanogpt_run):
    proc, _ = nanogpt_run
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "terminate called" not in output and "FAILED" not in output, output[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_nanogpt_style_loop_equals_synchronous_form_bitwise(nanogpt_run, grad_clip):
    proc, out = nanogpt_run
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for rank in (0, 1):
        saved = torch.load(out / f"rank{rank}.pt", weights_only=False)
        sync, overlap = saved["runs"]["sync", grad_clip], saved["runs"]["overlap", grad_clip]
        assert overlap["losses"] == sync["losses"]
        assert len(overlap["losses"]) == 9 + 3  # 9 iterations, 3 evaluations
        params_sync = saved["params"]["sync", grad_clip]
        params_overlap = saved["params"]["overlap", grad_clip]
        assert "lm_head.weight" not in params_sync  # tied to wte.weight: listed once
        for name, value in params_sync.items():
            assert torch.equal(params_overlap[name], value), (rank, name)
    for iter_num in (4, 8):
        a = torch.load(out / f"ckpt-sync-{grad_clip}-{iter_num}.pt", weights_only=False)
        b = torch.load(out / f"ckpt-overlap-{grad_clip}-{iter_num}.pt", weights_only=False)
        for name, value in a["model"].items():
            assert torch.equal(b["model"][name], value), (iter_num, name)
        for key, state in a["optimizer"]["state"].items():
            for field, value in state.items():
                assert torch.equal(b["optimizer"]["state"][key][field], value), (key, field)
