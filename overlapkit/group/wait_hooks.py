"""Who is told when overlapkit's own code waits on a collective: one observer of ``comm_wait``.

``dim_labels.comm_wait(kind)`` marks each wait overlapkit issues itself (tensor parallel's
``wait_tensor``, chunked expert parallel's ``Work.wait``): for the profiler report it is a trace
range; for a live observer (``overlapkit.live``, a layer above this one) it is ``begin(kind)``
before the wait and ``end(token)`` after, on the waiting thread. This module holds the observer,
so the wait sites need not know who times them.

A leaf beside ``dim_labels``: it imports nothing of overlapkit.
"""

from __future__ import annotations

from typing import Any, Protocol

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "other")
"""The kinds of collective a wait is on; the trace report's ``COLLECTIVE_KINDS`` too."""


class WaitObserver(Protocol):
    """Told of each ``comm_wait`` block on any thread (so it must be cheap and thread-safe)."""

    def begin(self, kind: int) -> Any:
        """A wait on a collective of ``kind`` (a ``KINDS`` index) starts; returns a token."""
        ...

    def end(self, token: Any) -> None:
        """The wait ``begin`` returned ``token`` for has ended (also when it raised)."""
        ...


_observer: WaitObserver | None = None


def set_observer(observer: WaitObserver | None) -> WaitObserver | None:
    """Make ``observer`` the one told of waits (None: nobody); returns the one it replaces."""
    global _observer
    previous, _observer = _observer, observer
    return previous


def observer() -> WaitObserver | None:
    """The observer told of waits now, or None."""
    return _observer


def kind_index(kind: str) -> int:
    """``kind``'s index in ``KINDS``.

    Raises:
        ValueError: ``kind`` is not one of ``KINDS``.
    """
    try:
        return KINDS.index(kind)
    except ValueError:
        allowed = ", ".join(KINDS)
        raise ValueError(f"comm_wait: kind must be one of {allowed}, got {kind!r}") from None
