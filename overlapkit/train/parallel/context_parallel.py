"""Context parallelism (``parallel.plan.cp``): every sequence split over the ``cp`` ranks.

**Split.** The ``cp`` ranks of one group read the same batch (``mesh.data_shard`` skips the
axis). Each sequence of ``T`` tokens is cut into ``2 x cp`` chunks and cp rank ``i`` keeps chunks
``i`` and ``2cp - 1 - i``: under a causal mask the early chunks attend to few keys and the late
ones to many, so every rank gets the same work (torch's ``_HeadTailLoadBalancer`` layout).
Inputs, targets and positions are split alike; the model embeds the shard's true positions
(``GPT.forward(idx, pos)``).

**Attention.** Each block's queries stay local; keys and values are all-gathered over ``cp``:

- on host devices (gloo), ``GatheredKVAttention``: torch's ``cplib::flex_cp_allgather`` (an
  all-gather in forward whose backward reduce-scatters, sums, the K/V gradients back to the
  ranks that own them), then SDPA with the causal mask written in positions (a query at position
  ``p`` sees the keys at positions ``<= p``, wherever the gathered chunks sit);
- on CUDA, torch's ``context_parallel`` (``torch.distributed.tensor.experimental``), which
  shards the batch the same way and replaces SDPA with its ring attention, rotating K/V by
  all-gather (``set_rotate_method("allgather")``). On CPU torch refuses it (no sharding strategy
  for ``_scaled_dot_product_flash_attention_for_cpu``).

**Gradients and loss.** Each rank's loss is the mean over its ``T / cp`` tokens of each sequence;
the ``cp`` ranks of a group hold equally many, so averaging the gradients over ``dp x cp`` (the
wrappers get the flattened group, ``Layout.dp_group``) gives the gradient of the mean over every
token, as without cp. The loss the loop reports is averaged over ``cp`` (one scalar all-reduce
per step) for the same reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._context_parallel import (
    flex_cp_allgather,
    set_rotate_method,
)
from torch.nn import functional as F

from overlapkit.group.dim_labels import comm_dim
from overlapkit.train.models.gpt import CausalSelfAttention

ModelInputs = tuple[torch.Tensor, ...]


def chunk_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions of the tokens cp rank ``rank`` holds: chunks ``rank`` and ``2cp-1-rank``.

    Args:
        seq_len (int): tokens per (whole) sequence; ``2 x cp`` must divide it.
        cp (int): context-parallel size.
        rank (int): this rank's index in its cp group.

    Returns:
        Tensor: LongTensor of shape ``(seq_len // cp,)``, increasing.
    """
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([head, tail])


def check_sequence_split(cp: int, seq_len: int | None) -> None:
    """Refuse a sequence that ``cp`` ranks cannot split into equal load-balanced chunks.

    Raises:
        ValueError: ``2 x cp`` does not divide ``seq_len``, or the data has no sequences.
    """
    if cp == 1:
        return
    if seq_len is None:
        raise ValueError(
            f"parallel.plan.cp={cp} splits token sequences; the data has none (use "
            "data=synthetic or data=text)"
        )
    if seq_len % (2 * cp):
        raise ValueError(
            f"parallel.plan.cp={cp}: the load-balanced split cuts each sequence into 2 x cp = "
            f"{2 * cp} chunks, which must divide data.seq_len ({seq_len}); choose a cp with "
            f"2 x cp dividing {seq_len}, or a data.seq_len that 2 x cp divides"
        )


