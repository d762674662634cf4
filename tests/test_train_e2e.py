"""``overlapkit-train`` end to end: the real Hydra app, torch elastic, 2 gloo ranks, small gpt_tiny.

Each test starts ``python -m overlapkit.train.launch.entry`` (what the console script runs) in a
temporary directory and reads what the run left: ``summary.json``, the TensorBoard event files,
the profiler traces and the DCP checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

SMALL = [
    "model.config.n_layer=2",
    "model.config.n_embd=32",
    "model.config.n_head=2",
    "model.config.block_size=32",
    "train.batch_size=4",
    "train.progress=false",
    "optim.optimizer.lr=1e-2",
    "optim.scheduler.warmup_steps=2",
    "launcher.threads_per_rank=1",
    "launcher.collective_timeout_s=60",
    "launcher.rdzv_timeout_s=60",
    "train.device=cpu",  # gloo ranks on GPU hosts too; bench/gpu/check.py trains on NCCL
]
REPO = Path(__file__).resolve().parent.parent
PARALLEL = ["ddp", "ddp_bf16", "bucketer", "fsdp", "fsdp_prefetch2", "zero1"]


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant (torch elastic may start workers in new sessions)."""
    family, pending = [], [pid]
    while pending:
        parent = pending.pop()
        family.append(parent)
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                pending.extend(int(child) for child in children.read_text().split())
    for member in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def _scratch(cwd: Path) -> Path:
    scratch = cwd.parent / f"{cwd.name}-tmp"
    scratch.mkdir(exist_ok=True)
    return scratch


def _pythonpath() -> str:
    """This checkout's root first, then whatever the environment had."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def _start(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    # Hydra's flags (-m) go before the overrides: its parser takes the overrides as one list.
    flags = [a for a in args if a.startswith("-")]
    overrides = [a for a in args if not a.startswith("-")]
    return subprocess.Popen(
        [sys.executable, "-m", "overlapkit.train.launch.entry", *flags, *SMALL, *overrides],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # torch's own scratch files (elastic logs, caches) stay inside the test's directory;
        # the workers import launcher.worker_init hooks from tests/ (tests.faults).
        env={
            **os.environ,
            "TMPDIR": str(_scratch(cwd)),
            "PYTHONPATH": _pythonpath(),
            **(env or {}),
        },
    )


def _finish(proc: subprocess.Popen, timeout_s: float = 240) -> str:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"overlapkit-train ran over {timeout_s} s:\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-5000:]}"
    return out + err


def _train(args: list[str], cwd: Path, timeout_s: float = 240) -> str:
    return _finish(_start(args, cwd), timeout_s)


def _losses(run_dir: Path) -> dict[int, float]:
    """``train/loss`` by step from every TensorBoard directory of the run (all invocations)."""
    losses = {}
    for events in sorted((run_dir / "tb").iterdir()):
        acc = EventAccumulator(str(events))
        acc.Reload()
        losses.update({e.step: e.value for e in acc.Scalars("train/loss")})
    return losses


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


RECIPE_SWEEP = [
    f"parallel={','.join(PARALLEL)}",
    "train.steps=8",
    "train.grad_accum=2",
    "train.checkpoint_every=0",
]
"""Every 2-rank recipe for 8 steps; tests/test_train_parallel_nd.py runs its 4-rank layouts with
the same settings and takes this sweep's ddp job as the reference of tp_dp (2 batch shards)."""


def run_recipe_sweep(directory: Path) -> tuple[Path, str]:
    """Run ``RECIPE_SWEEP`` (profiled) in ``directory``; return its sweep directory and output."""
    sweep = directory / "sweep"
    profiled = ["profiler=on", "profiler.wait=1", "profiler.warmup=1", "profiler.active=2"]
    output = _train(
        ["-m", *RECIPE_SWEEP, *profiled, "train.progress=true", f"hydra.sweep.dir={sweep}"],
        directory,
        timeout_s=560,
    )
    return sweep, output


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_each_parallel_recipe_trains_in_its_own_multirun_directory(recipe_sweep):
    sweep, output = recipe_sweep
    assert sorted(p.name for p in sweep.parent.iterdir()) == ["sweep"]  # nothing else written
    losses_of = {}
    for job, parallel in enumerate(PARALLEL):
        run_dir = sweep / str(job)
        assert f"parallel={parallel}" in (run_dir / ".hydra" / "overrides.yaml").read_text()
        summary = _summary(run_dir)
        assert (summary["world_size"], summary["steps_run"], summary["nodes"]) == (2, 8, 1)
        losses = _losses(run_dir)
        assert sorted(losses) == list(range(1, 9))
        assert losses[7] + losses[8] < losses[1] + losses[2] - 0.2, (parallel, losses)
        losses_of[parallel] = losses
        # Profiled: two traced steps per rank, and the exposed share the summary reports.
        traces = sorted(
            p.name.split(".")[0] for p in Path(summary["profile_dir"]).glob("*.pt.trace.json")
        )
        assert traces == ["rank0", "rank1"], traces
        assert summary["profiled_steps"] == 4
        assert 0.0 <= summary["exposed_comm_share"] <= 1.0
        # Live: every wrapper's waits on collectives are seen on every rank, every step.
        live = summary["live"]
        assert [r["steps"] for r in live["per_rank"]] == [8, 8], live
        assert all(r["exposed_ms_per_step"] > 0 for r in live["per_rank"]), (parallel, live)
        assert summary["stragglers"] == []
        [events] = (run_dir / "tb").iterdir()
        scalars = EventAccumulator(str(events))
        scalars.Reload()
        assert [e.step for e in scalars.Scalars("live/exposed_ms")] == list(range(1, 9))
    # Same initial weights, data and averaged gradients: every wrapper follows the same
    # trajectory up to rounding; bf16 gradient compression rounds more.
    for parallel in PARALLEL:
        assert losses_of[parallel][1] == pytest.approx(losses_of["ddp"][1], abs=1e-5)
        tolerance = 2e-2 if parallel == "ddp_bf16" else 1e-3
        assert losses_of[parallel] == pytest.approx(losses_of["ddp"], abs=tolerance), parallel
    assert output.count("exposed comm:") == len(PARALLEL)
    assert output.count("  live: exposed comm ") == len(PARALLEL)
    # What the screen shows: no Kineto "USDT: ... profiler_start" lines in the progress bar, and
    # exposed comm as the live monitor's of the recent steps, not a profiled window's.
    assert "USDT" not in output and "profiler_st" not in output
    shown = re.findall(r"exposed_comm=[0-9.]+ms[^,\]]*", output)
    assert len(shown) >= len(PARALLEL)  # at least each run's final bar
    assert all(s.endswith("ms (live: recent steps)") for s in shown), set(shown)


