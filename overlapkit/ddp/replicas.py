"""What DDP does for the replicas besides reducing gradients: an equal start, equal buffers.

DDP broadcasts every parameter and buffer from rank 0 when it is built (``_sync_module_states``),
so replicas start equal even when the ranks initialised differently, and with
``broadcast_buffers=True`` (its default) it broadcasts the buffers again before forwards, so a
buffer a forward changes (BatchNorm's running statistics) follows rank 0's. A model trained with
``GradBucketer`` instead, by a framework adapter that promises DDP's results
(``overlapkit.integrations``), gets the first from ``broadcast_module_state`` and, in place of
the second, ``BufferCheck``: a buffer that changes during training is refused, with the fix,
rather than left to drift apart across ranks. The check reads each buffer's identity and version
counter (bumped by every in-place write), so it costs no collective and no device sync.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlapkit.group.process_group import resolve_process_group


def broadcast_module_state(
    module: torch.nn.Module, *, process_group: dist.ProcessGroup | None = None
) -> None:
    """Overwrite every parameter and buffer with the group's first rank's, as DDP does when built.

    A collective: every rank of the group calls it, with the same model.

    Args:
        module (nn.Module): the local replica.
        process_group (ProcessGroup | None): the data-parallel group; None means the world.

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    group = resolve_process_group(process_group, caller="broadcast_module_state")
    src = dist.get_global_rank(group, 0)
    tensors = [*module.parameters(), *module.buffers()]
    with torch.no_grad():
        works = [dist.broadcast(t.data, src, group=group, async_op=True) for t in tensors]
        for work in works:
            work.wait()


class BufferCheck:
    """Refuse a model whose buffers change after ``BufferCheck(module)``: ``check()`` raises.

    Args:
        module (nn.Module): the model (after ``broadcast_module_state``, which writes them).
        caller (str): the API named in the error.
        fix (str): what the user can do instead, appended to the error.
    """

    def __init__(self, module: torch.nn.Module, *, caller: str, fix: str):
        self._module = module
        self._caller = caller
        self._fix = fix
        self._seen = self._state()

    def _state(self) -> dict[str, tuple[int, int]]:
        return {name: (id(b), b._version) for name, b in self._module.named_buffers()}

    def check(self) -> None:
        """Raise if a buffer was written, replaced, added or removed since construction.

        Raises:
            ValueError: naming the buffer.
        """
        now = self._state()
        if now == self._seen:
            return
        changed = sorted(
            set(now) ^ set(self._seen) | {n for n in now if self._seen.get(n) != now[n]}
        )
        raise ValueError(
            f"{self._caller}: the model's buffer {changed[0]!r} changed during training "
            f"({len(changed)} changed: {changed[:3]}). DistributedDataParallel would broadcast "
            "rank 0's buffers before each forward; per-bucket updates do not, so each rank would "
            f"keep its own. {self._fix}"
        )
