"""The data-parallel cases of ``bench.ddp_overlap`` and ``bench.scaling``, and their timing.

Every case is a step function (forward, backward, and what the case does with the gradients)
built on each rank from the same workload; ``rank_main`` runs them interleaved round-robin, so
that machine noise hits all cases alike. The case names and what they do are listed in
``bench.ddp_overlap``'s docstring.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import overlapkit as ok
from bench.harness.device import enter_device, settle
from bench.harness.workloads import workload_of
from overlapkit.ddp.bucket_size import default_bucket_mb
from overlapkit.train.models.workload import DEFAULT_SIZES

BASELINE = "ddp_default"
OPTIMIZER_BASELINE = "ddp_opt"
# Cases the report needs whatever ``--only`` says (T_compute, T_comm, T_no_overlap, the baseline).
REFERENCE_CASES = ("compute_only", "comm_only", "no_overlap", BASELINE)
OPTIMIZER_CASES = (OPTIMIZER_BASELINE, "bucketer_opt", "bucketer_overlap", "ddp_opt_default")
TAIL_CASE = "bucketer_overlap@tail"  # + forward_order_tail, with --tails
CLIPPED_CASES = ("ddp_opt_clip", "bucketer_opt_clip", "bucketer_overlap_clip")
CLIPPED_TAIL_CASE = "bucketer_overlap_clip@tail"  # + forward_order_tail, with --tails
# ok.ddp + the optimizer with gradients copied in and out of the buckets or kept as views of
# them (gradient_as_bucket_view), each with zero_grad() freeing the gradients (torch's default)
# and zero_grad(set_to_none=False) zeroing them in place: what ok.ddp's default was chosen on.
VIEW_CASES = ("ok_ddp_copy", "ok_ddp_view", "ok_ddp_copy_zeroed", "ok_ddp_view_zeroed")
VIEW_BASELINE = VIEW_CASES[0]
MAX_NORM = 1.0
"""What the clipped cases clip the global gradient norm to (train.clip_grad_norm's default)."""


def with_optimizer(name: str) -> bool:
    """Whether case ``name`` includes the optimizer step (timed as blocks of steps)."""
    return (
        name in OPTIMIZER_CASES
        or name in CLIPPED_CASES
        or name in VIEW_CASES
        or name.startswith((TAIL_CASE, CLIPPED_TAIL_CASE))
    )


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
}


def _flat_allreduce(flat: torch.Tensor) -> None:
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())


def optimizer_cases(
    cfg: dict, new_model: Callable[[], nn.Module], loss: Callable, *, max_norm: float | None = None
) -> tuple[dict[str, Callable[[], None]], dict[str, Callable[[], None]]]:
    """The cases with an optimizer step and what ends a block of steps.

    Without ``max_norm``, ``OPTIMIZER_CASES`` (and ``TAIL_CASE<N>`` with ``--tails``); with it,
    ``CLIPPED_CASES`` (and ``CLIPPED_TAIL_CASE<N>``): the same cases clipping the global gradient
    norm to ``max_norm``, DDP and the synchronous bucketer with ``clip_grad_norm_`` before the
    step, the per-bucket ones with ``bucketer.step(clip_grad_norm=max_norm)``.
    """
    make_optimizer = OPTIMIZERS[cfg["optimizer"]]

    def clip(params: Callable[[], object]) -> None:
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params(), max_norm)

    def ddp_step(**ddp_kwargs) -> Callable[[], None]:
        ddp = DistributedDataParallel(new_model(), **ddp_kwargs)
        ddp_opt = make_optimizer(ddp.parameters())

        def step() -> None:
            loss(ddp).backward()
            clip(ddp.parameters)
            ddp_opt.step()
            ddp_opt.zero_grad()

        return step

    sync_model = new_model()
    sync = ok.GradBucketer(sync_model)
    sync_opt = make_optimizer(sync_model.parameters())

    def sync_step() -> None:
        loss(sync_model).backward()
        sync.wait()
        clip(sync_model.parameters)
        sync_opt.step()
        sync_opt.zero_grad()

    def per_bucket(tail: int | None = None) -> tuple[Callable[[], None], Callable[[], None]]:
        model = new_model()
        bucketer = ok.GradBucketer(
            model, optimizer=make_optimizer(model.parameters()), forward_order_tail=tail
        )

        def step() -> None:
            loss(model).backward()
            bucketer.step(clip_grad_norm=max_norm)

        return step, bucketer.synchronize

    # The DDP case is set up as the bucketers are: the same bucket size, and gradients kept as
    # views of the buckets (otherwise DDP copies each into its bucket and back, every step).
    # ddp_opt_default keeps DDP's defaults (25 MiB buckets, copies): ~1.16x slower here, which
    # measures those two settings, not the bucketer (docs/ddp.md).
    matched = ddp_step(
        bucket_cap_mb=default_bucket_mb(list(sync_model.parameters())),
        gradient_as_bucket_view=True,
    )
    overlap_step, overlap_finish = per_bucket()
    names, tail_name = (
        (OPTIMIZER_CASES, TAIL_CASE) if max_norm is None else (CLIPPED_CASES, CLIPPED_TAIL_CASE)
    )
    cases = [matched, sync_step, overlap_step]
    if max_norm is None:
        cases.append(ddp_step())
    steps = dict(zip(names, cases, strict=True))
    finish = {names[2]: overlap_finish}
    for tail in cfg.get("tails", []):
        steps[f"{tail_name}{tail}"], finish[f"{tail_name}{tail}"] = per_bucket(tail)
    return steps, finish