@contextlib.contextmanager
def _reserved_port() -> Iterator[int]:
    """A free port of 127.0.0.1, kept bound (never listening) by this process until exit.

    Binding a port, closing it and passing the number on lets another process take it in
    between. Held here, the port is refused to every other bind and skipped by the kernel's
    choice of ephemeral ports, but the rendezvous store can still listen on it: torch's
    TCPStore sets SO_REUSEADDR, as this socket does, which Linux allows beside a socket that
    does not listen.
    """
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_a_reserved_port_is_refused_to_others_but_a_tcp_store_listens_on_it():
    with _reserved_port() as port:
        with socket.socket() as other, pytest.raises(OSError, match="Address already in use"):
            other.bind(("127.0.0.1", port))
        timeout = timedelta(seconds=10)
        server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timeout)
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout).set("up", "1")
        assert server.get("up") == b"1"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_launches_with_nnodes_2_form_one_job_of_two_nodes(tmp_path):
    node_dirs = [tmp_path / "node0", tmp_path / "node1"]
    scratch = tmp_path / "tmp"
    for path in (*node_dirs, scratch):
        path.mkdir()
    with _reserved_port() as port:
        args = [
            "launcher=multinode",
            f"launcher.rdzv_endpoint=127.0.0.1:{port}",
            "train.steps=3",
            "train.checkpoint_every=3",
            "name=two_nodes",
        ]
        procs = [
            _start(
                [*args, f"launcher.node_rank={node}"], node_dirs[node], env={"TMPDIR": str(scratch)}
            )
            for node in (0, 1)
        ]
        outputs = [_finish(proc) for proc in procs]
    run_dir = node_dirs[0] / "runs" / "two_nodes"
    topology = json.loads((run_dir / "topology.json").read_text())
    assert topology["world_size"] == 2
    assert topology["nodes"] == [{"node": 0, "ranks": [0]}, {"node": 1, "ranks": [1]}]
    summary = _summary(run_dir)
    assert (summary["world_size"], summary["nodes"], summary["final_step"]) == (2, 2, 3)
    # Both nodes' ranks wrote their shards of one checkpoint in node 0's run directory.
    shards = sorted(p.name for p in (run_dir / "checkpoints" / "step_00000003").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # Node 1 kept no Hydra output, removed its scratch directory, and left without errors.
    assert list(node_dirs[1].iterdir()) == []
    assert list(scratch.glob("overlapkit-node*")) == []
    assert "overlapkit-train two_nodes" in outputs[0] and "Failed to recv" not in outputs[1]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_failing_worker_ends_the_run_with_its_error(tmp_path):
    # A value only the wrapper itself checks, inside the workers: the launch must end, not hang.
    proc = _start(
        ["train.steps=2", "parallel.bucket_mb=-1", f"hydra.run.dir={tmp_path}/r"], tmp_path
    )
    try:
        _, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode == 1
    assert "ValueError: ok.ddp: bucket_mb must be > 0 MiB, got -1" in err


@pytest.mark.timeout(120)
def test_a_refusal_before_launch_is_one_line_without_a_traceback(tmp_path):
    # A preset of 8 ranks for a launch of SMALL's ranks: refused before any worker starts.
    args = ["topology=preset", "topology.name_or_path=dgx-h100", f"hydra.run.dir={tmp_path}/r"]
    proc = _start(args, tmp_path)
    try:
        _, err = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("overlapkit-train: error: topology 'dgx-h100' describes 8"), err
    assert "Traceback" not in err and "HYDRA_FULL_ERROR" not in err, err
