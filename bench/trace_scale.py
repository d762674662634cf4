"""Trace analysis at scale: MB/s per core, scaling over workers, memory per worker, and HTA on
the same files; and a thousand ranks with stragglers.

1. ``--ranks`` ranks x ``--mb`` MB of GPU-format traces (``harness.kineto_writer``, Kineto's
   layout, one rank each) under a temporary directory, deleted at the end. Each file is
   analysed (``analysis.analyze_file``, what ``overlapkit report`` runs per file) on 1, 2, ...
   spawned worker processes (``--workers``): MB/s per core is the trace's megabytes over the
   workers' own CPU time (process start and imports left out), the scaling is the wall time's
   ratio, the peak memory is each worker's ``ru_maxrss``; beside them, ``json.loads`` and
   msgspec's typed decoding alone on one of the files, the machine's speed at the time (a
   shared machine's CPU time per MB varies with its load). Then ``overlapkit report --json``
   end to end (CPU time of all its processes, peak memory of the largest), and HTA's
   ``TraceAnalysis`` + ``get_potential_stragglers`` on the same directory in its own process
   (its result or its failure, wall time, CPU time, peak memory; ``--hta-timeout``).
2. ``--thousand``: 1,024 ranks x 400 steps of synthetic NCCL traces
   (``bench.harness.synthetic_run``, ``lean``: about 1 MB per rank, 8 ranks per host, clocks off
   by up to 2 s, three injected stragglers) summarised by ``overlapkit report --stragglers --json
   --step-rows 0 --collective-rows 0``: wall and CPU time, and the stragglers it names against
   the injected ones.

The machine's load average is printed before and after: on a shared machine CPU time per MB is
the number that transfers; wall-time scaling needs as many idle cores as workers (the benchmark
asks for a high-priority scheduling group, ``harness.cpu_priority``, as the others do).

Example::

    python -m bench.trace_scale --json bench/results/trace_scale.json
    python -m bench.trace_scale --thousand --skip-files
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.harness.cpu_priority import prioritize
from bench.harness.json_report import write_json_report
from bench.harness.kineto_writer import write_gpu_trace

_SPAWN = multiprocessing.get_context("spawn")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _write(args: tuple) -> dict:
    path, rank, world, mb = args
    return write_gpu_trace(Path(path), rank=rank, world=world, target_mb=mb)


def _measured(path: str) -> dict:
    """One file analysed in this worker: CPU and wall seconds, the worker's peak memory."""
    from overlapkit.profiling.analysis import analyze_file

    cpu, wall = time.process_time(), time.perf_counter()
    result = analyze_file(Path(path))
    return {
        "cpu_s": time.process_time() - cpu,
        "wall_s": time.perf_counter() - wall,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "worker": os.getpid(),
        "steps": 0 if result.steps is None else len(result.steps),
        "error": result.error,
    }


def _baselines(path: str) -> dict:
    """On one file, in a fresh worker: MB/s per core of ``json.loads`` of the whole file and of
    msgspec decoding its events typed (what the fast path does, alone), best of three, CPU
    time: the machine's speed at the time, to read the analysis's number against."""
    from overlapkit.profiling.trace_events import batch_decoder

    data = Path(path).read_bytes()
    start = data.index(b"[", data.index(b'"traceEvents"'))
    events = data[start : data.rindex(b"]") + 1]
    decode = batch_decoder()
    out = {}
    for name, fn in (
        ("json_loads", lambda: json.loads(data)),
        ("msgspec_typed", lambda: decode(events)),
    ):
        best = float("inf")
        for _ in range(3):
            cpu = time.process_time()
            fn()
            best = min(best, time.process_time() - cpu)
        out[name] = round(len(data) / 1e6 / best, 1)
    return out


def measure_workers(files: list[Path], workers: int) -> dict:
    """Every file analysed on ``workers`` spawned processes."""
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers, mp_context=_SPAWN) as pool:
        results = list(pool.map(_measured, [str(f) for f in files]))
    wall = time.perf_counter() - start
    mb = sum(f.stat().st_size for f in files) / 1e6
    cpu = sum(r["cpu_s"] for r in results)
    peaks: dict[int, float] = {}
    for r in results:
        peaks[r["worker"]] = max(peaks.get(r["worker"], 0.0), r["peak_rss_mb"])
    errors = [r["error"] for r in results if r["error"]]
    return {
        "workers": workers,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "mb": round(mb, 1),
        "mb_per_s_per_core": round(mb / cpu, 1),
        "mb_per_s_wall": round(mb / wall, 1),
        "peak_rss_mb_per_worker": sorted(round(p, 1) for p in peaks.values()),
        "errors": errors,
    }


# Runs a command and reports the CPU time and the largest peak memory of it and its children
# on the last line of stderr: RUSAGE_CHILDREN of this process would mix every command's.
_MEASURE = textwrap.dedent(
    """
    import json, resource, subprocess, sys
    done = subprocess.run(sys.argv[1:])
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"rc": done.returncode, "cpu_s": use.ru_utime + use.ru_stime,
                      "peak_rss_mb": use.ru_maxrss / 1024}), file=sys.stderr)
    """
)


