"""Predict collective time on a group of devices placed on a topology (alpha-beta model).

``estimate`` describes the group (``cost.shape``), costs every algorithm and protocol the
topology's library would consider (``cost.algorithms``) and returns the fastest, as NCCL picks;
``algorithm=`` forces one (like ``NCCL_ALGO``).

``nbytes`` means what nccl-tests calls size: the buffer for all-reduce and broadcast, the whole
gathered output for all-gather, the whole input for reduce-scatter, a rank's send buffer for
all-to-all, the message for send/recv. Bus bandwidth is nccl-tests': algbw x 2(n-1)/n for
all-reduce, x (n-1)/n for reduce-scatter, all-gather and all-to-all, x 1 otherwise.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from overlapkit.cost.algorithms import AVAILABLE, FORMULAS, why_not
from overlapkit.cost.libraries import HIERARCHICAL, LIBRARIES, P2P, PAIRWISE, RING, SWITCH, TREE
from overlapkit.cost.shape import GroupShape, group_shape, group_shapes
from overlapkit.topology.model import Topology, group_ranks
from overlapkit.topology.units import parse_size

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv")
ALGORITHMS = (RING, TREE, HIERARCHICAL, SWITCH)


class NamedGroups(Protocol):
    """What ``estimate(group="dp")`` needs of a placement (``ok.plan`` returns one)."""

    topology: Topology

    def groups(self, axes: str) -> Sequence[Sequence[int]]: ...


@dataclass(frozen=True, slots=True)
class Estimate:
    """Predicted time of one collective; the fastest candidate (or the forced algorithm)."""

    collective: str
    nbytes: float
    group_size: int
    algorithm: str
    protocol: str
    time_s: float
    algbw_GBps: float
    """``nbytes / time_s`` in GB/s (0 when nothing moves)."""
    busbw_GBps: float
    """nccl-tests bus bandwidth in GB/s."""
    library: str
    topology: str
    candidates: tuple[tuple[str, str, float], ...]
    """(algorithm, protocol, time_s) of every candidate considered, fastest first."""

    def to_dict(self) -> dict:
        """The ``overlapkit estimate --json`` document (keys fixed by docs/json-contracts.md)."""
        return {
            "collective": self.collective,
            "bytes": self.nbytes,
            "group_size": self.group_size,
            "algorithm": self.algorithm,
            "protocol": self.protocol,
            "time_s": self.time_s,
            "algbw_GBps": self.algbw_GBps,
            "busbw_GBps": self.busbw_GBps,
            "library": self.library,
            "topology": self.topology,
            "candidates": [
                {"algorithm": a, "protocol": p, "time_s": t} for a, p, t in self.candidates
            ],
        }


def available_algorithms(collective: str) -> tuple[str, ...]:
    """The algorithms the cost model has for ``collective``."""
    return AVAILABLE[normalize_collective(collective)]


def normalize_collective(name: str) -> str:
    """``"all-reduce"``, ``"allreduce"`` or ``"all_reduce"`` -> ``"all_reduce"``."""
    key = str(name).strip().lower().replace("-", "_")
    aliases = {c.replace("_", ""): c for c in COLLECTIVES} | {"sendrecv": "send_recv"}
    key = aliases.get(key.replace("_", ""), key)
    if key not in COLLECTIVES:
        close = difflib.get_close_matches(key, COLLECTIVES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown collective {name!r}{hint}; valid: {', '.join(COLLECTIVES)}")
    return key


def estimate(
    collective: str,
    *,
    nbytes: float | int | str,
    topology: Topology | None = None,
    group: Sequence[int] | str | None = None,
    group_size: int | None = None,
    algorithm: str | None = None,
    placement: NamedGroups | None = None,
) -> Estimate:
    """Predict the time of one collective on a group of ``topology``'s devices.

    Args:
        collective (str): ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``all_to_all``,
            ``broadcast`` or ``send_recv``.
        nbytes (float | int | str): size in bytes as nccl-tests counts it (see module doc);
            strings like ``"140GB"`` or ``"1.5GiB"`` are accepted.
        topology (Topology): where the devices are (``ok.load_topology`` /
            ``ok.detect_topology``). Defaults to ``placement``'s.
        group (Sequence[int] | str): the group's ranks, or an axis name of ``placement``
            (``"dp"``, ``"tp"``): then every group of that axis is estimated and the slowest
            returned, as a step waits for it. Defaults to the first ``group_size`` ranks.
        group_size (int): use the topology's first ``group_size`` devices. Defaults to all.
        algorithm (str): force ``ring``, ``tree``, ``hierarchical`` or ``switch`` (like
            ``NCCL_ALGO``). Defaults to the fastest the topology's library would pick.
        placement (Placement): an ``ok.plan(...)`` result whose groups a named ``group`` means.

    Returns:
        Estimate: ``time_s`` (seconds), ``algorithm``, ``algbw_GBps`` and ``busbw_GBps`` (GB/s).

    Raises:
        ValueError: unknown collective or algorithm, negative size, a group larger than the
            topology, an algorithm that cannot run on this group.
    """
    c = normalize_collective(collective)
    S = parse_size(nbytes, what="nbytes")
    if placement is not None:
        if topology is None:
            topology = placement.topology
        elif topology != placement.topology:
            raise ValueError(
                f"topology {topology.name!r} is not the placement's ({placement.topology.name!r}); "
                "pass one of them"
            )
    if topology is None:
        raise TypeError("estimate() needs topology= (or placement=)")
    if isinstance(group, str):
        if placement is None:
            raise TypeError(
                f"group={group!r}: named groups come from a placement plan; pass "
                "placement=ok.plan(topology, ...), the group's ranks (a list of ints) or "
                "group_size=N"
            )
        if group_size is not None:
            raise ValueError("pass either group (ranks) or group_size, not both")
        return slowest_estimate(
            c, nbytes=S, topology=topology, groups=placement.groups(group), algorithm=algorithm
        )
    if group is not None and group_size is not None:
        raise ValueError("pass either group (ranks) or group_size, not both")
    if group is not None:
        ranks = group_ranks(topology, group)
    else:
        ranks = topology.first(topology.world_size if group_size is None else group_size)
    _check_algorithm(c, algorithm)
    return _estimate_shape(c, S, group_shape(topology, ranks), topology, algorithm)


def estimate_shape(
    collective: str,
    *,
    nbytes: float,
    shape: GroupShape,
    topology: Topology,
    algorithm: str | None = None,
) -> Estimate:
    """``estimate`` for a group already described by ``group_shape``: arithmetic only.

    For callers that cost one group at many sizes (the planner): ``group_shape`` walks the
    group's ranks once; each size then costs only the candidates' formulas.

    Args:
        collective (str): as for ``estimate``.
        nbytes (float): size in bytes as nccl-tests counts it.
        shape (GroupShape): ``group_shape(topology, ranks)``.
        topology (Topology): the topology ``shape`` was built on (its library decides).
        algorithm (str): force one, as for ``estimate``.
    """
    c = normalize_collective(collective)
    _check_algorithm(c, algorithm)
    return _estimate_shape(c, float(nbytes), shape, topology, algorithm)


def _check_algorithm(c: str, algorithm: str | None) -> None:
    if algorithm is not None and algorithm not in AVAILABLE[c]:
        raise ValueError(
            f"algorithm {algorithm!r} does not run {c}; available for {c}: "
            f"{', '.join(AVAILABLE[c])}"
        )


def _estimate_shape(
    c: str, S: float, shape: GroupShape, topology: Topology, algorithm: str | None
) -> Estimate:
    lib = LIBRARIES[str(topology.library)]
    if shape.size == 1:
        return Estimate(c, S, 1, "none", "none", 0.0, 0.0, 0.0, lib.name, topology.name, ())
    if algorithm is not None:
        reason = why_not(algorithm, c, shape)
        if reason is not None:
            raise ValueError(f"--algorithm {algorithm} cannot run here: {reason}")
        algorithms = [algorithm]
    else:
        algorithms = [
            a
            for a in AVAILABLE[c]
            if (a in lib.auto_algorithms or a in (PAIRWISE, P2P)) and why_not(a, c, shape) is None
        ]
        if not algorithms:
            reasons = "; ".join(filter(None, (why_not(a, c, shape) for a in AVAILABLE[c])))
            raise ValueError(f"{c} cannot run on this group: {reasons}")
    intra_class = shape.intra.link_class if shape.intra else None
    candidates = sorted(
        (
            (a, p, FORMULAS[a](c, S, shape, lib, p))
            for a in algorithms
            for p in lib.protocols(a, intra_class=intra_class)
        ),
        key=lambda candidate: candidate[2],
    )
    best_algorithm, best_protocol, time_s = candidates[0]
    n = shape.size
    bus_factor = {
        "all_reduce": 2 * (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_gather": (n - 1) / n,
        "all_to_all": (n - 1) / n,
    }.get(c, 1.0)
    algbw = S / time_s / 1e9 if time_s > 0 else 0.0
    return Estimate(
        c,
        S,
        n,
        best_algorithm,
        best_protocol,
        time_s,
        algbw,
        algbw * bus_factor,
        lib.name,
        topology.name,
        tuple(candidates),
    )


def slowest_estimate(
    collective: str,
    *,
    nbytes: float | int | str,
    topology: Topology,
    groups: Sequence[Sequence[int]],
    algorithm: str | None = None,
    concurrent: bool = True,
) -> Estimate:
    """``estimate`` for the slowest of ``groups`` (groups that sit alike are estimated once).

    Args:
        concurrent (bool): the groups run at the same time (the groups of one mesh axis do), so
            ranks of groups that cross domains share their nodes' NICs. Defaults to True.
    """
    c = normalize_collective(collective)
    S = parse_size(nbytes, what="nbytes")
    _check_algorithm(c, algorithm)
    shapes = group_shapes(topology, groups, concurrent=concurrent)
    return max(
        (_estimate_shape(c, S, shape, topology, algorithm) for shape in shapes),
        key=lambda e: e.time_s,
    )
