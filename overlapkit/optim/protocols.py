"""What the update schedulers of ``overlapkit.optim`` need from the wrappers below them.

The schedulers apply the user's optimizer to part of the model at a time, as soon as that part
is ready: ``per_bucket`` a DDP gradient bucket once its all-reduce is done, ``per_block`` an FSDP
block in forward order. They see the wrappers only through these Protocols, so ``optim`` imports
neither ``ddp`` nor ``fsdp``; ``overlapkit.fsdp.prefetch`` offers a ``BlockSet``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class BlockSet(Protocol):
    """Parameters updated set by set, in the order the next forward needs them (FSDP blocks)."""

    def parameter_sets(self) -> Sequence[Sequence[torch.nn.Parameter]]:
        """The sets in update order; each parameter the optimizer holds is in exactly one."""
        ...

    def updated(self, index: int) -> None:
        """Set ``index`` is updated: start what waits for it (its next all-gather)."""
        ...

    def all_updated(self) -> None:
        """Every set is updated: release what waits for the whole step."""
        ...
