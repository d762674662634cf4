"""The GPU check of issue 9: exercise overlapkit's CUDA paths on one NVIDIA GPU, PASS/FAIL each.

Items (``bench/gpu/check.sh`` runs them all; ``--only a,b`` picks some):

    cuda          torch sees a CUDA device and NCCL
    ddp_nccl      under ``torchrun --nproc-per-node 1`` (NCCL, world size 1): ``ok.ddp`` with the
                  fp32, bf16 and fp16 hooks and ``ok.GradBucketer`` give the gradients of a plain
                  backward (exact for fp32, within bf16/fp16 rounding for the compressed hooks)
    comm_stats    CUDA-event timings: every ``ok.comm_stats`` record of those runs completed, and
                  every duration is > 0 ms
    report        a profiled ``ok.ddp`` run on two NCCL ranks sharing this one GPU (CUDA MPS
                  + ``NCCL_HOSTID``, docs/emulation.md; at world size 1 NCCL launches no
                  kernel): the traces hold CUDA kernels, ``overlapkit report --json`` has comm
                  > 0 in every step of both ranks, and where HolisticTraceAnalysis is installed
                  each rank's whole-trace overlap % is HTA's within ``HTA_TOLERANCE_POINTS``
    fsdp_cuda     ``ok.fsdp(prefetch=1)`` on the same two NCCL ranks: parameters after 3 SGD
                  steps equal an unsharded single-GPU reference; at most 2 blocks unsharded
    train_cuda    ``overlapkit-train model=gpt_tiny profiler=on train.device=cuda`` with
                  ``parallel=ddp`` and ``parallel=fsdp`` (one rank, NCCL): every step runs, the
                  loss falls, and the profiled steps' traces hold CUDA kernels
    topo_nvml     NVML describes the GPU (``topology.local_view``) and
                  ``overlapkit topo --detect --json`` reports it (library nccl)
    doctor        ``torchrun --nproc-per-node 1 -m overlapkit.cli doctor --json --quick``:
                  all 8 checks, none broken, backend nccl
    doctor_local  ``overlapkit doctor --json --quick`` starting its own 2 local ranks (with one
                  GPU they measure on gloo; the doctor says so)

Without CUDA every item is skipped with the reason and the exit code is 3, unless
``--allow-cpu`` runs the same plumbing on gloo/CPU (the CUDA-only conditions are then not
required); that dry run is what the test suite exercises. Exit code 0: all passed; 1: a failure.
Outputs (worker results, subprocess logs, the trace, ``gpu_check.json``) go to ``--out``. The
torchrun ranks are ``bench.gpu.workers``; the verdicts, pure functions of what the runs recorded,
``bench.gpu.judges``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from bench.gpu.judges import (
    count_kernels,
    hta_overlap_pct,
    judge_comm_stats,
    judge_ddp,
    judge_doctor,
    judge_fsdp,
    judge_report,
    judge_topo,
    judge_train,
)
from bench.gpu.workers import shared_gpu_worker, worker

ITEMS = (
    "cuda",
    "ddp_nccl",
    "comm_stats",
    "report",
    "fsdp_cuda",
    "train_cuda",
    "topo_nvml",
    "doctor",
    "doctor_local",
)
SKIPPED = 3
CHECK_MODULE = ("-m", "bench.gpu.check")
"""How torchrun starts this module's workers (from the working directory, the checkout's root)."""


def _run(cmd: list[str], log: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    log.write_text(
        f"$ {' '.join(cmd)}\n# exit {done.returncode} after {time.monotonic() - start:.1f} s\n"
        f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    )
    return done


def _json_of(done: subprocess.CompletedProcess) -> dict:
    text = done.stdout
    return json.loads(text[text.index("{") :])


def run_checks(out: Path, only: tuple[str, ...], allow_cpu: bool) -> dict[str, tuple[str, str]]:
    """Run the selected items; ``{item: (PASS|FAIL|SKIP, message)}``."""
    cuda = torch.cuda.is_available()
    results: dict[str, tuple[str, str]] = {}

    def verdict(item: str, judge: Callable[[], tuple[bool, str]]) -> None:
        if item not in only:
            return
        try:
            ok_, message = judge()
        except Exception as err:  # a broken item is a failure with its reason, not a crash
            ok_, message = False, f"{type(err).__name__}: {err}"
        results[item] = ("PASS" if ok_ else "FAIL", message)
        print(f"{results[item][0]}  {item:<13} {message}", flush=True)

    if not cuda and not allow_cpu:
        for item in only:
            results[item] = ("SKIP", "no CUDA device here; this check needs an NVIDIA GPU")
            print(f"SKIP  {item:<13} {results[item][1]}", flush=True)
        return results
    require = cuda
    verdict(
        "cuda",
        lambda: (
            not require or dist.is_nccl_available(),
            f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
            if cuda
            else f"no CUDA (dry run on CPU), torch {torch.__version__}",
        ),
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    worker_json = out / "worker_rank0.json"
    if {"ddp_nccl", "comm_stats"} & set(only):
        _run(
            [*torchrun, "--nproc-per-node", "1", *CHECK_MODULE, "--worker", "--out", str(out)],
            out / "worker.log",
            300,
        )

    def worker_results() -> dict:
        if not worker_json.exists():
            raise RuntimeError(f"the torchrun worker wrote no results; see {out / 'worker.log'}")
        return json.loads(worker_json.read_text())

    verdict("ddp_nccl", lambda: judge_ddp(worker_results(), require_cuda=require))
    verdict("comm_stats", lambda: judge_comm_stats(worker_results()))

    shared_json = [out / f"shared_gpu_rank{rank}.json" for rank in range(2)]
    if {"report", "fsdp_cuda"} & set(only):
        _run(
            [
                *torchrun,
                "--nproc-per-node",
                "2",
                *CHECK_MODULE,
                "--shared-gpu-worker",
                "--out",
                str(out),
            ],
            out / "shared_gpu_worker.log",
            300,
        )

    def shared_results() -> list[dict]:
        missing = [str(f) for f in shared_json if not f.exists()]
        if missing:
            raise RuntimeError(f"no results {missing}; see {out / 'shared_gpu_worker.log'}")
        return [json.loads(f.read_text()) for f in shared_json]

    def report() -> tuple[bool, str]:
        from overlapkit.profiling.analysis import analyze_run, rank_totals

        files = [Path(f) for r in shared_results() for f in r["profile_files"]]
        run = out / "profile_2ranks"
        done = _run(
            [sys.executable, "-m", "overlapkit.cli", "report", str(run), "--json"],
            out / "report.log",
            120,
        )
        kernels = sum(count_kernels(f) for f in files)
        ours = {t["rank"]: t["overlap_pct"] for t in rank_totals(analyze_run(run).steps)}
        return judge_report(
            _json_of(done),
            kernels,
            require_cuda=require,
            ranks=2,
            hta_overlap_pct=hta_overlap_pct(run) if require else None,
            our_overlap_pct=ours,
        )

    verdict("report", report)
    verdict("fsdp_cuda", lambda: judge_fsdp(shared_results(), require_cuda=require))

    def train(parallel: str) -> tuple[bool, str]:
        run = out / f"train_{parallel}"
        steps = 20
        done = _run(
            [
                str(Path(sys.executable).with_name("overlapkit-train")),
                # Not recipe=demo: it sets parallel.bucket_mb, which parallel=fsdp does not take.
                "model=gpt_tiny",
                "profiler=on",
                f"parallel={parallel}",
                f"name=gpu_check_{parallel}",
                f"hydra.run.dir={run}",
                "launcher.nproc_per_node=1",
                f"train.device={'cuda' if cuda else 'cpu'}",
                f"train.steps={steps}",
                "train.resume=false",
                "train.checkpoint_every=0",
            ],
            out / f"train_{parallel}.log",
            600,
        )
        if done.returncode != 0:
            return False, f"exit {done.returncode}; see {out / f'train_{parallel}.log'}"
        summary = json.loads((run / "summary.json").read_text())
        traces = sorted(Path(summary.get("profile_dir") or run).rglob("*.pt.trace.json*"))
        kernels = sum(count_kernels(f) for f in traces)
        return judge_train(summary, kernels, steps=steps, require_cuda=require)

    def train_both() -> tuple[bool, str]:
        verdicts = [train(parallel) for parallel in ("ddp", "fsdp")]
        return all(ok_ for ok_, _ in verdicts), " | ".join(m for _, m in verdicts)

    verdict("train_cuda", train_both)

    def topo() -> tuple[bool, str]:
        from overlapkit.topology.detect import local_view

        view = local_view(rank=0, cuda_index=0 if cuda else None)
        done = _run(
            [sys.executable, "-m", "overlapkit.cli", "topo", "--detect", "--json"],
            out / "topo.log",
            120,
        )
        return judge_topo(view["gpu"], _json_of(done), require_cuda=require)

    verdict("topo_nvml", topo)

    def doctor_torchrun() -> tuple[bool, str]:
        done = _run(
            [
                *torchrun,
                "--nproc-per-node",
                "1",
                "-m",
                "overlapkit.cli",
                "doctor",
                "--json",
                "--quick",
            ],
            out / "doctor.log",
            300,
        )
        return judge_doctor(_json_of(done), backend="nccl" if cuda else "gloo")

    verdict("doctor", doctor_torchrun)

    def doctor_local() -> tuple[bool, str]:
        done = _run(
            [sys.executable, "-m", "overlapkit.cli", "doctor", "--json", "--quick"],
            out / "doctor_local.log",
            300,
        )
        return judge_doctor(_json_of(done), backend=None)

    verdict("doctor_local", doctor_local)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "runs/gpu_check"))
    parser.add_argument("--only", help=f"comma-separated items ({','.join(ITEMS)})")
    parser.add_argument("--allow-cpu", action="store_true", help="dry run on gloo/CPU")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shared-gpu-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args.out)
        return 0
    if args.shared_gpu_worker:
        shared_gpu_worker(args.out)
        return 0
    only = tuple(s.strip() for s in args.only.split(",")) if args.only else ITEMS
    unknown = [s for s in only if s not in ITEMS]
    if unknown:
        parser.error(f"--only: unknown item(s) {unknown}; valid: {', '.join(ITEMS)}")
    start = time.monotonic()
    results = run_checks(args.out, only, args.allow_cpu)
    statuses = {status for status, _ in results.values()}
    summary = {
        "items": {k: {"status": s, "message": m} for k, (s, m) in results.items()},
        "seconds": round(time.monotonic() - start, 1),
        "cuda": torch.cuda.is_available(),
    }
    (args.out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    print(f"gpu_check: {summary['seconds']} s; results in {args.out}")
    if "FAIL" in statuses:
        return 1
    return SKIPPED if statuses == {"SKIP"} else 0


if __name__ == "__main__":
    sys.exit(main())
