"""A clear error for the one ``ok.ddp`` setting that ``torch.compile`` cannot split graphs for.

Under ``torch.compile``, dynamo's DDPOptimizer splits the compiled graph at bucket boundaries so
that each bucket's all-reduce can start while the rest of backward runs. It reads the DDP
module's ``bucket_bytes_cap`` but always assumes DDP's default 1 MiB first bucket
(``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), and asserts that the first bucket is not
larger than the others (``torch/_dynamo/backends/distributed.py``, ``DDPOptimizer.__init__``).
So any DDP built with ``bucket_cap_mb`` < 1 MiB, by ``ok.ddp`` or by hand, fails its first
compiled forward with ``AssertionError: First bucket should be smaller/equal to other
buckets``, a message that names neither the option nor the fix.

``ok.ddp`` cannot know at wrap time whether the model will be compiled. For such small buckets
it adds a forward pre-hook: while dynamo traces the forward, the hook calls a function that
dynamo must run eagerly (``torch.compiler.disable``), and that function raises a ValueError that
names ``bucket_mb`` and the fixes. Eager forwards and buckets of 1 MiB or more are unaffected
(no hook is added for the latter).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

MiB = 1024 * 1024


def _ddp_optimizer_on() -> bool:
    """Whether dynamo splits DDP graphs at buckets (``torch._dynamo.config.optimize_ddp``)."""
    import torch._dynamo  # already imported while compiling; never on an eager path

    mode = torch._dynamo.config.optimize_ddp
    return mode is True or mode == "ddp_optimizer"


def refuse_small_first_bucket_under_compile(model: DistributedDataParallel, *, caller: str) -> None:
    """Make the first compiled forward of ``model`` raise ValueError if DDPOptimizer would assert.

    Args:
        model (DistributedDataParallel): the wrapped model.
        caller (str): the overlapkit API named in the error (``"ok.ddp"``).
    """
    first_bucket_bytes = dist._DEFAULT_FIRST_BUCKET_BYTES
    bucket_bytes = model.bucket_bytes_cap
    if bucket_bytes >= first_bucket_bytes:
        return

    @torch.compiler.disable
    def check() -> None:
        if not _ddp_optimizer_on():
            return
        raise ValueError(
            f"{caller}: torch.compile's DDPOptimizer needs buckets of at least "
            f"{first_bucket_bytes / MiB:g} MiB (it assumes DDP's default "
            f"{first_bucket_bytes / MiB:g} MiB first bucket), but this model has "
            f"bucket_mb={bucket_bytes / MiB:g}. Use bucket_mb >= {first_bucket_bytes / MiB:g}, "
            "or set torch._dynamo.config.optimize_ddp = False to compile without graph "
            "splits at bucket boundaries (then no all-reduce starts before the compiled "
            "backward has produced every gradient)"
        )

    def pre_forward(_module: torch.nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():
            check()

    model.register_forward_pre_hook(pre_forward)
