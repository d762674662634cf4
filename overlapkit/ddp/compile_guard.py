"""A clear error for the one ``ok.ddp`` setting that ``torch.compile`` cannot split graphs for.

Under ``torch.compile``, dynamo's DDPOptimizer splits the compiled graph at bucket boundaries so
that each bucket's all-reduce can start while the rest of backward runs. It reads the DDP
module's ``bucket_bytes_cap`` but always assumes DDP's default 1 MiB first bucket
(``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), and asserts that the first bucket is not
larger than the others (``torch/_dynamo/backends/distributed.py``, ``DDPOptimizer.__init__``).
So any DDP built with ``bucket_cap_mb`` < 1 MiB, by ``ok.ddp`` or by hand, fails its first
compiled forward with ``AssertionError: First bucket should be smaller/equal to other
buckets``, a message that names neither the option nor the fix.

For such small buckets ``ok.ddp`` raises a ValueError that names ``bucket_mb`` and the fixes:
at once when the model it wraps holds a compiled module (``ok.ddp(torch.compile(model))``);
otherwise from a forward pre-hook, on the first forward that dynamo traces
(``torch.compile(ok.ddp(model))``): the hook calls a function that dynamo must run eagerly
(``torch.compiler.disable``), so the error reaches the caller instead of a silent eager
fallback. Eager forwards and buckets of 1 MiB or more are unaffected (no hook is added for the
latter). A ``torch.compile``-d function called inside ``forward`` is not detected.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

MiB = 1024 * 1024


def _ddp_optimizer_on() -> bool:
    """Whether dynamo splits DDP graphs at buckets (``torch._dynamo.config.optimize_ddp``)."""
    import torch._dynamo  # imported already: called only once something is compiled

    mode = torch._dynamo.config.optimize_ddp
    return mode is True or mode == "ddp_optimizer"


def _compiled_submodule(model: torch.nn.Module) -> str | None:
    """The name of a ``torch.compile``-d module inside ``model``, or None."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # dynamo never imported: nothing was compiled
        return None
    for name, module in model.named_modules():
        if isinstance(module, eval_frame.OptimizedModule):
            return repr(name) if name else "the model itself"
    return None


def refuse_small_first_bucket_under_compile(model: DistributedDataParallel, *, caller: str) -> None:
    """Raise ValueError now, or on the first compiled forward, where DDPOptimizer would assert.

    Args:
        model (DistributedDataParallel): the wrapped model.
        caller (str): the overlapkit API named in the error (``"ok.ddp"``).

    Raises:
        ValueError: ``model`` has buckets under 1 MiB and holds a compiled module.
    """
    first_bucket_bytes = dist._DEFAULT_FIRST_BUCKET_BYTES
    bucket_bytes = model.bucket_bytes_cap
    if bucket_bytes >= first_bucket_bytes:
        return

    def error(where: str) -> ValueError:
        return ValueError(
            f"{caller}: torch.compile's DDPOptimizer needs buckets of at least "
            f"{first_bucket_bytes / MiB:g} MiB (it assumes DDP's default "
            f"{first_bucket_bytes / MiB:g} MiB first bucket), but {where} has "
            f"bucket_mb={bucket_bytes / MiB:g}. Use bucket_mb >= {first_bucket_bytes / MiB:g}, "
            "or set torch._dynamo.config.optimize_ddp = False to compile without graph "
            "splits at bucket boundaries (then no all-reduce starts before the compiled "
            "backward has produced every gradient)"
        )

    compiled = _compiled_submodule(model.module)
    if compiled is not None and _ddp_optimizer_on():
        raise error(f"a compiled module ({compiled}) is wrapped and the model")

    @torch.compiler.disable
    def check() -> None:
        if _ddp_optimizer_on():
            raise error("this model")

    def pre_forward(_module: torch.nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():
            check()

    model.register_forward_pre_hook(pre_forward)
