"""A failed DDP bucket's ``CollectiveFailure``, raised from ``loss.backward()`` as itself.

DDP waits for its comm hooks' futures in its own end-of-backward callback and re-raises a
future's error as a ``RuntimeError`` holding only its text ("Got the following error when
running the callback: CollectiveFailure: ..."), so ``except ok.CollectiveFailure`` would not
catch it, unlike with ``ok.GradBucketer`` and ``ok.fsdp``. So a hook's future does not fail:
on a failed all-reduce the hook records the explained error, completes the future with the
bucket as it is (not averaged), and the relay raises the recorded error from an autograd final
callback that runs after DDP's. DDP's reducer then ends its backward normally, so the next
forward does not add a misleading "Expected to have finished reduction" error.

The healthy path costs one queued callback per step and no device sync.
"""

from __future__ import annotations

import threading

from torch.autograd import Variable

from overlapkit.failures import CollectiveFailure, CollectiveSite


class FailureRelay:
    """The first ``CollectiveFailure`` of a DDP step, raised once DDP has finished the step."""

    __slots__ = ("_claimed", "_failure", "_lock", "_queued")

    def __init__(self) -> None:
        self._claimed = False
        self._failure: CollectiveFailure | None = None
        self._lock = threading.Lock()
        self._queued = False

    def arm(self) -> None:
        """From a comm hook (autograd thread): check for a failure after DDP's final callback.

        DDP queues its end-of-backward callback when the last bucket is ready, after a hook's
        first call; a callback queued from a final callback runs after all of them.
        """
        if self._queued:
            return
        self._queued = True
        engine = Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self._raise_recorded))

    def record(self, site: CollectiveSite, error: BaseException) -> CollectiveFailure:
        """Explain ``error`` (a failed future, any thread) and keep the step's first failure.

        The first bucket to fail is kept (claimed before the check-in's grace period): the
        others fail because of it ("Application timeout caused pair closure").
        """
        with self._lock:
            first, self._claimed = not self._claimed, True
        failure = site.explain(error)
        failure.__cause__ = error
        if first:
            self._failure = failure
        return failure

    def _raise_recorded(self) -> None:
        self._queued = False
        with self._lock:  # DDP's final callback has waited for every bucket's future
            failure, self._failure, self._claimed = self._failure, None, False
        if failure is not None:
            raise failure
