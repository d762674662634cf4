"""Demo: train a small MLP on 2 local gloo ranks with ``ok.ddp`` and show its comm timings.

Run directly (``make demo`` runs the fuller Hydra recipe, ``overlapkit-train recipe=demo``)::

    torchrun --standalone --nproc-per-node 2 recipes/demo_ddp.py --steps 40

Each rank fits its own shard of a synthetic regression problem; ``ok.ddp`` averages the gradients
with an instrumented all-reduce. At the end rank 0 prints the median step time and, per bucket,
its size, when it was launched relative to the step's first bucket, and how long it took.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

import overlapkit as ok


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64, help="rows per rank")
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--compress", choices=["bf16", "fp16"], default=None)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # two ranks share this machine's cores

    torch.manual_seed(0)  # same initial weights on every rank
    layers: list[nn.Module] = []
    for _ in range(args.layers - 1):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    layers.append(nn.Linear(args.width, 1))
    model = ok.ddp(nn.Sequential(*layers), bucket_mb=args.bucket_mb, compress=args.compress)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # A teacher network defines the target; each rank draws its own shard of inputs.
    teacher = torch.nn.Linear(args.width, 1)
    generator = torch.Generator().manual_seed(1000 + rank)

    step_ms = []
    progress = tqdm(range(args.steps), desc=f"ok.ddp on {world_size} ranks", disable=rank != 0)
    for _ in progress:
        x = torch.randn(args.batch, args.width, generator=generator)
        with torch.no_grad():
            y = torch.tanh(teacher(x))
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
        progress.set_postfix(loss=f"{loss.item():.4f}", step_ms=f"{step_ms[-1]:.1f}")

    if rank == 0:
        buckets = ok.comm_stats(model).by_bucket()
        steady = step_ms[len(step_ms) // 4 :]
        print(
            f"\nmedian step time: {statistics.median(steady):.1f} ms "
            f"(steps {len(step_ms) - len(steady)}..{len(step_ms) - 1}, rank 0)"
        )
        print(f"per-bucket all-reduce (ok.comm_stats, medians over {buckets[0].steps} steps):")
        print(f"{'bucket':>6} {'MiB':>8} {'launch +ms':>11} {'comm ms':>8}")
        for b in buckets:
            print(
                f"{b.bucket_index:>6} {b.nbytes / 2**20:>8.2f} "
                f"{b.median_launch_offset_ms:>11.2f} {b.median_comm_ms:>8.2f}"
            )
    # Free the DDP model before the group: a DDP reducer destroyed after its process group can
    # deadlock with a gloo thread at exit.
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
