"""A DDP step's failed all-reduces, raised from ``loss.backward()`` as one ``CollectiveFailure``.

DDP waits for its comm hooks' futures in its own end-of-backward callback and re-raises a
future's error as a ``RuntimeError`` holding only its text ("Got the following error when
running the callback: CollectiveFailure: ..."), so ``except ok.CollectiveFailure`` would not
catch it, unlike with ``ok.GradBucketer`` and ``ok.fsdp``. So a hook's future does not fail: on a
failed all-reduce the hook records the error and completes the future with the bucket as it is
(not averaged), and the relay raises before DDP's end of backward could:

- usually from an autograd final callback queued at the step's first hook, which runs before
  DDP's (DDP queues its own when the last bucket is ready): it waits for the step's buckets, as
  DDP would next. It must come first: with ``find_unused_parameters=True`` DDP's end of backward
  also waits for its own all-reduce of the used-parameter map, whose bare backend error would
  escape instead;
- with ``static_graph=True``'s first step, DDP runs every hook inside its end-of-backward
  callback, after the used-parameter all-reduce is launched; then the last bucket's hook waits
  for the step's buckets and raises from inside it.

Either way DDP's reducer never finishes that backward, so the DDP module's next forward resets it
(``Reducer._reset_state``, what DDP's own ``_update_process_group`` calls; a forward pre-hook
added on failure, which removes itself) instead of raising "Expected to have finished reduction
in the prior iteration".

The step's gradients are dropped before raising: every ``.grad`` the relay was given is set to
None on the ranks that saw the failure, so an ``optimizer.step()`` after catching the error (a
retry loop, a framework's error handler) leaves parameters and optimizer state unchanged instead
of applying each rank's own un-averaged gradients and splitting the replicas apart.

Backward also returns only once every bucket's gloo work has finished, not just its future: gloo
completes a work's future first and closes the work's profiler range after, on its own thread
(``ProcessGroupGloo::AsyncWork::finishWorkGloo``, then ``Work::finish``), so a profiler stopped
right after backward (``ok.profile`` at the end of its window) could have that range written
into its freed record queue: a rare native heap corruption under load. ``Work.wait()`` holds
the work's lock until ``finish`` is done.

Every failed bucket of the step is named, and the check-in (``overlapkit.group.failures``) runs
once per step from the autograd thread, not in a backend's completion callback. The healthy path
costs one queued callback and one list append per bucket per step, and no device sync.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from overlapkit.group.failures import CollectiveSite


def buckets_named(indices: Iterable[int]) -> str:
    """``"bucket 3"`` or ``"buckets 0, 1"``: the failed buckets of a step, in index order."""
    ordered = sorted(set(indices))
    if len(ordered) == 1:
        return f"bucket {ordered[0]}"
    return "buckets " + ", ".join(str(i) for i in ordered)


class FailureRelay:
    """The failed buckets of a DDP step, raised as one ``CollectiveFailure`` before DDP's end.

    Args:
        parameters (Iterable[Tensor]): whose ``.grad`` is set to None when a step fails
            (``ok.ddp`` passes the model's trainable parameters). Defaults to none.
    """

    __slots__ = (
        "_armed_step",
        "_failed",
        "_futures",
        "_inside_end_of_backward",
        "_lock",
        "_model",
        "_reset_pending",
        "_works",
        "parameters",
    )

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self.parameters = list(parameters)
        self._armed_step: int | None = None
        self._failed: list[tuple[CollectiveSite, int, BaseException]] = []
        self._futures: list[torch.futures.Future] = []
        self._works: list[dist.Work] = []
        self._inside_end_of_backward = False
        self._reset_pending = False
        self._model: weakref.ref[DistributedDataParallel] | None = None
        self._lock = threading.Lock()

    def attach(self, model: DistributedDataParallel) -> None:
        """Reset ``model``'s reducer at its next forward after a step the relay raised from."""
        self._model = weakref.ref(model)

    def arm(self, step: int) -> None:
        """From a comm hook (autograd thread), before it launches: a step begins.

        Keyed by ``step`` (the recorder's, before the bucket is recorded) rather than by
        "already queued": a backward that another final callback aborted never runs ours, and
        the next step must still be checked.
        """
        if self._armed_step == step:
            return
        self._armed_step = step
        with self._lock:  # a failure of an aborted backward is not this step's
            self._failed, self._futures, self._works = [], [], []
        # No autograd node runs while final callbacks do: DDP's static-graph first step.
        self._inside_end_of_backward = torch._C._current_autograd_node() is None
        if not self._inside_end_of_backward:
            Variable._execution_engine.queue_callback(self._raise_if_failed)

    def launched(
        self, future: torch.futures.Future, *, last: bool, work: dist.Work | None = None
    ) -> torch.futures.Future:
        """From a comm hook: ``future`` (which never fails) is this step's bucket; returns it.

        Args:
            future (Future): what the hook returns to DDP.
            last (bool): the step's last bucket.
            work (Work | None): the bucket's collective, waited for before backward returns.

        Raises:
            CollectiveFailure: ``last`` inside DDP's end-of-backward callback, and a bucket of
                the step failed.
        """
        self._futures.append(future)
        if work is not None:
            self._works.append(work)
        if last and self._inside_end_of_backward:
            self._raise_if_failed()
        return future

    def record(self, site: CollectiveSite, bucket_index: int, error: BaseException) -> None:
        """A bucket's collective failed (any thread): keep it for the end of the step."""
        with self._lock:
            self._failed.append((site, bucket_index, error))

    def _raise_if_failed(self) -> None:
        # DDP would wait for the same futures next; they complete, failed or not.
        for future in self._futures:
            future.wait()
        for work in self._works:
            # A failed one re-raises its error, which the hook's callback recorded: raised below.
            with contextlib.suppress(RuntimeError):
                work.wait()
        with self._lock:
            failed, self._failed, self._futures, self._works = self._failed, [], [], []
        if not failed:
            return
        for p in self.parameters:
            p.grad = None
        self._reset_at_next_forward()
        site, _, first_error = failed[0]
        where = buckets_named(index for _, index, _ in failed)
        failure = dataclasses.replace(site, where=where).explain(first_error)
        raise failure from first_error

    def _reset_at_next_forward(self) -> None:
        # Not now: inside DDP's end-of-backward callback its reducer holds its lock.
        model = None if self._model is None else self._model()
        if model is None or self._reset_pending:
            return
        self._reset_pending = True

        def reset(module: DistributedDataParallel, _inputs: object) -> None:
            handle.remove()
            self._reset_pending = False
            module.reducer._reset_state()

        handle = model.register_forward_pre_hook(reset, prepend=True)