def _child(cmd: list[str], timeout: float) -> dict:
    """Run ``cmd``; its wall time, the CPU time of it and its children, and the largest peak
    memory among them."""
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True, timeout=timeout
        )
        out, err = done.stdout, done.stderr
        *rest, last = err.rstrip().splitlines() or [""]
        measured = json.loads(last)
        status, err = measured["rc"], "\n".join(rest)
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout or ""
        status, err, measured = "timeout", f"no result within {timeout:.0f} s", {}
    except (json.JSONDecodeError, KeyError):
        status, measured = "no measurement", {}
    return {
        "status": status,
        "wall_s": round(time.perf_counter() - start, 2),
        "cpu_s": round(measured.get("cpu_s", float("nan")), 2),
        "peak_rss_mb": round(measured.get("peak_rss_mb", float("nan")), 1),
        "stdout": out if isinstance(out, str) else out.decode(errors="replace"),
        "stderr": err if isinstance(err, str) else err.decode(errors="replace"),
    }


_HTA = textwrap.dedent(
    """
    import json, logging, sys
    logging.disable(logging.WARNING)
    from hta.trace_analysis import TraceAnalysis
    try:
        analysis = TraceAnalysis(trace_dir=sys.argv[1])
        stragglers = analysis.get_potential_stragglers()
        print(json.dumps({"ranks": len(analysis.t.get_all_traces()), "stragglers": stragglers}))
    except Exception as err:  # its failure is the result
        print(json.dumps({"failure": f"{type(err).__name__}: {err}"}))
    """
)


