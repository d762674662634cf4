"""Name the rank a stall waits for within the stall limit, not at the collective timeout.

A rank stuck before a collective (a hung data loader, a deadlocked thread, a spin in user code)
leaves its peers blocked in that collective until the process group's timeout (300 s by
default), and gloo's error then names nobody. ``StallWatchdog`` runs a thread on every rank that
watches for progress: an optimizer step finished (``step()``), or a collective issued or
completed (the Flight Recorder's per-group counters, read in microseconds). After ``limit_s``
seconds without progress the rank asks every rank, through the c10d store the default group was
created with, for its arrival records: per process group the newest collective it issued and its
sequence number (torch's Flight Recorder, which records gloo's collectives when
``TORCH_FR_BUFFER_SIZE`` is set before the first group: ``enable_flight_recorder``), whether its
training thread waits in a send/recv (which gloo does not record), and where that thread is.
``stall_diagnosis.stall_line`` names the ranks that never arrived; the waiting ranks call
``on_stall`` with a ``StallError`` holding that line. The default ends the process with
``STALL_EXIT_CODE`` after the first of them logs the line and leaves it in torch elastic's error
file (the training thread is blocked in C++ and cannot be interrupted), so the launcher's restart
(``launcher.max_restarts``) follows as for any failed worker.

Nothing here issues a collective; on the healthy path each poll is one counter read and one store
round trip.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from overlapkit.group.failures import default_store
from overlapkit.group.stall_diagnosis import Op, RankState, States, holding_back, stall_line

logger = logging.getLogger(__name__)

STALL_EXIT_CODE = 75
"""The exit status of a worker ended by a stall (EX_TEMPFAIL: a restart may succeed)."""
FLIGHT_RECORDER_ENTRIES = 256
"""Flight Recorder entries ``enable_flight_recorder`` asks for: enough to hold the newest
collective of every group a step uses, and few enough that the records a rank publishes when a
stall is suspected take milliseconds (torch's dump of 2000 took 60 ms on an idle core)."""
STALL_FACTOR = 10.0
"""The automatic limit is this many times the slowest step seen (the first excluded) ..."""
STALL_FLOOR_S = 60.0
"""... and at least this many seconds (a pause of the host, a GC or a slow data shard is not a
stall) ..."""
STALL_TIMEOUT_SHARE = 0.5
"""... and at most this share of the collective timeout; before the first step ends, it is that."""
_POLL_FRACTION = 0.2
_MAX_POLL_S = 1.0
_KEY_ROOT = "overlapkit/stall"
_FR_SIZES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # torch reads either
_instances = itertools.count()


class StallError(RuntimeError):
    """Ranks made no progress for the stall limit; the message names those they wait for.

    Attributes:
        rank (int): the rank that waited.
        missing_ranks (tuple[int, ...]): the ranks that never arrived.
        first (bool): this rank was the first to tell (the others stay quiet by default).
    """

    def __init__(self, line: str, *, rank: int, missing_ranks: tuple[int, ...], first: bool):
        super().__init__(line)
        self.rank = rank
        self.missing_ranks = missing_ranks
        self.first = first


def enable_flight_recorder(entries: int = FLIGHT_RECORDER_ENTRIES) -> None:
    """Have torch's Flight Recorder record collectives (gloo's too) unless the user chose a size.

    Call before the first process group is created: torch reads ``TORCH_FR_BUFFER_SIZE`` once.
    Without it, the watchdog still detects stalls but names only ranks waited for in a
    send/recv, not those missing from a collective.
    """
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))


def end_process(error: StallError) -> None:
    """The default ``on_stall``: the first rank to tell logs the line; every waiting rank leaves
    it in torch elastic's error file (each node's launcher reads its own workers') and exits
    with ``STALL_EXIT_CODE``."""
    if error.first:
        logger.error("%s", error)
    ErrorHandler().record_exception(error)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STALL_EXIT_CODE)


def stall_message(message: str | dict) -> str | None:
    """The stall line from a failed worker's error message (torch elastic's
    ``ProcessFailure.message``: ``{"message": "StallError: <line>", ...}`` as ``end_process``
    records it, or a string), or None when it is not a stall."""
    text = message.get("message", "") if isinstance(message, dict) else message
    prefix = f"{StallError.__name__}: "
    return text[len(prefix) :] if isinstance(text, str) and text.startswith(prefix) else None


