"""``torch.compile`` of ``ok.fsdp`` against plain FSDP2, side by side: graph breaks and step time.

One gloo rank compiles the same tiny GPT twice (``aot_eager``): sharded by ``fully_shard`` per
block and on the root (the baseline), and by ``ok.fsdp(prefetch=1)``, whose timing hooks sit
beside FSDP2's. Each case reports the graph breaks of its first step (dynamo's ``graph_break``
counters: what ``TORCH_LOGS=graph_breaks`` prints), how long that compiling step took (the
faster of two, each from an empty dynamo cache), and the median step time over rounds run
interleaved (round-robin, so machine noise hits both alike). The step-time ratio includes what
``ok.fsdp`` does in eager mode too (explicit prefetch, the memory accounting), not only what
compiling costs.

Example::

    python -m bench.fsdp_compile --json bench/results/fsdp_compile.json
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed.fsdp import fully_shard

import overlapkit as ok
from bench.harness.json_report import write_json_report
from overlapkit.train.models import GPT, GPTConfig
from overlapkit.workers.local_ranks import run_on_ranks

BASELINE = "fully_shard"
CASES = (BASELINE, "ok_fsdp")
CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=4, n_embd=64)


def _sharded(case: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if case == BASELINE:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        ok.fsdp(model, prefetch=1, blocks=type(model.blocks[0]))
    return model


def _step_of(model: torch.nn.Module) -> Callable[[], None]:
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size))

    def step() -> None:
        logits = compiled(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _run(rank: int, world_size: int, steps: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    first: dict[str, tuple[int, float]] = {}
    # Each compiled from an empty dynamo cache, twice in turn: the faster of the two leaves out
    # what only the process's first compilation pays.
    for case in CASES * 2:
        torch._dynamo.reset()
        step = _step_of(_sharded(case))
        breaks = sum(counters["graph_break"].values())
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
        first[case] = (
            sum(counters["graph_break"].values()) - breaks,
            min(seconds, first.get(case, (0, seconds))[1]),
        )
    torch._dynamo.reset()
    cases = {case: _step_of(_sharded(case)) for case in CASES}
    for step in cases.values():
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(rounds):
        for case, step in cases.items():
            start = time.perf_counter()
            for _ in range(steps):
                step()
            times[case].append((time.perf_counter() - start) / steps * 1e3)
    return {
        case: {"graph_breaks": first[case][0], "first_step_s": first[case][1], "ms": times[case]}
        for case in cases
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per case")
    parser.add_argument("--json", type=Path, help="write the report here as JSON")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error(f"--steps and --rounds must be >= 1, got {args.steps} and {args.rounds}")
    (result,) = run_on_ranks(_run, 1, args.steps, args.rounds, total_timeout_s=600)
    base = statistics.median(result[BASELINE]["ms"])
    report = {"cases": [], "baseline": BASELINE, "link": {"rate": None, "delay": None}}
    header = ("case", "graph breaks", "first step s", "median ms", "vs base")
    print(f"{header[0]:<12} {header[1]:>12} {header[2]:>12} {header[3]:>10} {header[4]:>8}")
    for name, case in result.items():
        median = statistics.median(case["ms"])
        print(
            f"{name:<12} {case['graph_breaks']:>12} {case['first_step_s']:>12.2f} "
            f"{median:>10.2f} {base / median:>8.2f}"
        )
        report["cases"].append(
            {
                "name": name,
                "median_ms": median,
                "overlap_efficiency": None,
                "speedup_vs_baseline": base / median,
                "graph_breaks": case["graph_breaks"],
                "first_step_s": case["first_step_s"],
            }
        )
    write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