def view_cases(
    cfg: dict, new_model: Callable[[], nn.Module], loss: Callable
) -> dict[str, Callable[[], None]]:
    """``VIEW_CASES``: ``ok.ddp`` (its default bucket size) and the optimizer, one step each.

    ``gradient_as_bucket_view`` is passed explicitly in every case, so the cases measure the
    setting whatever ``ok.ddp``'s default is.
    """
    make_optimizer = OPTIMIZERS[cfg["optimizer"]]

    def ok_ddp_step(*, view: bool, set_to_none: bool) -> Callable[[], None]:
        model = ok.ddp(new_model(), gradient_as_bucket_view=view)
        optimizer = make_optimizer(model.parameters())

        def step() -> None:
            loss(model).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)

        return step

    settings = ((False, True), (True, True), (False, False), (True, False))
    return {
        name: ok_ddp_step(view=view, set_to_none=set_to_none)
        for name, (view, set_to_none) in zip(VIEW_CASES, settings, strict=True)
    }


def _build_cases(
    cfg: dict, rank: int
) -> tuple[dict[str, Callable[[], None]], list[float], int, dict[str, Callable[[], None]]]:
    """Step functions by case name (each runs one full step and returns when it is done), the
    list the compute-only case appends its forward times (ms) to, the gradient element count,
    and, for the cases timed as blocks of steps, what ends a block (``OPTIMIZER_CASES``).
    """
    workload = workload_of(cfg, rank)
    new_model, loss = workload.new_model, workload.loss
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
        optimizer_steps, finish = optimizer_cases(cfg, new_model, loss)
        cases |= optimizer_steps
        clipped_steps, clipped_finish = optimizer_cases(cfg, new_model, loss, max_norm=MAX_NORM)
        cases |= clipped_steps
        finish |= clipped_finish
        cases |= view_cases(cfg, new_model, loss)
    only = cfg.get("only")
    if only:
        cases = {
            n: f
            for n, f in cases.items()
            if n in only or n in REFERENCE_CASES or n.startswith((TAIL_CASE, CLIPPED_TAIL_CASE))
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
            if with_optimizer(name):
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


def workload_config(args: argparse.Namespace, *, sweep: list[float]) -> dict:
    """The per-rank workload (``rank_main``'s ``cfg``) from the command line's model options.

    Raises:
        SystemExit: ``--steps``, ``--rounds`` and ``--warmup`` would time no step of a case.
    """
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        raise SystemExit(
            f"--steps {args.steps}, --rounds {args.rounds}, --warmup {args.warmup}: each case "
            "needs --steps >= 1 and --rounds >= 1, and --warmup >= 0"
        )
    if args.rounds == 1 and args.steps <= args.warmup:
        # Only the first round has warm-up steps; with no other round nothing would be timed.
        raise SystemExit(
            f"--rounds 1 with --steps {args.steps} <= --warmup {args.warmup} times no step: "
            f"pass --steps > {args.warmup}, fewer --warmup steps, or --rounds 2 or more"
        )
    defaults = DEFAULT_SIZES[args.model]
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
