"""A failed or timed-out collective, explained: what it was, for which bucket/block, who is missing.

When a rank dies (its process is killed) or stalls, its peers' next collective fails: at once when
the dead peer's sockets close (gloo: "Connection reset by peer"), or after the process group's
timeout when the peer is merely stuck. The backend's error names neither the missing rank nor what
overlapkit was reducing. So, on that failure only, each survivor:

1. checks in on the c10d store the default process group was created with (the rendezvous store:
   torchrun's, or the one passed to ``init_process_group``) under a key for this wrapper, group
   and step: ``overlapkit/checkin/<wrapper>#<n>/<group>/step<s>/<global rank>``, and under one
   for the wrapper and step alone, ``overlapkit/checkin/<wrapper>#<n>/step<s>/failed/<rank>``,
   holding which collective failed on which group;
2. waits up to ``CHECKIN_GRACE_S`` for the group's other ranks to check in too (a survivor whose
   peer died fails at once, one waiting on a stuck peer only after the timeout, hence the grace);
3. raises ``CollectiveFailure`` naming the collective, the bucket/block, the step and the ranks
   that never checked in: dead or stuck. A rank of the group that checked in for another group
   of the same wrapper (HSDP: its reduce-scatter failed, so it never reached the all-reduce across
   replicas) is alive, and is named with the collective and group it failed on instead. If the
   store itself cannot be reached, its host (rank 0 or torchrun's agent) is gone, and the error
   says so instead.

Nothing here touches the store or issues a collective on the healthy path: a ``CollectiveSite``
only remembers where a collective was launched, and ``ExplainedWork`` only forwards to the
backend's ``Work`` until ``wait()`` raises.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

CHECKIN_GRACE_S = 3.0
"""Seconds a survivor waits for the others to check in (env ``OVERLAPKIT_CHECKIN_GRACE_S``).

A survivor whose peer died fails within milliseconds; one blocked on a stuck peer fails at the
collective timeout. Survivors of the same step fail within about the launch skew of that step of
each other, which is far below this."""
_POLL_S = 0.05
_KEY_ROOT = "overlapkit/checkin"


class CollectiveFailure(RuntimeError):
    """A collective failed or timed out; the message names it and the ranks that are missing.

    Attributes:
        collective (str): ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``...
        where (str): the bucket or block, e.g. ``"bucket 1"`` or ``"block 0 ('layers.0')"``.
        step (int): the wrapper's step count (0-based) when the collective was launched.
        missing_ranks (tuple[int, ...] | None): global ranks of the group that never checked
            in anywhere (dead or stuck); None when the store could not be reached.
        failed_elsewhere (dict[int, str]): ranks of the group that did not reach this
            collective because one of theirs failed first on another group of the same wrapper
            (alive), each with that collective, e.g. ``"reduce_scatter of block 1 ('2') on the
            group [0, 1]"``.
        store_error (str | None): why the store could not be reached, if it could not.
    """

    def __init__(
        self,
        message: str,
        *,
        collective: str,
        where: str,
        step: int,
        missing_ranks: tuple[int, ...] | None,
        store_error: str | None,
        failed_elsewhere: dict[int, str] | None = None,
    ):
        super().__init__(message)
        self.collective = collective
        self.where = where
        self.step = step
        self.missing_ranks = missing_ranks
        self.failed_elsewhere = dict(failed_elsewhere or {})
        self.store_error = store_error


def grace_s() -> float:
    """The check-in grace period in seconds (``OVERLAPKIT_CHECKIN_GRACE_S`` or the default)."""
    raw = os.environ.get("OVERLAPKIT_CHECKIN_GRACE_S")
    if raw is None:
        return CHECKIN_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(
            f"OVERLAPKIT_CHECKIN_GRACE_S must be a number of seconds >= 0, got {raw!r}"
        )
    return value


@dataclass(frozen=True, slots=True)
class CheckIn:
    """What the check-in found out about the other ranks of a failed collective's group."""

    missing: tuple[int, ...] | None
    """Ranks that checked in nowhere within the grace period; None if the store is unreachable."""
    elsewhere: tuple[tuple[int, str], ...] = ()
    """(rank, what failed there) for ranks that checked in for another group instead."""
    store_error: str | None = None
    """Why the store could not be reached, if it could not."""


