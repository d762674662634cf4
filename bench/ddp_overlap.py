"""How much gradient all-reduce each data-parallel path hides behind backward, side by side.

Two gloo ranks run every case interleaved in one process group (round-robin, so machine noise hits
all cases alike), behind an emulated scale-out link by default (``--rate 8gbit``; ``--rate none``
for plain loopback). Each timed step starts after a barrier; a step's time is the slower rank's.

Cases:
    compute_only     forward + backward, no communication (also gives the forward time)
    comm_only        one all-reduce of all gradient bytes, no compute
    no_overlap       backward, then one flat all-reduce of the gradients
    ddp_default      torch DistributedDataParallel with its defaults (the baseline)
    ok_ddp           ok.ddp(model) with overlapkit's default bucket size
    bucketer         ok.GradBucketer(model) with its default bucket size
    ok_ddp_bf16      ok.ddp(model, compress="bf16")

With ``--optimizer sgd|adamw`` (default adamw; ``none`` leaves them out), three cases that include
the optimizer step, each timed as ``--steps`` consecutive steps with no barrier in between (the
per-bucket updates of one step overlap the next step's forward, so a barrier per step would hide
their cost); the block ends when every update is applied:
    ddp_opt          DDP default, optimizer.step(), zero_grad()
    bucketer_opt     ok.GradBucketer: wait(), optimizer.step(), zero_grad()
    bucketer_overlap ok.GradBucketer(optimizer=opt): step() (per-bucket updates, the next forward
                     waits per module), same default bucket size
``--profile-dir DIR`` then profiles bucketer_opt and bucketer_overlap with ``ok.profile`` and
reports their exposed communication per step (``overlapkit report DIR/<case>`` for detail).

Models: ``--model mlp`` (default: 8 blocks of Linear(1024) + ReLU, 64 rows per rank) or
``--model gpt_tiny`` (4 blocks, width 256, 2 sequences of 64 tokens per rank).

Overlap efficiency is ``(T_no_overlap - T) / (T_no_overlap - T_bound)`` with
``T_bound = max(T_compute, T_forward + T_comm)``, all medians from this run. Because gloo's
transfers cost CPU on the cores that also compute, the table adds each case's CPU time (all
threads of all ranks) and the efficiency against a CPU-aware bound,
``max(T_bound, (CPU_compute + CPU_comm) / cores)``.

Example::

    python -m bench.ddp_overlap --json bench/results/ddp_overlap.json
    python -m bench.ddp_overlap --rate none --layers 4 --width 512
    python -m bench.ddp_overlap --model gpt_tiny
    python -m bench.ddp_overlap --sweep 1,2,4,8,25   # ok_ddp / bucketer at these bucket sizes
    python -m bench.ddp_overlap --only optimizer --profile-dir runs/bucketer_overlap
    python -m bench.ddp_overlap --only optimizer --tails 0,4   # other forward_order_tail values
    python -m bench.ddp_overlap --device cuda --rate none     # NCCL ranks on GPU 0 (gpu_overlap.sh)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import overlapkit as ok
from bench.harness.cpu_priority import prioritize
from bench.harness.device import backend_for, enter_device, settle
from bench.harness.emulated_link import current_link, enter_emulated_link
from bench.harness.json_report import write_json_report
from bench.profile_exposed import exposed_share
from overlapkit.local_ranks import run_on_ranks
from overlapkit.train.models import GPT, MLP, GPTConfig, MLPConfig

BASELINE = "ddp_default"
OPTIMIZER_BASELINE = "ddp_opt"
# Cases the report needs whatever ``--only`` says (T_compute, T_comm, T_no_overlap, the baseline).
REFERENCE_CASES = ("compute_only", "comm_only", "no_overlap", BASELINE)
OPTIMIZER_CASES = (OPTIMIZER_BASELINE, "bucketer_opt", "bucketer_overlap")
PROFILED = ("bucketer_opt", "bucketer_overlap")
TAIL_CASE = "bucketer_overlap@tail"  # + forward_order_tail, with --tails


def _with_optimizer(name: str) -> bool:
    return name in OPTIMIZER_CASES or name.startswith(TAIL_CASE)


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
}
MODEL_DEFAULTS = {
    "mlp": {"layers": 8, "width": 1024, "batch": 64},
    "gpt_tiny": {"layers": 4, "width": 256, "batch": 2},
}


def make_workload(cfg: dict, rank: int) -> tuple[Callable[[], nn.Module], Callable]:
    """A model factory (same weights on every rank) and ``loss(model)`` on this rank's batch."""
    g = torch.Generator().manual_seed(rank)
    device = torch.device(cfg.get("device", "cpu"))
    if cfg["model"] == "mlp":
        mlp_config = MLPConfig(width=cfg["width"], n_layer=cfg["layers"])
        x = torch.randn(cfg["batch"], cfg["width"], generator=g).to(device)
        y = torch.randn(cfg["batch"], cfg["width"], generator=g).to(device)

        def new_mlp() -> nn.Module:
            torch.manual_seed(0)
            return MLP(mlp_config).to(device)

        return new_mlp, lambda model: (model(x) - y).pow(2).mean()

    gpt_config = GPTConfig(n_layer=cfg["layers"], n_embd=cfg["width"], block_size=cfg["seq_len"])
    tokens = torch.randint(
        0, gpt_config.vocab_size, (cfg["batch"], cfg["seq_len"] + 1), generator=g
    ).to(device)

    def new_gpt() -> nn.Module:
        torch.manual_seed(0)
        return GPT(gpt_config).to(device)

    return new_gpt, lambda model: GPT.loss(model(tokens[:, :-1]), tokens[:, 1:])