class GatheredKVAttention:
    """Causal attention of this rank's query chunks over the keys and values of every cp rank.

    Args:
        group (ProcessGroup): the ``cp`` group; its ranks hold the chunks in ``chunk_positions``
            order, by group rank.
    """

    __slots__ = ("_group_name", "_masks", "cp", "rank")

    def __init__(self, group: dist.ProcessGroup):
        self._group_name = group.group_name
        self.cp = group.size()
        self.rank = group.rank()
        self._masks: dict[tuple[int, torch.device], torch.Tensor] = {}

    def mask(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Bool ``(local_len, cp x local_len)``: True where the query may see the key.

        Keys are in gathered order (cp rank 0's chunks, then rank 1's, ...).
        """
        key = (local_len, device)
        if key not in self._masks:
            seq_len = local_len * self.cp
            queries = chunk_positions(seq_len, self.cp, self.rank)
            keys = torch.cat([chunk_positions(seq_len, self.cp, r) for r in range(self.cp)])
            self._masks[key] = (keys[None, :] <= queries[:, None]).to(device)
        return self._masks[key]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``(B, nh, T/cp, hs)`` each -> ``(B, nh, T/cp, hs)``."""
        with comm_dim("cp"):  # its backward's reduce-scatters run on the same gloo threads
            k_all, v_all = flex_cp_allgather(k, v, 2, self._group_name)
        mask = self.mask(q.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


class WholeSequences:
    """No context parallelism: the model sees whole sequences."""

    cp = 1
    description = ""

    @contextlib.contextmanager
    def shard(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> Iterator[tuple[ModelInputs, torch.Tensor]]:
        yield (inputs,), targets

    def average_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss


WHOLE_SEQUENCES = WholeSequences()


class SequenceSplit:
    """Per micro-batch: this rank's chunks of the sequences, their positions and targets.

    Args:
        mesh (DeviceMesh): the 1-D ``cp`` mesh.
        attention (GatheredKVAttention | None): the attention modules' core (installed by
            ``split_sequences``); None: torch's ``context_parallel`` (CUDA) instead.
    """

    def __init__(self, mesh: DeviceMesh, *, attention: GatheredKVAttention | None):
        self.mesh = mesh
        self.group = mesh.get_group()
        self.cp = mesh.size()
        self.rank = mesh.get_local_rank()
        self.attention = attention
        self.torch_cp = attention is None

    @property
    def description(self) -> str:
        """What the run's description adds: ``", context parallel cp=2 (...)"``."""
        how = "torch context_parallel, K/V all-gather" if self.torch_cp else "K/V all-gather"
        return f", context parallel cp={self.cp} ({how})"

    @contextlib.contextmanager
    def shard(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> Iterator[tuple[ModelInputs, torch.Tensor]]:
        """Run forward and backward inside: yields ``((inputs, positions), targets)`` shards.

        Args:
            inputs, targets: ``(B, T)`` long, the whole sequences (the same on every cp rank).

        Raises:
            ValueError: ``2 x cp`` does not divide ``T``.
        """
        seq_len = inputs.shape[1]
        check_sequence_split(self.cp, seq_len)
        if self.attention is not None:
            mine = chunk_positions(seq_len, self.cp, self.rank).to(inputs.device)
            # The mask is built here, outside the blocks: selective recomputation replays a
            # block's ops by their order, and a mask built inside the first forward only (then
            # cached) would shift the order of its recomputation against that forward.
            self.attention.mask(len(mine), inputs.device)
            yield (inputs[:, mine], mine), targets[:, mine]
            return
        set_rotate_method("allgather")
        positions = torch.arange(seq_len, device=inputs.device)
        buffers = [inputs, targets, positions]
        # Sharded in place (the same head-tail chunks as chunk_positions); SDPA calls inside
        # are ring attention over the cp mesh.
        with context_parallel(
            self.mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0], no_restore_buffers=set(buffers)
        ):
            yield (inputs, positions), targets

    def average_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean of ``loss`` over the cp group (each rank's covers its own tokens)."""
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.group)  # gloo has no ReduceOp.AVG
        return total / self.cp


def split_sequences(
    model: nn.Module, cp_mesh: DeviceMesh | None, device: torch.device
) -> WholeSequences | SequenceSplit:
    """Set ``model`` up for context parallelism over ``cp_mesh`` (None: no cp), in place.

    On host devices every ``CausalSelfAttention`` of the model attends with a
    ``GatheredKVAttention`` over the cp group; on CUDA torch's ``context_parallel`` replaces SDPA
    per micro-batch instead (``SequenceSplit.shard``).

    Raises:
        ValueError: cp over a model without causal self-attention.
    """
    if cp_mesh is None or cp_mesh.size() == 1:
        return WHOLE_SEQUENCES
    layers = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    if not layers:
        raise ValueError(
            f"parallel.plan.cp={cp_mesh.size()} splits the sequence of a transformer's "
            f"attention; {type(model).__name__} has none (use model=gpt_tiny)"
        )
    if device.type == "cuda":
        return SequenceSplit(cp_mesh, attention=None)
    attend = GatheredKVAttention(cp_mesh.get_group())
    for layer in layers:
        layer.attend = attend
    return SequenceSplit(cp_mesh, attention=attend)
