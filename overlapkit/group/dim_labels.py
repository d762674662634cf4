"""Which parallel dimension a collective serves, written into the profiler trace by its issuer.

A trace's collective kinds cannot tell the dimensions apart: on gloo a reduce-scatter runs as an
all-reduce, tensor parallel's and data parallel's all-reduces look alike, and a ring
decomposition's point-to-point steps look like a pipeline's. NCCL kernels carry their process
group (``Process Group Name``, whose ``pg_desc`` a ``DeviceMesh`` writes as ``mesh_<dim>``);
gloo's worker-thread ranges carry nothing. So the code that issues a collective wraps the call
that issues it (synchronous or async) in ``comm_dim(dim)``: a ``torch.profiler`` range named
``overlapkit.dim:<dim>`` on the issuing thread, which encloses the collective's ``c10d::*``
enqueue op. ``overlapkit report`` reads the ranges back (``dim_of_label``) and attributes each
collective to a dimension (the report's per-step ``dims``).

A thread that blocks on a collective's ``wait()`` inside an operator's range (an autograd
node's backward that waits for its exchange) would look busy to the report; ``comm_wait(kind)``
marks the wait (``overlapkit.wait``), and the report does not count it as compute. The same
block tells the live monitor (``wait_hooks``' observer) how long the thread, or on CUDA the
stream, waited: every wait overlapkit issues itself is marked so.

Outside a profiled region a range costs one ``record_function`` enter and exit (about a
microsecond on the host), so it is left on in every run.

A leaf beside ``process_group``: the wrappers (``ddp``, ``fsdp``), the in-layer overlap, the
training loop's models and the profiler's report all import it, and it imports only torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.profiler import record_function

from overlapkit.group import wait_hooks

COMM_DIMS = ("tp", "cp", "ep", "pp", "dp", "other")
"""The keys of the report's ``dims``: a layout's dimensions, and ``other`` for the rest."""
LABEL_PREFIX = "overlapkit.dim:"
"""How a dimension's range is named in the trace: ``overlapkit.dim:tp``."""
WAIT_LABEL = "overlapkit.wait"
"""How ``comm_wait``'s range is named in the trace."""
_MESH_DESC = "mesh_"
# DeviceMesh axis names that are data parallel under another name (HSDP's two axes, the
# flattened dp x cp group the gradient reducers get under context parallelism).
_DP_AXES = ("dp", "dp_shard", "dp_replicate", "dp_cp", "dp_shard_cp", "dense")


def _checked(dim: str) -> str:
    if dim not in COMM_DIMS:
        raise ValueError(f"comm_dim: dim must be one of {', '.join(COMM_DIMS)}, got {dim!r}")
    return dim


@contextlib.contextmanager
def comm_dim(dim: str) -> Iterator[None]:
    """Label the collectives issued inside as serving parallel dimension ``dim``.

    Wrap the call that *issues* each collective (``dist.all_reduce(..., async_op=True)`` too:
    the range need not last until the work ends). Nested ranges: the innermost wins.

    Raises:
        ValueError: ``dim`` is not one of ``COMM_DIMS``.
    """
    with record_function(LABEL_PREFIX + _checked(dim)):
        yield


@contextlib.contextmanager
def comm_wait(kind: str) -> Iterator[None]:
    """Mark a thread's wait for a collective of ``kind`` (``work.wait()`` or ``wait_tensor``
    inside), which is not compute; the observer of ``wait_hooks`` times it.

    Raises:
        ValueError: ``kind`` is not one of ``wait_hooks.KINDS``.
    """
    index = wait_hooks.kind_index(kind)
    observer = wait_hooks.observer()
    token = observer.begin(index) if observer is not None else None
    try:
        with record_function(WAIT_LABEL):
            yield
    finally:
        if observer is not None:
            observer.end(token)


def dim_of_label(name: str) -> str | None:
    """The dimension a trace range named ``name`` labels, or None when it is no label."""
    if not name.startswith(LABEL_PREFIX):
        return None
    dim = name[len(LABEL_PREFIX) :]
    return dim if dim in COMM_DIMS else None


def dim_of_group_desc(desc: str | None) -> str | None:
    """The dimension a process group's description (``pg_desc``) names, or None.

    ``DeviceMesh`` describes the group of its axis ``name`` as ``mesh_<name>``; a data-parallel
    axis under another name (``dp_shard``, ``dp_replicate``, ``dp_cp``) counts as ``dp``.
    """
    if not desc or not desc.startswith(_MESH_DESC):
        return None
    axis = desc[len(_MESH_DESC) :]
    if axis in _DP_AXES:
        return "dp"
    return axis if axis in COMM_DIMS else None