def _flat_allreduce(flat: torch.Tensor) -> None:
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())


def _optimizer_cases(
    cfg: dict, new_model: Callable[[], nn.Module], loss: Callable
) -> tuple[dict[str, Callable[[], None]], dict[str, Callable[[], None]]]:
    """The cases with an optimizer step (``OPTIMIZER_CASES``) and what ends a block of steps."""
    make_optimizer = OPTIMIZERS[cfg["optimizer"]]
    ddp = DistributedDataParallel(new_model())
    ddp_opt = make_optimizer(ddp.parameters())
    sync_model = new_model()
    sync = ok.GradBucketer(sync_model)
    sync_opt = make_optimizer(sync_model.parameters())
    overlap_model = new_model()
    overlap = ok.GradBucketer(overlap_model, optimizer=make_optimizer(overlap_model.parameters()))
    tails = {}
    for tail in cfg.get("tails", []):
        model = new_model()
        bucketer = ok.GradBucketer(
            model, optimizer=make_optimizer(model.parameters()), forward_order_tail=tail
        )
        tails[f"{TAIL_CASE}{tail}"] = (model, bucketer)

    def ddp_step() -> None:
        loss(ddp).backward()
        ddp_opt.step()
        ddp_opt.zero_grad()

    def sync_step() -> None:
        loss(sync_model).backward()
        sync.wait()
        sync_opt.step()
        sync_opt.zero_grad()

    def overlap_step() -> None:
        loss(overlap_model).backward()
        overlap.step()

    def tail_step(model: nn.Module, bucketer: ok.GradBucketer) -> Callable[[], None]:
        def step() -> None:
            loss(model).backward()
            bucketer.step()

        return step

    steps = dict(zip(OPTIMIZER_CASES, (ddp_step, sync_step, overlap_step), strict=True))
    steps |= {name: tail_step(*pair) for name, pair in tails.items()}
    finish = {"bucketer_overlap": overlap.synchronize}
    finish |= {name: bucketer.synchronize for name, (_, bucketer) in tails.items()}
    return steps, finish