class StallWatchdog:
    """A thread that names the ranks a stall waits for; create one on every rank, in step.

    Args:
        limit_s (float | None): seconds without progress before the ranks are asked; None
            chooses it from the step times (``STALL_FACTOR``, ``STALL_FLOOR_S``,
            ``STALL_TIMEOUT_SHARE``; ``auto_limit_s``).
        collective_timeout_s (float): the process group's timeout; an explicit ``limit_s``
            must be below it.
        on_stall (Callable[[StallError], None] | None): called on the watchdog's thread by each
            rank that waits for a rank that never arrived. Defaults to ``end_process``.

    Raises:
        ValueError: ``limit_s`` is not a number of seconds in (0, ``collective_timeout_s``).
    """

    def __init__(
        self,
        limit_s: float | None,
        *,
        collective_timeout_s: float,
        on_stall: Callable[[StallError], None] | None = None,
    ):
        if limit_s is not None and not 0 < limit_s < collective_timeout_s:
            raise ValueError(
                f"stall limit must be > 0 s and below the collective timeout "
                f"({collective_timeout_s:g} s), got {limit_s!r}"
            )
        self._fixed_s = limit_s
        self._timeout_s = collective_timeout_s
        self._on_stall = on_stall or end_process
        self._rank = dist.get_rank()
        self._world = dist.get_world_size()
        self._store = default_store()
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._root = f"{_KEY_ROOT}/{attempt}/{next(_instances)}"
        self._trainer = threading.get_ident()
        self._lock = threading.Lock()
        self._step: int | None = None
        self._slowest_s = 0.0
        self._step_started = time.monotonic()
        self._progress = self._asked_at = time.monotonic()
        self._counters: object = None
        self._paused = 0
        self._answered = 0
        # The newest request another rank made, and when this rank saw it: a rank whose own
        # stall is due joins a request a poll old instead of making one (one request a stall,
        # not one per waiting rank).
        self._newest_request = (0, float("-inf"))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="overlapkit-stall", daemon=True)

    @property
    def limit_s(self) -> float:
        """The stall limit in force now, s."""
        return (
            self._fixed_s
            if self._fixed_s is not None
            else auto_limit_s(self._slowest_s if self._step is not None else None, self._timeout_s)
        )

    def start(self) -> StallWatchdog:
        """Start watching (returns self)."""
        if not any(os.environ.get(name, "0").strip() not in ("", "0") for name in _FR_SIZES):
            logger.warning(
                "stall watchdog: torch's Flight Recorder is off (TORCH_FR_BUFFER_SIZE unset), so "
                "a rank missing from a collective cannot be named; call "
                "ok.enable_flight_recorder() before init_process_group"
            )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive() and threading.get_ident() != self._thread.ident:
            self._thread.join()
        with contextlib.suppress(Exception):  # the store is gone: nobody is left to ask
            self._store.set(f"{self._root}/closed/{self._rank}", "1")

    def __enter__(self) -> StallWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(self, step: int | None = None) -> None:
        """Record that an optimizer step finished (``step``: its number; default: the next)."""
        now = time.monotonic()
        with self._lock:
            if self._step is not None:  # the first step (warm-up, compilation) sets no limit
                self._slowest_s = max(self._slowest_s, now - self._step_started)
            self._step = step if step is not None else (self._step or 0) + 1
            self._step_started = self._progress = now

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No stall is declared inside (a checkpoint, a trace export: long, and not a step)."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._step_started = self._progress = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(_MAX_POLL_S, _POLL_FRACTION * self.limit_s)):
            try:
                self._poll()
            except Exception as error:  # the store is gone: the job is ending anyway
                logger.warning("stall watchdog stops: %r", error)
                return

    def _poll(self) -> None:
        now = time.monotonic()
        counters = progress_counters()
        with self._lock:
            if counters != self._counters:
                self._counters, self._progress = counters, now
            stalled_s = now - self._progress if not self._paused else 0.0
            due = now - max(self._progress, self._asked_at) >= self.limit_s
        self._answer_if_asked()
        # Past the collective timeout the backend's own error has taken over (a rank whose
        # collective timed out is gone, and would be named as silent).
        if due and stalled_s < self._timeout_s:
            self._ask(stalled_s)

    def _answer_if_asked(self) -> None:
        asked = self._store.add(f"{self._root}/asked", 0)
        if asked > self._answered:
            self._newest_request = (asked, time.monotonic())
        self._answer(asked)

    def _answer(self, asked: int) -> None:
        """Answer every request up to ``asked`` not answered yet (two ranks may ask at once)."""
        if asked <= self._answered:
            return
        state = self.state().to_json()
        for request in range(self._answered + 1, asked + 1):
            self._store.set(f"{self._root}/{request}/{self._rank}", state)
        self._answered = asked

    def _ask(self, stalled_s: float) -> None:
        """Ask every rank for its state; when this rank waits for one that never arrived, call
        ``on_stall``. Then wait for progress again before asking anew."""
        asked_at = time.monotonic()
        poll_s = min(_MAX_POLL_S, _POLL_FRACTION * self.limit_s)
        request, seen_at = self._newest_request
        if asked_at - seen_at > poll_s:  # no other rank has just asked: ask
            request = self._store.add(f"{self._root}/asked", 1)
        self._answer(request)
        answer_s = 2 * poll_s + 1.0
        states = self._collect(request, answer_s)
        me = states[self._rank]
        assert me is not None
        line = stall_line(me, states, stalled_s=stalled_s, answer_s=answer_s)
        with self._lock:
            # Progress while the others answered (the stuck rank moved on): no stall after all.
            moved = self._progress > asked_at or progress_counters() != self._counters
            self._asked_at = time.monotonic()  # ask again after another limit without progress
        if line is None or moved:
            return
        first = self._store.add(f"{self._root}/told", 1) == 1
        missing = tuple(holding_back(me, states))
        self._on_stall(StallError(line, rank=self._rank, missing_ranks=missing, first=first))

    def _collect(self, request: int, answer_s: float) -> States:
        """Every rank's answer to ``request``: None for a rank silent for ``answer_s``; a rank
        whose watchdog has closed (it left the watched loop) is left out."""
        keys = {r: f"{self._root}/{request}/{r}" for r in range(self._world)}
        deadline = time.monotonic() + answer_s
        while True:
            if self._store.check(list(keys.values())):  # one round trip when all answered
                answered = set(keys)
            else:
                answered = {r for r, key in keys.items() if self._store.check([key])}
            closed = {
                r for r in keys.keys() - answered if self._store.check([f"{self._root}/closed/{r}"])
            }
            if len(answered | closed) == len(keys) or time.monotonic() >= deadline:
                break
            self._answer_if_asked()  # another rank may be asking at the same time
            time.sleep(0.05)
        ranks = sorted(answered)
        values = self._store.multi_get([keys[r] for r in ranks]) if ranks else []
        found = {r: RankState.from_json(bytes(v)) for r, v in zip(ranks, values, strict=True)}
        return {r: found.get(r) for r in keys if r not in closed}

    def state(self) -> RankState:
        """This rank's arrival records now."""
        frame = sys._current_frames().get(self._trainer)
        return RankState(
            rank=self._rank,
            step=self._step,
            where=_describe(frame),
            in_p2p=_in_torch_distributed(frame),
            paused=self._paused > 0,
            groups=_newest_per_group(),
        )


