"""One rank of a loop that ends right after ``bucketer.step()`` (``tests/test_clean_exit.py``).

    python -m tests.exit_after_step MODE OUT_DIR     # RANK, WORLD_SIZE, MASTER_PORT in the env

MODE ``destroy`` calls ``dist.destroy_process_group()`` after the last ``step()``, ``return``
just ends the script. Both first train the same model in the synchronous form, then in the
overlap form, ending with its ``step()``, whose all-reduces are still in flight. At exit (an
``atexit`` handler registered before overlapkit is imported, so it runs after overlapkit's
own) both models' parameters are saved as they are, read directly (not through
``state_dict()``, which would synchronize): the overlap form's last step must be applied.
"""

from __future__ import annotations

import atexit
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

MODE, OUT_DIR = sys.argv[1], sys.argv[2]
RANK = int(os.environ["RANK"])
models: dict[str, nn.Module] = {}


def _save() -> None:
    params = {
        form: {n: p.detach().clone() for n, p in model.named_parameters()}
        for form, model in models.items()
    }
    torch.save(params, os.path.join(OUT_DIR, f"rank{RANK}.pt"))


atexit.register(_save)

import overlapkit as ok  # noqa: E402 (after the atexit registration, on purpose)
from tests.reference import make_batches, make_mlp, shard  # noqa: E402


def _train(form: str, world_size: int) -> None:
    model = models[form] = make_mlp(hidden=64, layers=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    overlap = form == "overlap"
    bucketer = ok.GradBucketer(model, bucket_mb=0.004, **({"optimizer": opt} if overlap else {}))
    for batch in make_batches(4, world_size):
        x, y = shard(batch, RANK, world_size)
        nn.functional.mse_loss(model(x), y).backward()
        if overlap:
            bucketer.step(clip_grad_norm=1.0)
        else:
            bucketer.wait()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()


def main() -> None:
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world_size, False)
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=world_size)
    _train("sync", world_size)
    _train("overlap", world_size)  # ends right after step()
    if MODE == "destroy":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
