"""Tensor parallel's collectives along the sequence, issued asynchronously on any backend.

Activations are ``(B, T, ...)`` with the sequence on dim 1 (``SEQ_DIM``); under sequence
parallelism tp rank ``r`` holds tokens ``r·T/tp .. (r+1)·T/tp`` of every sequence. Three
exchanges over the ``tp`` group, each returning a ``Pending`` whose ``wait()`` gives the result:

- ``all_gather``: ``(B, T/tp, ...)`` shards -> ``(B, T, ...)`` in rank order;
- ``reduce_scatter``: ``(B, T, ...)`` partial sums -> this rank's ``(B, T/tp, ...)`` of their sum;
- ``shift``: a tensor to the next rank of the ring (``r+1``), the previous rank's (``r-1``) back.

They are torch's functional collectives (``torch.ops._c10d_functional``): the op issues the
collective and ``wait_tensor`` waits for it. Functional ops are what selective recomputation can
save and replay (a ``Work`` handle cannot be), and they are asynchronous everywhere: on gloo the
group's worker thread runs the transfer, on NCCL the process group's own stream does, ordered
after the compute stream by a CUDA event at issue, and ``wait_tensor`` makes the compute stream
wait on the work's end event (no host sync). ``shift`` is an ``all_to_all_single`` whose only
non-empty split is the neighbour's (the functional ops have no send/recv): one point-to-point
transfer each way. Every exchange is issued inside ``comm_dim("tp")`` so ``overlapkit report``
attributes it to ``tp``, and waited for inside ``comm_wait(kind)`` so the live monitor counts
the wait (``wait_tensor`` is a C++ op no Python wrap sees).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from overlapkit.group.dim_labels import comm_dim, comm_wait

SEQ_DIM = 1
"""The sequence dimension of the activations the tp collectives move."""

_functional = torch.ops._c10d_functional


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True, slots=True)
class Pending:
    """A collective in flight: ``wait()`` blocks (the compute stream, on CUDA) until it is done
    and returns its result in the caller's layout."""

    raw: torch.Tensor
    kind: str
    """The collective's kind (``wait_hooks.KINDS``), what the live monitor counts the wait as."""
    finish: Callable[[torch.Tensor], torch.Tensor] = _identity

    def wait(self) -> torch.Tensor:
        with comm_wait(self.kind):
            done = _functional.wait_tensor(self.raw)
        return self.finish(done)


@dataclass(frozen=True, slots=True)
class TpGroup:
    """The ``tp`` process group as the in-layer ops use it.

    Attributes:
        name: the group's name (what the functional collectives take).
        size: its ranks.
        rank: this rank's index in it.
    """

    name: str
    size: int
    rank: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> TpGroup:
        return cls(group.group_name, group.size(), group.rank())

    def all_gather(self, shard: torch.Tensor) -> Pending:
        """Start gathering ``(B, T/tp, ...)`` shards into ``(B, T, ...)``, rank ``r``'s at
        ``r·T/tp``."""
        with comm_dim("tp"):
            raw = _functional.all_gather_into_tensor(shard.contiguous(), self.size, self.name)
        batch = shard.shape[0]
        # Gathered along dim 0 as (tp·B, T/tp, ...): put each rank's tokens back in sequence.
        return Pending(
            raw,
            "all_gather",
            lambda t: t.unflatten(0, (self.size, batch)).movedim(0, 1).flatten(1, 2),
        )

    def reduce_scatter(self, partial: torch.Tensor) -> Pending:
        """Start summing ``(B, T, ...)`` partial sums over the group; this rank gets its
        ``(B, T/tp, ...)`` tokens of the sum."""
        by_rank = partial.unflatten(SEQ_DIM, (self.size, -1)).movedim(SEQ_DIM, 0)
        with comm_dim("tp"):
            raw = _functional.reduce_scatter_tensor(
                by_rank.contiguous().flatten(0, 1), "sum", self.size, self.name
            )
        return Pending(raw, "reduce_scatter")

    def shift(self, tensor: torch.Tensor) -> Pending:
        """Start sending ``tensor`` to rank ``r+1`` and receiving one of its shape from ``r-1``
        (both modulo the group size)."""
        numel = tensor.numel()
        send = [numel if peer == (self.rank + 1) % self.size else 0 for peer in range(self.size)]
        recv = [numel if peer == (self.rank - 1) % self.size else 0 for peer in range(self.size)]
        with comm_dim("tp"):
            raw = _functional.all_to_all_single(tensor.reshape(-1), recv, send, self.name)
        shape = tensor.shape
        # An all-to-all to torch and to the trace report, whatever its splits.
        return Pending(raw, "all_to_all", lambda t: t.view(shape))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the group (waited for)."""
        with comm_dim("tp"):
            raw = _functional.all_reduce(tensor, "sum", self.name)
        return Pending(raw, "all_reduce").wait()
