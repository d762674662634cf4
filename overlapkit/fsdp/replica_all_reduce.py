"""HSDP's all-reduce across replicas, explained when a dead or stuck rank makes it fail.

On a 2-D mesh FSDP2 reduce-scatters a block's gradients over the shard axis and then
all-reduces the result over the replicate axis, inside its post-backward (``foreach_reduce``
calls ``dist.all_reduce`` itself; FSDP2 has a custom-comm hook for the reduce-scatter and the
all-gather, none for this all-reduce). So the post-backward of each of the block's FSDP2
parameter groups is wrapped: a plain backend error raised after the block's reduce-scatter has
been issued comes from that all-reduce, and is raised as ``CollectiveFailure`` naming the block
and the step. An error before the reduce-scatter, or one already explained, passes unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from overlapkit.group.failures import CollectiveFailure, FailureScope


class _CountsCalls(Protocol):
    calls: int


def explain_replica_all_reduce(
    module: FSDPModule,
    reduce_scatter: _CountsCalls,
    replicate_group: dist.ProcessGroup,
    *,
    failures: FailureScope,
    where: str,
) -> None:
    """Wrap ``module``'s FSDP2 post-backward so a failed HSDP all-reduce is explained.

    Args:
        module (FSDPModule): a block (or the root) sharded by ``fully_shard`` on a 2-D mesh.
        reduce_scatter: the module's custom reduce-scatter; its ``calls`` count tells whether
            the reduce-scatter has been issued in this post-backward.
        replicate_group (ProcessGroup): the mesh's replicate-axis group of this rank.
        failures (FailureScope): explains the failure (check-in, missing ranks).
        where (str): the block as the error names it, e.g. ``"block 0 ('layers.0')"``.
    """
    # Private in torch 2.13: FSDP2 exposes no hook around its post-backward.
    state = module._get_fsdp_state()
    # A list in torch 2.13; torch 2.9 holds at most one group, in ``_fsdp_param_group``.
    param_groups = getattr(state, "_fsdp_param_groups", None)
    if param_groups is None:
        param_groups = [g for g in (state._fsdp_param_group,) if g is not None]
    for param_group in param_groups:
        param_group.post_backward = _explained(
            param_group.post_backward, reduce_scatter, replicate_group, failures, where
        )


def _explained(
    post_backward: Callable[..., Any],
    reduce_scatter: _CountsCalls,
    replicate_group: dist.ProcessGroup,
    failures: FailureScope,
    where: str,
) -> Callable[..., Any]:
    @functools.wraps(post_backward)
    def post_backward_explained(*args: Any) -> Any:
        site = failures.site(replicate_group, "all_reduce", where)
        issued = reduce_scatter.calls
        try:
            return post_backward(*args)
        except RuntimeError as error:
            if isinstance(error, CollectiveFailure) or reduce_scatter.calls == issued:
                raise
            raise site.explain(error) from error

    return post_backward_explained