def run_hta(directory: Path, timeout: float) -> dict:
    """HTA on ``directory`` in its own process: what it says, or why it said nothing."""
    child = _child([sys.executable, "-c", _HTA, str(directory)], timeout)
    try:
        child["result"] = json.loads(child["stdout"].strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        child["result"] = {"failure": child["stderr"].strip().splitlines()[-1:] or ["no output"]}
    del child["stdout"]
    child["stderr"] = child["stderr"][-400:]
    return child


def files_part(args: argparse.Namespace) -> dict:
    out: dict = {"load_before": _load()}
    with tempfile.TemporaryDirectory(prefix="ovk_trace_scale_", dir=args.tmp) as tmp:
        directory = Path(tmp)
        start = time.perf_counter()
        jobs = [
            (str(directory / f"rank{r}.1.pt.trace.json"), r, args.ranks, args.mb)
            for r in range(args.ranks)
        ]
        with ProcessPoolExecutor(max_workers=2, mp_context=_SPAWN) as pool:
            shapes = list(pool.map(_write, jobs))
        files = sorted(directory.glob("*.pt.trace.json"))
        out["files"] = {
            "ranks": args.ranks,
            "mb_each": round(shapes[0]["mb"], 1),
            "steps_each": shapes[0]["steps"],
            "kernels_each": shapes[0]["kernels"],
            "write_s": round(time.perf_counter() - start, 1),
        }
        print(
            f"wrote {args.ranks} x {shapes[0]['mb']:.1f} MB ({shapes[0]['kernels']} kernels, "
            f"{shapes[0]['steps']} steps each) in {out['files']['write_s']} s",
            flush=True,
        )
        with ProcessPoolExecutor(max_workers=1, mp_context=_SPAWN) as pool:
            out["baselines_mb_per_s"] = pool.submit(_baselines, str(files[0])).result()
        print(
            f"  same file, one core, best of 3: json.loads "
            f"{out['baselines_mb_per_s']['json_loads']} MB/s, msgspec typed decode alone "
            f"{out['baselines_mb_per_s']['msgspec_typed']} MB/s",
            flush=True,
        )
        out["workers"] = []
        for workers in args.workers:
            row = measure_workers(files, workers)
            out["workers"].append(row)
            print(
                f"  {workers} worker(s): {row['wall_s']} s wall, {row['cpu_s']} s CPU: "
                f"{row['mb_per_s_per_core']} MB/s per core, {row['mb_per_s_wall']} MB/s wall; "
                f"peak memory per worker {row['peak_rss_mb_per_worker']} MB "
                f"(load {_load()})",
                flush=True,
            )
        base = out["workers"][0]["wall_s"]
        for row in out["workers"]:
            row["speedup"] = round(base / row["wall_s"] * out["workers"][0]["workers"], 2)
        cli = _child(
            [
                sys.executable,
                "-m",
                "overlapkit.cli",
                "report",
                str(directory),
                "--json",
                "--step-rows",
                "0",
                "--jobs",
                str(max(args.workers)),
            ],
            1800,
        )
        mb = sum(f.stat().st_size for f in files) / 1e6
        out["report_cli"] = {k: cli[k] for k in ("status", "wall_s", "cpu_s", "peak_rss_mb")}
        out["report_cli"]["mb_per_s_per_core"] = round(mb / max(cli["cpu_s"], 1e-9), 1)
        print(
            f"  overlapkit report --json --jobs {max(args.workers)}: {cli['wall_s']} s wall, "
            f"{cli['cpu_s']} s CPU in all its processes (start-up and imports included: "
            f"{out['report_cli']['mb_per_s_per_core']} MB/s per core), peak memory "
            f"{cli['peak_rss_mb']} MB",
            flush=True,
        )
        if not args.skip_hta:
            hta = run_hta(directory, args.hta_timeout)
            out["hta"] = hta
            print(
                f"  HTA TraceAnalysis + get_potential_stragglers: {hta['status']} in "
                f"{hta['wall_s']} s wall, {hta['cpu_s']} s CPU, peak memory "
                f"{hta['peak_rss_mb']} MB; result {hta['result']}",
                flush=True,
            )
    out["load_after"] = _load()
    return out


def _write_ranks(args: tuple) -> None:
    from bench.harness.synthetic_run import write_run

    spec, directory, ranks = args
    write_run(spec, directory, ranks=range(*ranks))


def thousand_part(args: argparse.Namespace) -> dict:
    from bench.harness.synthetic_run import Injection, RunSpec, truth

    injections = (
        Injection(rank=17, step=50, position=0, cause="compute", delay_ms=3.0),
        Injection(rank=500, step=200, position=0, cause="host_gap", delay_ms=2.0),
        Injection(rank=901, step=333, position=0, cause="comm", delay_ms=2.5),
    )
    spec = RunSpec(
        ranks=1024,
        steps=400,
        collectives_per_step=1,
        ops_per_segment=1,
        ranks_per_host=8,
        clock_offset_s=2.0,
        lean=True,
        injections=injections,
    )
    out: dict = {"load_before": _load()}
    with tempfile.TemporaryDirectory(prefix="ovk_thousand_", dir=args.tmp) as tmp:
        start = time.perf_counter()
        halves = [(0, 512), (512, 1024)]
        with ProcessPoolExecutor(max_workers=2, mp_context=_SPAWN) as pool:
            list(pool.map(_write_ranks, [(spec, tmp, h) for h in halves]))
        sizes = [p.stat().st_size for p in Path(tmp).glob("*.json")]
        out["write_s"] = round(time.perf_counter() - start, 1)
        out["mb_per_rank"] = round(sum(sizes) / len(sizes) / 1e6, 2)
        print(
            f"wrote 1,024 ranks x 400 steps ({out['mb_per_rank']} MB per rank) in "
            f"{out['write_s']} s",
            flush=True,
        )
        cli = _child(
            [
                sys.executable,
                "-m",
                "overlapkit.cli",
                "report",
                tmp,
                "--stragglers",
                "--json",
                "--step-rows",
                "0",
                "--collective-rows",
                "0",
                "--jobs",
                "2",
            ],
            3600,
        )
        payload = json.loads(cli["stdout"]) if cli["status"] == 0 else {}
        named = [
            {k: s[k] for k in ("rank", "step", "collective", "cause", "cost_ms")}
            for s in payload.get("stragglers", [])
        ]
        true = truth(spec)
        out["report"] = {k: cli[k] for k in ("status", "wall_s", "cpu_s", "peak_rss_mb")}
        out["named"] = named[:10]
        out["named_count"] = len(named)
        out["injected"] = [
            {"rank": i.rank, "step": i.step, "cause": i.cause, "true_cost_ms": round(c, 4)}
            for i, c in zip(injections, true.costs_ms, strict=True)
        ]
        print(
            f"  overlapkit report --stragglers --json --jobs 2: {cli['status']}, "
            f"{cli['wall_s']} s wall, {cli['cpu_s']} s CPU, peak memory {cli['peak_rss_mb']} MB",
            flush=True,
        )
        print(f"  injected: {out['injected']}\n  named ({len(named)}): {named[:5]}", flush=True)
        if cli["status"] != 0:
            print(cli["stderr"][-2000:])
    out["load_after"] = _load()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--mb", type=float, default=128.0, help="MB of trace per rank")
    parser.add_argument(
        "--workers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2],
        help="worker counts to compare, e.g. 1,2",
    )
    parser.add_argument("--hta-timeout", type=float, default=900.0)
    parser.add_argument("--skip-hta", action="store_true")
    parser.add_argument("--skip-files", action="store_true", help="only --thousand")
    parser.add_argument("--thousand", action="store_true", help="also 1,024 ranks x 400 steps")
    parser.add_argument("--tmp", default=None, help="where the traces go (default: the temp dir)")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"[cpu priority] {prioritize()}", flush=True)
    print(f"trace_scale on {os.cpu_count()} cores, load average {_load()}", flush=True)
    results: dict = {"cores": os.cpu_count()}
    if not args.skip_files:
        results["files"] = files_part(args)
    if args.thousand:
        results["thousand"] = thousand_part(args)
    write_json_report(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