def auto_limit_s(slowest_step_s: float | None, collective_timeout_s: float) -> float:
    """The automatic stall limit: ``STALL_FACTOR`` x the slowest step (the first excluded), at
    least ``STALL_FLOOR_S``, at most ``STALL_TIMEOUT_SHARE`` x the collective timeout (which is
    also the limit before a step has been measured)."""
    cap = STALL_TIMEOUT_SHARE * collective_timeout_s
    if slowest_step_s is None:
        return cap
    return min(cap, max(STALL_FLOOR_S, STALL_FACTOR * slowest_step_s))


def progress_counters() -> object:
    """Per group, collectives issued and completed (microseconds to read; {} when off)."""
    raw = torch._C._distributed_c10d._dump_fr_trace_json(False)
    return json.loads(raw).get("pg_status", {})


def _newest_per_group() -> dict[str, Op]:
    """Per process group, the newest collective the Flight Recorder holds."""
    entries = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True)).get("entries", [])
    newest: dict[str, dict] = {}
    for entry in entries:
        group = str(entry["process_group"][0])
        if entry.get("is_p2p") or (
            group in newest and newest[group]["collective_seq_id"] >= entry["collective_seq_id"]
        ):
            continue
        newest[group] = entry
    now_ns = time.time_ns()
    found = {}
    for group, entry in newest.items():
        ranks = _group_ranks(group)
        if ranks is not None:
            found[group] = Op(
                name=str(entry["profiling_name"]).split(":", 1)[-1],
                ranks=ranks,
                seq=int(entry["collective_seq_id"]),
                age_s=max(0.0, (now_ns - int(entry["time_created_ns"])) / 1e9),
            )
    return found


def _group_ranks(name: str) -> tuple[int, ...] | None:
    try:  # private in torch, but the one map from a group's name to the group
        group = dist.distributed_c10d._resolve_process_group(name)
        return tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, KeyError):  # a group destroyed since
        return None


_TORCH_DISTRIBUTED = f"{os.sep}torch{os.sep}distributed{os.sep}"


_WRAPPER_FRAMES = 3
"""Frames above the innermost searched for ``torch.distributed``: a wait may be wrapped (the
live monitor times ``Work.wait`` from Python)."""


def _in_torch_distributed(frame: object) -> bool:
    """Whether the thread is waiting inside ``torch.distributed`` (its innermost frames)."""
    for _ in range(1 + _WRAPPER_FRAMES):
        if frame is None:
            return False
        if _TORCH_DISTRIBUTED in frame.f_code.co_filename:  # type: ignore[attr-defined]
            return True
        frame = frame.f_back  # type: ignore[attr-defined]
    return False


def _describe(frame: object) -> str:
    if frame is None:
        return "an unknown place (the training thread has ended)"
    code = frame.f_code  # type: ignore[attr-defined]
    path = Path(code.co_filename)
    short = "/".join(path.parts[-2:])
    return f"{short}:{frame.f_lineno} in {code.co_name}"  # type: ignore[attr-defined]
