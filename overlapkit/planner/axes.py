"""Mesh axes and the search for a layout: sizes resolved, orders tried, nearest valid sizes.

Pure functions over a topology (no process group); ``placement.plan`` drives them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from enum import Enum

from overlapkit.planner.grid import (
    BlockViolation,
    block_violations,
    physical_order,
    rank_grid,
    span_violations,
)
from overlapkit.topology.model import Topology


class MeshAxis(str, Enum):
    """Mesh axis names, as ``DeviceMesh.mesh_dim_names`` holds them."""

    PP = "pp"
    DP = "dp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    EP = "ep"
    CP = "cp"
    TP = "tp"

    def __str__(self) -> str:
        return self.value


AXES = ("pp", "dp", "ep", "cp", "tp")
"""The traffic order, outermost first (Megatron-LM's ``tp-cp-ep-dp-pp`` read backwards)."""
HSDP_AXES = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
SCALE_UP_AXES = frozenset({"tp", "cp", "ep"})
"""Axes whose groups belong inside a scale-up domain."""


def _check_size(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def resolve_sizes(
    topology: Topology,
    *,
    tp: int,
    ep: int,
    cp: int,
    pp: int,
    dp: int,
    dp_shard: int | None,
) -> dict[str, int]:
    """Axis sizes with ``dp=-1`` resolved; errors name the sizes and the world size."""
    fixed = {"tp": tp, "ep": ep, "cp": cp, "pp": pp}
    for name, value in fixed.items():
        _check_size(value, name)
    world = topology.world_size
    product = math.prod(fixed.values())
    formula = f"tp x ep x cp x pp = {tp} x {ep} x {cp} x {pp} = {product}"
    if dp == -1:
        if world % product:
            raise ValueError(
                f"{formula} does not divide the {world} ranks of topology {topology.name!r}"
            )
        dp = world // product
    else:
        if isinstance(dp, bool) or not isinstance(dp, int):
            raise TypeError(f"dp must be an int (-1: whatever is left), got {dp!r}")
        if dp < 1:
            raise ValueError(f"dp must be -1 (whatever is left) or >= 1, got {dp}")
        if product * dp != world:
            raise ValueError(
                f"{formula.replace(' = ' + str(product), '')} x dp ({dp}) = {product * dp}, but "
                f"topology {topology.name!r} has {world} ranks; use dp=-1 for whatever is left"
            )
    sizes = {"pp": pp}
    if dp_shard is None:
        sizes["dp"] = dp
    else:
        _check_size(dp_shard, "dp_shard")
        if dp % dp_shard:
            raise ValueError(f"dp_shard ({dp_shard}) must divide dp ({dp})")
        sizes |= {"dp_replicate": dp // dp_shard, "dp_shard": dp_shard}
    return sizes | {"ep": ep, "cp": cp, "tp": tp}


def check_order(order: Sequence[str], names: tuple[str, ...]) -> tuple[str, ...]:
    """``order`` as a tuple of axis names, checked to name each of ``names`` once.

    ``dp_shard`` must come after (inside) ``dp_replicate``, as ``candidate_orders`` keeps it.
    """
    given = tuple(str(a) for a in ([order] if isinstance(order, str) else order))
    if sorted(given) != sorted(names):
        raise ValueError(
            f"order {list(given)} must name each mesh axis once, outermost first: "
            f"{', '.join(names)}"
        )
    if _shard_outside_replica(given):
        swapped = tuple(
            {"dp_shard": "dp_replicate", "dp_replicate": "dp_shard"}.get(a, a) for a in given
        )
        raise ValueError(
            f"order {list(given)} puts dp_shard outside dp_replicate; HSDP shards inside each "
            f'replica (mesh["dp_replicate", "dp_shard"] must be in mesh order): use {swapped}'
        )
    return given


def _shard_outside_replica(order: Sequence[str]) -> bool:
    """Whether ``order`` puts ``dp_shard`` before (outside) ``dp_replicate``.

    HSDP shards inside each replica: ok.fsdp takes ``mesh["dp_replicate", "dp_shard"]``, which
    torch can only slice in mesh order.
    """
    return {"dp_shard", "dp_replicate"} <= set(order) and order.index("dp_shard") < order.index(
        "dp_replicate"
    )


def candidate_orders(names: tuple[str, ...], sizes: dict[str, int]) -> list[tuple[str, ...]]:
    """Orders to try, the traffic order first, then by how many axis swaps they need.

    Only axes of size > 1 move; scale-up axes (tp, cp, ep) stay inside the others and
    ``dp_shard`` stays inside ``dp_replicate`` (FSDP's HSDP convention).
    """
    movable = [a for a in names if sizes[a] > 1]
    heavy = [a for a in movable if a in SCALE_UP_AXES]
    light = [a for a in movable if a not in SCALE_UP_AXES]
    options = []
    for h in itertools.permutations(heavy):
        for li in itertools.permutations(light):
            if _shard_outside_replica(li):
                continue
            slots = iter(li + h)
            options.append(tuple(next(slots) if sizes[a] > 1 else a for a in names))
    rank = {a: i for i, a in enumerate(names)}
    return sorted(options, key=lambda o: _inversions([rank[a] for a in o]))


def _inversions(values: list[int]) -> int:
    return sum(a > b for a, b in itertools.combinations(values, 2))


def fitting_axes(topology: Topology, sizes: dict[str, int]) -> list[str]:
    """Scale-up axes whose groups fit in a domain with the heavier ones (tp, then cp, then ep).

    An axis fits when the product of its size and the heavier axes' divides every domain's
    size; its groups must then stay inside one domain.
    """
    out, product = [], 1
    for axis in ("tp", "cp", "ep"):
        product *= sizes[axis]
        if sizes[axis] > 1 and all(len(d.ranks) % product == 0 for d in topology.domains):
            out.append(axis)
    return out


def search(
    topology: Topology,
    sizes: dict[str, int],
    candidates: Sequence[tuple[str, ...]],
    physical: Sequence[int],
) -> tuple[tuple[str, ...] | None, list[BlockViolation]]:
    """The first order without violations (and the first order's violations, if any)."""
    first: list[BlockViolation] = []
    fits = fitting_axes(topology, sizes)
    for i, candidate in enumerate(candidates):
        grid = rank_grid(physical, [sizes[a] for a in candidate])
        violations = block_violations(topology, grid, candidate)
        violations += span_violations(topology, grid, candidate, fits)
        if not violations:
            return candidate, first
        if i == 0:
            first = violations
    return None, first


def nearest_valid(
    topology: Topology,
    sizes: dict[str, int],
    *,
    dp_shard: int | None = None,
    limit: int = 3,
) -> list[dict[str, int]]:
    """Up to ``limit`` valid (tp, ep, cp) sizes nearest to ``sizes`` (log-distance), pp kept.

    Each suggestion holds ``tp``, ``ep``, ``cp``, ``pp`` and the leftover ``dp``.
    """
    pp = sizes["pp"]
    world = topology.world_size
    divisors = [d for d in range(1, world // pp + 1) if (world // pp) % d == 0]
    wanted = (sizes["tp"], sizes["ep"], sizes["cp"])
    combos = []
    for combo in itertools.product(divisors, repeat=3):
        if combo == wanted or (world // pp) % math.prod(combo):
            continue
        distance = sum(abs(math.log2(new / old)) for new, old in zip(combo, wanted, strict=True))
        combos.append((distance, combo))
    names = HSDP_AXES if dp_shard is not None else AXES
    physical = physical_order(topology)
    out: list[dict[str, int]] = []
    for _, (tp, ep, cp) in sorted(combos):
        dp = world // (pp * tp * ep * cp)
        if dp_shard is not None and dp % dp_shard:
            continue
        candidate = resolve_sizes(topology, tp=tp, ep=ep, cp=cp, pp=pp, dp=dp, dp_shard=dp_shard)
        if search(topology, candidate, candidate_orders(names, candidate), physical)[0]:
            out.append({"tp": tp, "ep": ep, "cp": cp, "pp": pp, "dp": dp})
            if len(out) == limit:
                break
    return out