def _build_cases(
    cfg: dict, rank: int
) -> tuple[dict[str, Callable[[], None]], list[float], int, dict[str, Callable[[], None]]]:
    """Step functions by case name (each runs one full step and returns when it is done), the
    list the compute-only case appends its forward times (ms) to, the gradient element count,
    and, for the cases timed as blocks of steps, what ends a block (``OPTIMIZER_CASES``).
    """
    new_model, loss = make_workload(cfg, rank)
    plain = new_model()
    grad_numel = sum(p.numel() for p in plain.parameters())
    flat = torch.zeros(grad_numel, device=cfg.get("device", "cpu"))
    forward_ms: list[float] = []

    def compute_only() -> None:
        plain.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = loss(plain)
        settle(cfg)
        forward_ms.append((time.perf_counter() - start) * 1e3)
        out.backward()

    def no_overlap() -> None:
        plain.zero_grad(set_to_none=True)
        loss(plain).backward()
        torch.cat([p.grad.view(-1) for p in plain.parameters()], out=flat)
        _flat_allreduce(flat)
        offset = 0
        for p in plain.parameters():
            p.grad.view(-1).copy_(flat[offset : offset + p.numel()])
            offset += p.numel()

    def ddp_step(model: nn.Module) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            loss(model).backward()

        return step

    def bucketer_step(bucket_mb: float | None) -> Callable[[], None]:
        model = new_model()
        kwargs = {} if bucket_mb is None else {"bucket_mb": bucket_mb}
        bucketer = ok.GradBucketer(model, **kwargs)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            loss(model).backward()
            bucketer.wait()

        return step

    cases = {
        "compute_only": compute_only,
        "comm_only": lambda: _flat_allreduce(flat),
        "no_overlap": no_overlap,
        BASELINE: ddp_step(DistributedDataParallel(new_model())),
        "ok_ddp": ddp_step(ok.ddp(new_model())),
        "bucketer": bucketer_step(None),
        "ok_ddp_bf16": ddp_step(ok.ddp(new_model(), compress="bf16")),
    }
    for mb in cfg["sweep"]:
        cases[f"ok_ddp@{mb:g}MB"] = ddp_step(ok.ddp(new_model(), bucket_mb=mb))
        cases[f"bucketer@{mb:g}MB"] = bucketer_step(mb)
    finish: dict[str, Callable[[], None]] = {}
    if cfg.get("optimizer"):
        with_optimizer, finish = _optimizer_cases(cfg, new_model, loss)
        cases |= with_optimizer
    only = cfg.get("only")
    if only:
        cases = {
            n: f
            for n, f in cases.items()
            if n in only or n in REFERENCE_CASES or n.startswith(TAIL_CASE)
        }
    return cases, forward_ms, grad_numel, finish


def rank_main(rank: int, world_size: int, cfg: dict) -> dict:
    """Per case, this rank's wall and CPU ms per timed step (CPU: all threads, gloo's too).

    Cases with an optimizer (``OPTIMIZER_CASES``) give one value per round: the mean step of a
    block of ``steps`` back-to-back steps, ended by the case's ``finish``.
    """
    enter_device(cfg, rank)
    cases, forward_ms, grad_numel, finish = _build_cases(cfg, rank)
    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    for round_index in range(cfg["rounds"]):
        for name, step in cases.items():
            if _with_optimizer(name):
                _time_block(step, finish.get(name), cfg, round_index == 0, wall[name], cpu[name])
                continue
            for i in range(cfg["steps"]):
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                step()
                settle(cfg)
                if round_index > 0 or i >= cfg["warmup"]:
                    wall[name].append((time.perf_counter() - start) * 1e3)
                    cpu[name].append((time.process_time() - cpu_start) * 1e3)
        if rank == 0:
            print(f"  round {round_index + 1}/{cfg['rounds']} done", flush=True)
    wall["forward"] = forward_ms[len(forward_ms) - len(wall["compute_only"]) :]
    return {"wall": wall, "cpu": cpu, "grad_bytes": grad_numel * 4}


def _time_block(
    step: Callable[[], None],
    finish: Callable[[], None] | None,
    cfg: dict,
    first_round: bool,
    wall: list[float],
    cpu: list[float],
) -> None:
    """Append the mean wall and CPU ms of ``cfg["steps"]`` back-to-back steps (after warm-up)."""
    if first_round:
        for _ in range(cfg["warmup"]):
            step()
        if finish is not None:
            finish()
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(cfg["steps"]):
        step()
    if finish is not None:
        finish()
    settle(cfg)
    wall.append((time.perf_counter() - start) * 1e3 / cfg["steps"])
    cpu.append((time.process_time() - cpu_start) * 1e3 / cfg["steps"])


def summarize(per_rank: list[dict[str, list[float]]], combine) -> dict[str, float]:
    """Per case, the median over steps of ``combine`` (max: slowest rank; sum: all ranks)."""
    return {
        name: statistics.median(
            combine(step) for step in zip(*(r[name] for r in per_rank), strict=True)
        )
        for name in per_rank[0]
    }


