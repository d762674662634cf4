"""Who a stalled rank is waiting for: from every rank's arrival records, the one line to print.

A pure function of what each rank published when asked (``RankState``): per process group the
newest collective it issued there (the Flight Recorder's sequence number counts them), whether
its training thread waits in a send/recv (which gloo does not record), and where that thread is.
``StallWatchdog`` (``stall_watchdog.py``) gathers the states; this module only reads them.

The rule. A rank that has issued collective ``k`` on a group while another rank of the group has
issued fewer is *ahead* there: it waits for those ranks, which never arrived. A rank ahead
nowhere whose training thread waits in a send/recv waits for every rank that waits for nobody.
A rank waited for that is itself waiting only passes the stall on, so the rule is followed from
there: the ranks named are those at the end of each chain, busy with something else (computing,
sleeping, loading data) or silent. Completion is not used: gloo marks the last collectives before
an idle spell completed only when the next one runs, so it would show a stuck rank as waiting.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

P2P = "send/recv"
"""What a rank waiting outside every recorded collective waits in: a pipeline's send/recv."""


@dataclass(frozen=True, slots=True)
class Op:
    """The newest collective one rank issued on one process group."""

    name: str
    """``all_reduce``, ``all_gather``, ``_reduce_scatter_base``, ``all_to_all``..."""
    ranks: tuple[int, ...]
    """The group's global ranks."""
    seq: int
    """Its sequence number on the group: the collectives this rank has issued there (from 1)."""
    age_s: float
    """Seconds since this rank issued it."""

    def describe(self) -> str:
        """``all_reduce #7 on the group [0, 1]``."""
        return f"{self.name} #{self.seq} on the group {list(self.ranks)}"


@dataclass(frozen=True, slots=True)
class RankState:
    """What one rank published about itself when a stall was suspected."""

    rank: int
    step: int | None
    """The last optimizer step this rank finished (None before the first)."""
    where: str
    """Its training thread's innermost Python frame, ``path:line in function``."""
    in_p2p: bool = False
    """Its training thread waits inside ``torch.distributed`` (a send/recv, say)."""
    paused: bool = False
    """It is in a phase declared long (a checkpoint, a trace export): not stuck."""
    groups: dict[str, Op] = field(default_factory=dict)
    """Per process group name, the newest collective this rank issued there."""

    def to_json(self) -> str:
        """The state as the store holds it."""
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> RankState:
        """The state ``to_json`` wrote."""
        raw = json.loads(text)
        groups = {
            name: Op(**{**op, "ranks": tuple(op["ranks"])}) for name, op in raw["groups"].items()
        }
        return RankState(**{**raw, "groups": groups})

    def last(self) -> Op | None:
        """The newest collective this rank issued on any group."""
        return min(self.groups.values(), key=lambda op: op.age_s, default=None)


States = dict[int, "RankState | None"]
"""Every rank's state by global rank; None for a rank that did not answer."""


def ahead(state: RankState, states: States) -> list[tuple[Op, list[int]]]:
    """The collectives ``state`` issued that some ranks of their group have not: each with
    those ranks (a rank that did not answer counts as not arrived), oldest first."""
    found = []
    for name, op in state.groups.items():
        behind = [
            r
            for r in op.ranks
            if r != state.rank and (states.get(r) is None or _issued(states[r], name) < op.seq)
        ]
        if behind:
            found.append((op, behind))
    return sorted(found, key=lambda item: -item[0].age_s)


def _issued(state: RankState, group: str) -> int:
    op = state.groups.get(group)
    return 0 if op is None else op.seq


def _waits_for(state: RankState, states: States) -> list[int]:
    """The ranks ``state`` waits for: behind it on a group, or, waiting in a send/recv and
    ahead nowhere, every rank that waits for nobody."""
    behind = sorted({r for _, ranks in ahead(state, states) for r in ranks})
    if behind or not state.in_p2p:
        return behind
    return [r for r, other in states.items() if r != state.rank and not _waits(other, states)]


def _waits(state: RankState | None, states: States) -> bool:
    return state is not None and (state.in_p2p or bool(ahead(state, states)))


def holding_back(me: RankState, states: States) -> list[int]:
    """The ranks at the end of the chains of waits that start at ``me``, sorted.

    Returns:
        list[int]: ranks that wait for nobody (or did not answer) and that ``me`` waits for,
        directly or through ranks that wait themselves; [] when ``me`` waits for nobody.
    """
    roots: set[int] = set()
    seen = {me.rank}
    frontier = _waits_for(me, states)
    while frontier:
        rank = frontier.pop()
        if rank in seen:
            continue
        seen.add(rank)
        state = states.get(rank)
        if _waits(state, states):
            frontier.extend(_waits_for(state, states))
        else:
            roots.add(rank)
    return sorted(roots)


def _whereabouts(rank: int, state: RankState | None, answer_s: float) -> str:
    if state is None:
        return f"rank {rank} did not answer within {answer_s:g} s (frozen, or its process is gone)"
    last = state.last()
    seen = "no collective recorded" if last is None else f"last seen in {last.describe()}"
    if last is not None:
        seen += f" {last.age_s:.1f} s ago"
    step = "" if state.step is None else f" after step {state.step}"
    return f"rank {rank} {seen}{step}, now at {state.where}"


def stall_line(me: RankState, states: States, *, stalled_s: float, answer_s: float) -> str | None:
    """The one line naming who ``me`` (no progress for ``stalled_s`` seconds) is waiting for.

    Returns:
        str | None: the line; None when ``me`` waits for nobody (it is the stuck one, or every
        rank has arrived and the transport, not a rank, is stuck) or for a rank in a phase
        declared long (``RankState.paused``).
    """
    culprits = holding_back(me, states)
    if not culprits or any(states.get(r) is not None and states[r].paused for r in culprits):
        return None
    waits = ahead(me, states)
    what = waits[0][0].describe() if waits else P2P
    step = "" if me.step is None else f" after step {me.step}"
    head = (
        f"stall: rank {me.rank} made no progress for {stalled_s:.1f} s, waiting in {what}{step}; "
        f"rank(s) {culprits} never arrived"
    )
    return f"{head}: " + "; ".join(_whereabouts(r, states.get(r), answer_s) for r in culprits)
