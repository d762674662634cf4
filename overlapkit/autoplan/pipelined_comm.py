"""A layer's exchanges cut into chunks and pipelined with the chunks' compute: what stays exposed.

Three pipelines, each exchange hiding under compute of another chunk, never more than it lasts:

- ``pipelined_exposed``: chunked expert parallelism's dispatch and combine around each chunk;
- ``one_sided_exposed``: tp's ``split`` mode, one collective per chunk on one side of its matmul
  (``overlapkit.inlayer``: every chunk's all-gather in flight while earlier chunks multiply, or
  each chunk's reduce-scatter while later chunks multiply): the first (last) chunk's collective
  has nothing to hide behind, each other one hides under one chunk's matmul;
- ``ring_exposed``: tp's ``ring`` mode, ``tp - 1`` neighbour transfers each under the partial
  matmul of the chunk already in hand.

**Expert parallelism.** Chunked expert parallelism (``overlapkit.inlayer.chunked_ep``) runs
one pass through an MoE layer as ``chunks`` expert computations, each needing its rows
dispatched before it and combined after it. While chunk ``k`` computes, chunk ``k+1``'s dispatch
and chunk ``k-1``'s combine are in flight; the first dispatch and the last combine have nothing
to hide behind. With every exchange lasting ``comm_s`` and every chunk's compute ``compute_s``:

    exposed = 2 comm_s + sum over k of max(0, in_flight(k) x comm_s - compute_s)

``in_flight(k)`` being 2 for a middle chunk and 1 for the first and last (0 for a single
chunk): the exchanges in flight during a chunk share its compute as a window and never hide
more than it lasts. One chunk (the synchronous exchange) exposes all of its ``2 comm_s``.
Backward runs the same pipeline in reverse (``dispatch_combine``'s backward), with the
backward compute as the windows.
"""

from __future__ import annotations


def pipelined_exposed(comm_s: float, compute_s: float, chunks: int) -> float:
    """Exposed seconds of one pass: ``2 x chunks`` exchanges of ``comm_s`` pipelined with
    ``chunks`` computes of ``compute_s`` (see the module docstring); ``comm_s`` to
    ``2 x chunks x comm_s``.

    Raises:
        ValueError: ``chunks`` below 1.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    exposed = 2.0 * comm_s
    for k in range(chunks):
        in_flight = (k + 1 < chunks) + (k > 0)
        exposed += max(0.0, in_flight * comm_s - compute_s)
    return exposed


def one_sided_exposed(comm_s: float, compute_s: float, chunks: int) -> float:
    """Exposed seconds of ``chunks`` collectives of ``comm_s`` on one side of ``chunks``
    matmuls of ``compute_s``: ``comm_s + (chunks - 1) x max(0, comm_s - compute_s)``."""
    return comm_s + (chunks - 1) * max(0.0, comm_s - compute_s)


def ring_exposed(comm_s: float, compute_s: float, steps: int) -> float:
    """Exposed seconds of a ring of ``steps`` partial matmuls of ``compute_s``, each of the
    ``steps - 1`` transfers of ``comm_s`` in flight under one: ``(steps - 1) x max(0, comm_s -
    compute_s)``."""
    return (steps - 1) * max(0.0, comm_s - compute_s)