def build_report(wall: dict[str, float], cpu: dict[str, float], cfg: dict, grad_bytes: int):
    """The benchmark JSON (DESIGN.md keys plus CPU accounting), from medians in ms.

    On CPU, gloo's transfers and reductions run on the same cores as compute, so besides the
    design's ``T_bound`` there is a second lower bound: all CPU work of compute and comm spread
    over the machine's cores. ``overlap_efficiency_cpu`` measures against the larger of the two.
    """
    t_compute, t_comm = wall["compute_only"], wall["comm_only"]
    t_bound = max(t_compute, wall["forward"] + t_comm)
    cores = len(os.sched_getaffinity(0))
    t_cpu_bound = max(t_bound, (cpu["compute_only"] + cpu["comm_only"]) / cores)
    t_no_overlap = wall["no_overlap"]

    def efficiency(t: float, bound: float) -> float:
        return round((t_no_overlap - t) / (t_no_overlap - bound), 3)

    cases = []
    for name, t in wall.items():
        if name == "forward":
            continue
        # Cases with an optimizer step are compared with DDP + the same optimizer only: the
        # efficiency's bounds have no optimizer in them.
        overlapping = name not in ("compute_only", "comm_only", "no_overlap") and not (
            _with_optimizer(name)
        )
        case = {
            "name": name,
            "median_ms": round(t, 2),
            "overlap_efficiency": efficiency(t, t_bound) if overlapping else None,
            "speedup_vs_baseline": round(wall[BASELINE] / t, 3),
            "cpu_ms_all_ranks": round(cpu[name], 2),
            "overlap_efficiency_cpu": efficiency(t, t_cpu_bound) if overlapping else None,
        }
        if _with_optimizer(name):
            case["speedup_vs_ddp_opt"] = round(wall[OPTIMIZER_BASELINE] / t, 3)
            if "bucketer_opt" in wall:
                case["speedup_vs_bucketer_opt"] = round(wall["bucketer_opt"] / t, 3)
        cases.append(case)
    link = current_link() or {"rate": "none (loopback)", "delay": "0ms"}
    return {
        "cases": cases,
        "baseline": BASELINE,
        "link": link,
        "forward_ms": round(wall["forward"], 2),
        "t_bound_ms": round(t_bound, 2),
        "t_cpu_bound_ms": round(t_cpu_bound, 2),
        "cores": cores,
        "grad_mib": round(grad_bytes / 2**20, 2),
        "config": cfg,
    }


def print_table(report: dict) -> None:
    link, cfg = report["link"], report["config"]
    print(
        f"\nlink: {link['rate']} delay {link['delay']}; model {cfg['model']} {cfg['layers']} "
        f"layers x {cfg['width']}, batch {cfg['batch']} per rank, {report['grad_mib']} MiB of "
        f"gradients; forward {report['forward_ms']} ms; T_bound {report['t_bound_ms']} ms; "
        f"CPU-aware bound {report['t_cpu_bound_ms']} ms on {report['cores']} cores"
    )
    print(
        f"{'case':<20} {'median ms':>10} {'overlap eff':>12} {'vs ' + BASELINE:>16} "
        f"{'CPU ms (all ranks)':>19} {'eff vs CPU bound':>17}"
    )
    for case in report["cases"]:
        eff, eff_cpu = case["overlap_efficiency"], case["overlap_efficiency_cpu"]
        print(
            f"{case['name']:<20} {case['median_ms']:>10.1f} "
            f"{'-' if eff is None else f'{eff:.2f}':>12} {case['speedup_vs_baseline']:>15.2f}x "
            f"{case['cpu_ms_all_ranks']:>19.1f} {'-' if eff_cpu is None else f'{eff_cpu:.2f}':>17}"
        )
    with_optimizer = [c for c in report["cases"] if "speedup_vs_ddp_opt" in c]
    if with_optimizer:
        print(f"\nwith {cfg['optimizer']} steps (blocks of {cfg['steps']} back-to-back steps):")
        print(f"{'case':<20} {'median ms':>10} {'vs ddp_opt':>11} {'vs bucketer_opt':>16}")
        for case in with_optimizer:
            print(
                f"{case['name']:<20} {case['median_ms']:>10.1f} "
                f"{case['speedup_vs_ddp_opt']:>10.2f}x "
                f"{case.get('speedup_vs_bucketer_opt', float('nan')):>15.2f}x"
            )


def _profile_rank(rank: int, world_size: int, cfg: dict, root: str) -> None:
    enter_device(cfg, rank)
    new_model, loss = make_workload(cfg, rank)
    steps, finish = _optimizer_cases(cfg, new_model, loss)
    for name in PROFILED:
        with ok.profile(str(Path(root) / name), wait=1, warmup=1, active=cfg["steps"]) as prof:
            for _ in range(2 + cfg["steps"]):
                steps[name]()
                prof.step()
        if name in finish:
            finish[name]()


