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

from overlapkit.group.failures import CollectiveFailure, CollectiveSite


class FailureRelay:
    """The first ``CollectiveFailure`` of a DDP step, raised once DDP has finished the step."""

    __slots__ = ("_armed_step", "_claimed", "_failure", "_lock")

    def __init__(self) -> None:
        self._armed_step: int | None = None
        self._claimed = False
        self._failure: CollectiveFailure | None = None
        self._lock = threading.Lock()

    def arm(self, step: int) -> None:
        """From a comm hook (autograd thread): check for a failure after DDP's final callback.

        DDP queues its end-of-backward callback when the last bucket is ready, after a hook's
        first call; a callback queued from a final callback runs after all of them. Keyed by
        ``step`` (the recorder's, before the bucket is recorded) rather than by "already
        queued": a backward that another final callback aborted never runs ours, and the next
        step must still be checked.
        """
        if self._armed_step == step:
            return
        self._armed_step = step
        with self._lock:  # a failure of an aborted backward is not this step's
            self._failure, self._claimed = None, False
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
        with self._lock:  # DDP's final callback has waited for every bucket's future
            failure, self._failure, self._claimed = self._failure, None, False
        if failure is not None:
            raise failure
