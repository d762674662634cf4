"""Wrap your existing script: a plain PyTorch DDP training loop, and the same loop on overlapkit.

::

    torchrun --standalone --nproc-per-node 2 recipes/wrap_existing.py                   # plain DDP
    torchrun --standalone --nproc-per-node 2 recipes/wrap_existing.py --overlapkit ddp
    torchrun --standalone --nproc-per-node 2 recipes/wrap_existing.py --overlapkit fsdp

Everything marked ``# overlapkit`` is what adopting it changes: the import, one wrapper call
(``ok.ddp`` where the script called ``DistributedDataParallel``, or ``ok.fsdp``), and
``ok.profile`` around the loop with ``prof.step()`` per step, which measures how much of each
step's communication stayed exposed. The model, data, optimizer and loop are untouched.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import overlapkit as ok  # overlapkit
from overlapkit.train.models import GPT, GPTConfig


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--overlapkit",
        choices=["ddp", "fsdp"],
        default=None,
        help="adopt overlapkit with this wrapper (default: plain PyTorch DDP)",
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--logdir", default="runs/wrap_existing", help="profiler traces")
    return parser.parse_args()


def get_batch(step: int, rank: int, batch: int, seq_len: int, vocab: int):
    """Counting sequences (each token is the previous one plus a per-sequence stride)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def train(args: argparse.Namespace, rank: int, local_rank: int, device: torch.device) -> None:
    torch.manual_seed(0)  # the same initial weights on every rank
    config = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)
    model = GPT(config).to(device)
    if args.overlapkit == "ddp":
        model = ok.ddp(model, bucket_mb=1)  # overlapkit
    elif args.overlapkit == "fsdp":
        model = ok.fsdp(model, prefetch=1)  # overlapkit
    else:
        device_ids = [local_rank] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    profiler = (
        ok.profile(args.logdir, wait=1, warmup=1, active=3)  # overlapkit
        if args.overlapkit
        else contextlib.nullcontext()
    )
    with profiler as prof:
        for step in range(args.steps):
            x, y = (t.to(device) for t in get_batch(step, rank, args.batch, 32, config.vocab_size))
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if prof is not None:
                prof.step()  # overlapkit
            if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)

    if prof is not None and rank == 0:  # overlapkit
        for m in prof.summary():
            print(
                f"profiled step {m.step}: compute {m.compute_ms:.1f} ms, comm {m.comm_ms:.1f} "
                f"ms, exposed comm {m.exposed_comm_ms:.1f} ms"
            )
        print(f"traces and TensorBoard scalars: tensorboard --logdir {args.logdir}")


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    # NCCL needs a GPU per rank; with fewer GPUs than local ranks, train on the CPU over gloo.
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ["LOCAL_WORLD_SIZE"]
    )
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.set_num_threads(1)
    train(args, dist.get_rank(), local_rank, device)
    # DistributedDataParallel sits in a reference cycle; free it while the process group still
    # exists. Freed later, its reducer destroys the gloo group while holding the GIL and can
    # deadlock with a gloo thread finishing its last work item (seen with torch 2.13).
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