def profile_exposed_comm(cfg: dict, root: Path) -> dict[str, dict]:
    """Exposed comm per step of ``PROFILED`` under ``ok.profile`` (``overlapkit report``'s math)."""
    for name in PROFILED:
        if any((root / name).glob("*.pt.trace.json*")):
            raise SystemExit(f"{root / name} already holds traces; pass a fresh --profile-dir")
    run_on_ranks(
        _profile_rank,
        2,
        {**cfg, "optimizer": cfg["optimizer"] or "adamw"},
        str(root),
        collective_timeout_s=120,
        total_timeout_s=1800,
        backend=backend_for(cfg),
    )
    out = {name: exposed_share(root / name) for name in PROFILED}
    print(f"\nok.profile, {cfg['steps']} profiled steps per rank:")
    print(f"{'case':<20} {'step ms':>8} {'comm ms':>8} {'exposed ms':>11} {'exposed share':>14}")
    for name, r in out.items():
        print(
            f"{name:<20} {r['median_ms']:>8.1f} {r['comm_ms_per_step']:>8.1f} "
            f"{r['exposed_comm_ms_per_step']:>11.1f} {r['exposed_share']:>14.0%}"
        )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="8gbit", help="tc rate of the emulated link, or 'none'")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (needs netem)")
    parser.add_argument("--model", choices=sorted(MODEL_DEFAULTS), default="mlp")
    parser.add_argument("--layers", type=int, help="blocks (default per model)")
    parser.add_argument("--width", type=int, help="block width (default per model)")
    parser.add_argument("--batch", type=int, help="rows or sequences per rank (default per model)")
    parser.add_argument("--seq-len", type=int, default=64, help="gpt_tiny tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="steps per case per round")
    parser.add_argument("--rounds", type=int, default=5, help="round-robin passes over the cases")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps in the first round")
    parser.add_argument("--sweep", default="", help="comma-separated extra bucket sizes in MiB")
    parser.add_argument(
        "--optimizer",
        choices=[*OPTIMIZERS, "none"],
        default="adamw",
        help="optimizer of the ddp_opt / bucketer_opt / bucketer_overlap cases",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated cases to run besides the reference ones; 'optimizer' means "
        + ",".join(OPTIMIZER_CASES),
    )
    parser.add_argument(
        "--tails",
        default="",
        help="comma-separated forward_order_tail values: extra bucketer_overlap@tail<N> cases",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: two NCCL ranks on GPU 0 (start CUDA MPS first; bench/gpu_overlap.sh does)",
    )
    parser.add_argument(
        "--profile-dir",
        type=Path,
        help="also profile bucketer_opt and bucketer_overlap here and report exposed comm",
    )
    parser.add_argument("--json", type=Path, help="write the report here as JSON")
    return parser.parse_args(argv)


def workload_config(args: argparse.Namespace, *, sweep: list[float]) -> dict:
    """The per-rank workload (``rank_main``'s ``cfg``) from the command line's model options."""
    defaults = MODEL_DEFAULTS[args.model]
    return {
        "model": args.model,
        "layers": args.layers or defaults["layers"],
        "width": args.width or defaults["width"],
        "batch": args.batch or defaults["batch"],
        "seq_len": args.seq_len,
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "sweep": sweep,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if current_link() is None:
        print(f"[cpu priority] {prioritize()}", flush=True)
    enter_emulated_link(args.rate, args.delay_ms)
    cfg = workload_config(args, sweep=[float(s) for s in args.sweep.split(",") if s])
    cfg["optimizer"] = None if args.optimizer == "none" else args.optimizer
    cfg["device"] = args.device
    cfg["tails"] = [int(t) for t in args.tails.split(",") if t]
    only = [c for c in args.only.split(",") if c]
    cfg["only"] = [c for o in only for c in (OPTIMIZER_CASES if o == "optimizer" else (o,))]
    print(f"ddp_overlap: 2 gloo ranks, {cfg}", flush=True)
    results = run_on_ranks(
        rank_main, 2, cfg, collective_timeout_s=120, total_timeout_s=3600, backend=backend_for(cfg)
    )
    report = build_report(
        summarize([r["wall"] for r in results], max),
        summarize([r["cpu"] for r in results], sum),
        cfg,
        results[0]["grad_bytes"],
    )
    print_table(report)
    if args.profile_dir is not None:
        report["profiled"] = profile_exposed_comm(cfg, args.profile_dir)
    write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
