"""``prefetch="auto"`` for ``ok.fsdp``: try the depths that fit ``max_memory``, keep the fastest.

Candidates are the depths in {0, 1, 2} whose design bound of unsharded block bytes
(``decide.prefetch_memory_bound``: the computing block plus the prefetched ones, the largest
blocks assumed) fits ``max_memory``, so no trial can exceed it. Each trial also reads the
measured peak from ``ok.fsdp_stats``'s accounting; a depth whose measured peak went over the
bound anyway is never chosen. Switching depth only rewrites FSDP2's explicit prefetch lists
between steps (no collective); the comms installed at wrap time are those of the deepest
candidate, which are also right for the shallower ones (an asynchronous all-gather that is
waited for at once is a synchronous one).

Steps are delimited by a forward pre-hook on the root, counting forwards with autograd on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from overlapkit.fsdp.prefetch import set_explicit_prefetch
from overlapkit.fsdp.state import OverlapState
from overlapkit.tuning.report import register_tuner
from overlapkit.tuning.search import Tuner

FSDP_DISCARD_STEPS = 1
MEASURE_STEPS = 3


def set_fsdp_prefetch(state: OverlapState, depth: int) -> None:
    """Switch an ``ok.fsdp`` model to prefetch ``depth``; call between steps.

    Empty explicit lists are FSDP2's "no explicit prefetch" (backward then prefetches one block
    implicitly), which is what ``prefetch=0`` means at wrap time.
    """
    set_explicit_prefetch(state.root, state.blocks, depth)
    state.prefetch = depth


def attach_prefetch_tuner(
    model: nn.Module, state: OverlapState, candidates: Sequence[int], max_memory: int | None
) -> Tuner:
    """Tune ``model``'s prefetch depth over ``candidates`` during its first steps."""
    step_tags = {"seen": 0}

    def extras(tags: list[int]) -> tuple[None, int]:
        steps, _ = state.recorder.snapshot()
        wanted = set(tags)
        return None, max((s.peak_bytes for s in steps if s.step in wanted), default=0)

    handle = None

    def detach() -> None:
        handle.remove()

    tuner = Tuner(
        knob="prefetch",
        candidates=list(candidates),
        apply=lambda depth: set_fsdp_prefetch(state, int(depth)),
        detach=detach,
        group=dist.group.WORLD,
        device=torch.device(state.device_type),  # the mesh's: a meta model has none yet
        extras=extras,
        max_bytes=max_memory,
        discard_steps=FSDP_DISCARD_STEPS,
        measure_steps=MEASURE_STEPS,
        caller="ok.fsdp",
    )

    def pre_forward(_module: nn.Module, _args: object) -> None:
        if not torch.is_grad_enabled():
            return
        # The recorder numbers steps from 0 in the order they close; the one that just ended
        # is the previous forward's.
        tuner.step_ended(step_tags["seen"] - 1)
        step_tags["seen"] += 1

    # Eager under torch.compile, like ok.fsdp's other hooks (overlapkit.fsdp.wrap).
    handle = model.register_forward_pre_hook(torch.compiler.disable(pre_forward), prepend=True)
    register_tuner(model, tuner)
    return tuner