def check_in(
    store: dist.Store,
    prefix: str,
    rank: int,
    ranks: list[int],
    grace: float,
    *,
    failed_prefix: str | None = None,
    what: str = "",
) -> CheckIn:
    """Set ``prefix/rank`` and wait up to ``grace`` seconds for every rank in ``ranks`` to do so.

    With ``failed_prefix``, also set ``failed_prefix/rank`` to ``what`` (this rank's failed
    collective), and count a rank whose ``failed_prefix`` key exists as accounted for: it is
    alive and stopped at its own failure, elsewhere. The wait ends once every rank is accounted
    for.

    Returns:
        CheckIn: the ranks that never checked in and those that failed elsewhere, or the store's
        error when the store cannot be reached.
    """
    try:
        store.set(f"{prefix}/{rank}", "1")
        if failed_prefix is not None:
            store.set(f"{failed_prefix}/{rank}", what)
        deadline = time.monotonic() + grace
        while True:
            absent = [r for r in ranks if not store.check([f"{prefix}/{r}"])]
            elsewhere = tuple(
                (r, store.get(f"{failed_prefix}/{r}").decode())
                for r in absent
                if failed_prefix is not None and store.check([f"{failed_prefix}/{r}"])
            )
            alive = {r for r, _ in elsewhere}
            missing = tuple(r for r in absent if r not in alive)
            if not missing or time.monotonic() >= deadline:
                return CheckIn(missing, elsewhere)
            time.sleep(_POLL_S)
    except (RuntimeError, OSError) as error:  # DistNetworkError and DistStoreError included
        return CheckIn(None, store_error=f"{type(error).__name__}: {_first_line(error)}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def default_store() -> dist.Store:
    """The c10d store the default process group was created with (the rendezvous store)."""
    # Private in torch, but the only handle on the store the default group was created with.
    return dist.distributed_c10d._get_default_store()


# One diagnosis per (scope, group, step): the other buckets of a failed step reuse it instead of
# each waiting for the grace period again.
_diagnoses: dict[str, CheckIn] = {}
_diagnoses_lock = threading.Lock()
_instances: dict[str, itertools.count] = {}


def _diagnose(prefix: str, rank: int, ranks: list[int], failed_prefix: str, what: str) -> CheckIn:
    with _diagnoses_lock:
        if prefix not in _diagnoses:
            try:
                store = default_store()
            except (RuntimeError, ValueError) as error:
                _diagnoses[prefix] = CheckIn(
                    None, store_error=f"no default store ({_first_line(error)})"
                )
            else:
                _diagnoses[prefix] = check_in(
                    store, prefix, rank, ranks, grace_s(), failed_prefix=failed_prefix, what=what
                )
        return _diagnoses[prefix]


def describe_failure(
    *,
    caller: str,
    collective: str,
    where: str,
    step: int,
    rank: int,
    group_ranks: list[int],
    missing: tuple[int, ...] | None,
    store_error: str | None,
    error: BaseException,
    grace: float,
    elsewhere: tuple[tuple[int, str], ...] = (),
) -> str:
    """The message of a ``CollectiveFailure`` (a pure function of the diagnosis)."""
    head = f"{caller}: {collective} of {where} (step {step}) failed on rank {rank}"
    alive = "; ".join(f"rank {r} failed first in {what}" for r, what in elsewhere)
    if store_error is not None:
        who = (
            f"the missing rank(s) cannot be identified: the rendezvous store is unreachable "
            f"({store_error}); its host (rank 0, or torchrun's agent) has probably died"
        )
    elif missing:
        who = (
            f"rank(s) {list(missing)} of the group {group_ranks} never checked in within "
            f"{grace:g} s of the failure: dead or stuck (see their logs)"
        )
        if elsewhere:
            who += f"; alive, but stopped at their own failure: {alive}"
    elif elsewhere:
        who = (
            f"no rank of the group {group_ranks} is missing: rank(s) "
            f"{[r for r, _ in elsewhere]} are alive but never reached this collective, "
            f"because one of theirs failed first ({alive})"
        )
    else:
        who = (
            f"every rank of the group {group_ranks} reached this failure, so no rank is "
            "missing; the backend error is the cause"
        )
    return f"{head}: {who}. Backend error: {_first_line(error)}"


class FailureScope:
    """The collectives of one wrapper (one ``ok.ddp`` model, ``GradBucketer`` or ``ok.fsdp``).

    Wrappers are created in the same order on every rank, so ``<caller>#<n>`` names the same
    wrapper everywhere and a store key never mixes two wrappers' failures.

    Args:
        caller (str): the API, as the user spells it (``"ok.ddp"``).
        step_of (Callable[[], int]): returns the wrapper's current step count.
        on_failure (Callable[[], None] | None): run on the thread that raises, before each
            ``CollectiveFailure`` of this wrapper is raised (``ok.fsdp`` drops the failed
            step's gradients there). It must be idempotent: one failed step may be explained
            more than once (a reduce-scatter left pending is waited for again at the next
            forward). Defaults to None.
    """

    __slots__ = ("caller", "on_failure", "step_of", "token")

    def __init__(
        self,
        caller: str,
        step_of: Callable[[], int],
        *,
        on_failure: Callable[[], None] | None = None,
    ):
        self.caller = caller
        self.step_of = step_of
        self.on_failure = on_failure
        self.token = f"{caller}#{next(_instances.setdefault(caller, itertools.count()))}"

    def site(self, group: dist.ProcessGroup, collective: str, where: str) -> CollectiveSite:
        """Where a collective is being launched now (call at launch: the step may move on)."""
        return CollectiveSite(self, group, collective, where, self.step_of())


@dataclass(frozen=True, slots=True)
class CollectiveSite:
    """One launched collective: enough to explain its failure later, nothing more."""

    scope: FailureScope
    group: dist.ProcessGroup
    collective: str
    where: str
    step: int

    def explain(self, error: BaseException) -> CollectiveFailure:
        """Check in on the store, wait for the other ranks, and build the error to raise.

        Runs the scope's ``on_failure`` first: callers raise what this returns.
        """
        rank = dist.get_rank()
        ranks = dist.get_process_group_ranks(self.group)
        step_key = f"{_KEY_ROOT}/{self.scope.token}/step{self.step}"
        prefix = f"{_KEY_ROOT}/{self.scope.token}/{self.group.group_name}/step{self.step}"
        what = f"{self.collective} of {self.where} on the group {ranks}"
        found = _diagnose(prefix, rank, ranks, f"{step_key}/failed", what)
        message = describe_failure(
            caller=self.scope.caller,
            collective=self.collective,
            where=self.where,
            step=self.step,
            rank=rank,
            group_ranks=ranks,
            missing=found.missing,
            store_error=found.store_error,
            error=error,
            grace=grace_s(),
            elsewhere=found.elsewhere,
        )
        logger.error("%s", message)
        if self.scope.on_failure is not None:
            self.scope.on_failure()
        return CollectiveFailure(
            message,
            collective=self.collective,
            where=self.where,
            step=self.step,
            missing_ranks=found.missing,
            store_error=found.store_error,
            failed_elsewhere=dict(found.elsewhere),
        )

    def wrap(self, work: dist.Work) -> ExplainedWork:
        """``work`` whose ``wait()`` raises an explained ``CollectiveFailure``."""
        return ExplainedWork(work, self)


class ExplainedWork(dist.Work):
    """A backend ``Work`` that forwards everything, and explains a failed ``wait()``.

    A ``dist.Work`` subclass, so FSDP2 (which checks ``isinstance(work, Work)`` before waiting)
    treats it as the collective's own handle.
    """

    def __init__(self, work: dist.Work, site: CollectiveSite):
        super().__init__()
        self._work = work
        self._site = site

    def wait(self, timeout: object = None) -> bool:
        try:
            return self._work.wait() if timeout is None else self._work.wait(timeout)
        except RuntimeError as error:
            raise self._site.explain(error) from error

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> object:
        return self._work.exception()

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()

    def result(self) -> list[torch.Tensor]:
        return self._work.result()

    def synchronize(self) -> None:
        self._work.synchronize()
