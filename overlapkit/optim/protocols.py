"""What the update schedulers of ``overlapkit.optim`` need from the wrappers below them.

The schedulers apply the user's optimizer to part of the model at a time, as soon as that part
is ready: ``per_bucket`` a DDP gradient bucket once its all-reduce is done, ``per_block`` an FSDP
block in forward order. They see the wrappers only through these Protocols, so ``optim`` imports
neither ``ddp`` nor ``fsdp``; ``overlapkit.ddp.reducer.BucketReducer`` offers ``BucketReduction``
and ``overlapkit.fsdp.prefetch`` a ``BlockSet``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch.utils.hooks import RemovableHandle

MissingGradients = Mapping[int, torch.Tensor | None]
"""Parameters (by index) that got no gradient on this rank in a step: each maps to a copy of the
``.grad`` it had before (None if it had none), which is put back if no rank used it either."""


class BucketReduction(Protocol):
    """Gradients reduced in buckets launched during backward (``ok.GradBucketer``'s reducer).

    Parameters are numbered by their index in ``params``; buckets by their index in the layout,
    and they are launched in ``launch_order``. A step, as the per-bucket scheduler drives it::

        (backward: grad-ready hooks run, each gradient is copied into its bucket, full buckets
         are launched)
        missing, step = reduction.end_backward()      # launches the rest
        for b in reduction.launch_order:               # or as each one completes
            reduction.finish_bucket(b, missing)        # the .grad of its parameters hold the mean
        reduction.end_step(step)
    """

    @property
    def params(self) -> Sequence[torch.nn.Parameter]:
        """The reduced parameters, indexed as everywhere in this Protocol."""
        ...

    @property
    def names(self) -> Sequence[str]:
        """Their names (``model.named_parameters()``), for error messages."""
        ...

    @property
    def launch_order(self) -> Sequence[int]:
        """The buckets in the order their all-reduces are launched (the same on every rank)."""
        ...

    @property
    def in_step(self) -> bool:
        """Whether a backward has handed over gradients since the last ``end_backward()``."""
        ...

    @property
    def rebuild_pending(self) -> bool:
        """Whether ``end_step`` will rebuild the layout (the first step adopts rank 0's order)."""
        ...

    def bucket_of(self, index: int) -> int:
        """The bucket holding parameter ``index`` in the current layout."""
        ...

    def bucket_indices(self, bucket: int) -> Sequence[int]:
        """The parameters in ``bucket``."""
        ...

    def grad_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s slice of its bucket's flat buffer (its local shard's shape)."""
        ...

    def register_grad_ready_hook(
        self, hook: Callable[[int, torch.Tensor], None]
    ) -> RemovableHandle:
        """Call ``hook(index, param)`` when a gradient is ready, before it enters its bucket."""
        ...

    def end_backward(self) -> tuple[MissingGradients, int]:
        """Close backward: zeros for the parameters without a gradient, every bucket launched.

        Returns:
            tuple: the missing gradients (pass them to ``finish_bucket``) and the step index.
        """
        ...

    def reduction_complete(self, bucket: int) -> bool:
        """Whether ``bucket``'s all-reduce has completed (``finish_bucket`` will not block)."""
        ...

    def finish_bucket(self, bucket: int, missing: MissingGradients) -> None:
        """Wait for ``bucket``'s all-reduce and make it its parameters' ``.grad``.

        Afterwards each used parameter's ``.grad`` is its ``grad_view`` (the group mean); one
        that no rank used keeps the gradient it had. NaN/Inf found in the bucket is noted for
        ``settle_nonfinite``.
        """
        ...

    def reset_bucket(self, bucket: int) -> None:
        """Forget ``bucket``'s all-reduce without waiting; ready it for the next backward."""
        ...

    @property
    def checks_finite(self) -> bool:
        """Whether finished buckets are checked for NaN/Inf (``settle_nonfinite`` acts)."""
        ...

    def settle_nonfinite(self, step: int) -> bool:
        """Act now on the NaN/Inf the finished buckets of ``step`` held (``check_finite``).

        Returns:
            bool: whether the step is skipped (every gradient dropped).

        Raises:
            NonFiniteGradients: with ``on_nonfinite="raise"``; no-op without ``check_finite``.
        """
        ...

    def end_step(self, step: int) -> None:
        """Close ``step`` once every bucket is finished: rebuild if pending, settle NaN/Inf."""
        ...


class BlockSet(Protocol):
    """Parameters updated set by set, in the order the next forward needs them (FSDP blocks)."""

    def parameter_sets(self) -> Sequence[Sequence[torch.nn.Parameter]]:
        """The sets in update order; each parameter the optimizer holds is in exactly one."""
        ...

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter of the sets in the model's own order (``model.parameters()``): the
        order ``clip_grad_norm_(model.parameters())`` stacks the gradients' norms in."""
        ...

    def updated(self, index: int) -> None:
        """Set ``index`` is updated: start what waits for it (its next all-gather)."""
        ...

    def all_updated(self) -> None:
        """Every set is updated: release what waits for the whole step."""
        ...
