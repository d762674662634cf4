"""The GPU check of issue 9: exercise overlapkit's CUDA paths on one NVIDIA GPU, PASS/FAIL each.

Items (``bench/gpu/check.sh`` runs them all; ``--only a,b`` picks some):

    cuda          torch sees a CUDA device and NCCL
    ddp_nccl      under ``torchrun --nproc-per-node 1`` (NCCL, world size 1): ``ok.ddp`` with the
                  fp32, bf16 and fp16 hooks and ``ok.GradBucketer`` give the gradients of a plain
                  backward (exact for fp32, within bf16/fp16 rounding for the compressed hooks)
    comm_stats    CUDA-event timings: every ``ok.comm_stats`` record of those runs completed, and
                  every duration is > 0 ms
    report        a profiled ``ok.ddp`` run on two NCCL ranks sharing this one GPU (CUDA MPS
                  + ``NCCL_HOSTID``, ../shared/EMULATION.md; at world size 1 NCCL launches no
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
Outputs (worker results, subprocess logs, the trace, ``gpu_check.json``) go to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gzip
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

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
HOOK_TOLERANCE = {"fp32": 1e-6, "bf16": 1e-2, "fp16": 1e-2, "bucketer": 1e-6}
"""Largest gradient error, relative to the largest gradient, per path (world size 1)."""
SKIPPED = 3
CHECK_MODULE = ("-m", "bench.gpu.check")
"""How torchrun starts this module's workers (from the working directory, the checkout's root)."""
HTA_TOLERANCE_POINTS = 1.0
"""Largest |overlapkit - HTA| whole-trace overlap, percentage points; 0.5 was measured on the
H200 (issue 14) and on synthetic traces (tests/test_trace_hta.py), HTA rounds to whole µs."""
FSDP_TOLERANCE = 1e-4
"""Largest parameter difference from the unsharded reference after 3 steps (fp32; TF32 off)."""


# ------------------------------------------------------------------------------ the worker


def worker(out: Path) -> None:
    """The torchrun rank at world size 1: the DDP hooks and the bucketer; writes a JSON."""
    import overlapkit as ok
    from overlapkit.train.models import MLP, MLPConfig

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = MLP(MLPConfig(width=512, n_layer=4)).to(device)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 512, generator=g).to(device)
    y = torch.randn(64, 512, generator=g).to(device)

    def loss(model: torch.nn.Module) -> torch.Tensor:
        return (model(x) - y).pow(2).mean()

    reference = copy.deepcopy(base)
    loss(reference).backward()
    ref = [p.grad for p in reference.parameters()]
    scale = max(r.abs().max().item() for r in ref)
    device_ids = [local] if cuda else None

    def record(model: torch.nn.Module, owner: Any, step: Callable[[], None]) -> dict:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            step()
        if cuda:
            torch.cuda.synchronize()
        err = max(
            (p.grad - r).abs().max().item() for p, r in zip(model.parameters(), ref, strict=True)
        )
        records = ok.comm_stats(owner).records
        durations = [r.comm_ms for r in records]
        return {
            "max_rel_err": err / scale,
            "records": len(records),
            "complete": sum(d is not None for d in durations),
            "min_comm_ms": min((d for d in durations if d is not None), default=None),
        }

    results: dict[str, Any] = {
        "backend": dist.get_backend(),
        "device": device.type,
        "world_size": dist.get_world_size(),
        "paths": {},
    }
    for name, compress in (("fp32", None), ("bf16", "bf16"), ("fp16", "fp16")):
        model = ok.ddp(copy.deepcopy(base), compress=compress, bucket_mb=1, device_ids=device_ids)
        results["paths"][name] = record(model, model, lambda m=model: loss(m).backward())
    plain = copy.deepcopy(base)
    bucketer = ok.GradBucketer(plain, bucket_mb=1)

    def bucketer_step() -> None:
        loss(plain).backward()
        bucketer.wait()

    results["paths"]["bucketer"] = record(plain, bucketer, bucketer_step)
    (out / f"worker_rank{rank}.json").write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


def _init_shared_gpu() -> torch.device:
    """Join a two-rank group; on CUDA both ranks share GPU 0 as two NCCL "hosts".

    ``NCCL_HOSTID`` differs per rank, so NCCL connects the ranks through its socket transport
    over loopback (real NCCL kernels on one GPU); it must be set before the group is created.
    """
    cuda = torch.cuda.is_available()
    if cuda:
        rank = int(os.environ["RANK"])
        os.environ.setdefault("NCCL_HOSTID", f"host{rank}")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    return torch.device("cuda", 0) if cuda else torch.device("cpu")


def shared_gpu_worker(out: Path) -> None:
    """One of two torchrun ranks on one GPU: a profiled ``ok.ddp`` run, then ``ok.fsdp``."""
    import overlapkit as ok
    from overlapkit.train.models import MLP, MLPConfig

    device = _init_shared_gpu()
    rank = dist.get_rank()
    # On the GPU, enough compute per step to hide part of the all-reduce; small for a CPU dry run.
    width, batch = (1024, 512) if device.type == "cuda" else (128, 32)
    torch.manual_seed(0)
    base = MLP(MLPConfig(width=width, n_layer=8)).to(device)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g).to(device)
    y = torch.randn(batch, width, generator=g).to(device)

    profiled = ok.ddp(copy.deepcopy(base), bucket_mb=4)
    with ok.profile(out / "profile_2ranks", wait=1, warmup=1, active=3) as prof:
        for _ in range(5):
            profiled.zero_grad(set_to_none=True)
            (profiled(x) - y).pow(2).mean().backward()
            prof.step()
    results: dict[str, Any] = {
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "profile_files": [str(f) for f in prof.files],
    }

    # ok.fsdp against an unsharded reference fed the concatenation of both ranks' batches.
    xs, ys = [torch.empty_like(x) for _ in range(2)], [torch.empty_like(y) for _ in range(2)]
    dist.all_gather(xs, x)
    dist.all_gather(ys, y)
    reference = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    sharded = ok.fsdp(copy.deepcopy(base), prefetch=1)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.01)
    for _ in range(3):
        (reference(torch.cat(xs)) - torch.cat(ys)).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        (sharded(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    full = {n: p.full_tensor() for n, p in sharded.named_parameters()}
    results["fsdp"] = {
        "max_param_diff": max(
            (full[n] - p).abs().max().item() for n, p in reference.named_parameters()
        ),
        "peak_forward_blocks": max(s.forward_peak_blocks for s in ok.fsdp_stats(sharded).steps),
    }
    (out / f"shared_gpu_rank{rank}.json").write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ judging (pure)


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


# ------------------------------------------------------------------------------ the driver


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
