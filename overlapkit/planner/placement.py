"""``ok.plan``: parallel dimensions laid onto a topology, checked, explained, turned into a mesh.

The rank grid has the axes ``pp, dp, ep, cp, tp`` (outermost first; ``dp`` becomes
``dp_replicate, dp_shard`` when ``dp_shard`` is given). **Size-1 axes are kept**, so the mesh
always has the same axes and ``mesh["tp"]`` works whatever the sizes.

**Ordering by traffic.** Axes are laid out from the heaviest communicator (innermost) to the
lightest (outermost): ``tp`` (blocking all-reduces on every layer), ``cp`` (K/V every layer),
``ep`` (all-to-all on MoE layers), then the data-parallel axes (gradients once per step) and
``pp`` (one activation per micro-batch). This is Megatron-LM's ``tp-cp-ep-dp-pp`` order. The grid
is the topology's *physical* order (domain, node, rail, local index; see ``planner.grid``), not
rank order, so a tp group sits on neighbouring devices even when ranks are interleaved across
nodes.

**Domain integrity.** Every block of the innermost axes lies inside one scale-up domain or
covers whole domains (``grid.block_violations``). When the traffic order breaks it, the planner
tries the nearest other orders (fewest swaps), keeping tp/cp/ep inside the data-parallel axes
and ``pp``. If none works it raises ``PlacementError`` naming the sizes, proposing the nearest
valid sizes and the predicted penalty of forcing it; ``allow_split=True`` forces it.

**Rail alignment.** Position ``p`` of every domain is the same rail, so dp/pp peers in different
domains share their NIC index and their traffic stays on one rail switch (one hop).

**Expert grid.** ``ep`` is its own axis between ``dp`` and ``cp``; the sizes multiply to the world.
Expert layers shard experts over ``ep`` and tensor-parallelise each expert over ``tp``; their
weights are replicated over ``dp`` (and ``cp``). Dense layers see ``ep`` as more data parallelism:
their weights are replicated over ``dp x ep (x cp)``. Both grids share the pipeline groups
(``pp``). Placing ``ep`` inside ``dp`` keeps expert all-to-alls inside a domain whenever
``ep x cp x tp`` fits in one (72 ranks on a GB200 NVL72 rack).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from overlapkit.group.process_group import backend_device_type, inherit_timeout
from overlapkit.layout import TrainingLayout
from overlapkit.planner.axes import (
    AXES,
    HSDP_AXES,
    candidate_orders,
    check_order,
    nearest_valid,
    resolve_sizes,
    search,
)
from overlapkit.planner.explain import explain as render_explanation
from overlapkit.planner.explain import placement_dict
from overlapkit.planner.grid import BlockViolation, axis_groups, physical_order, rank_grid
from overlapkit.planner.penalties import split_penalties
from overlapkit.planner.traffic import CollectiveCost, Workload, step_collectives
from overlapkit.topology.model import Topology

logger = logging.getLogger(__name__)


class PlacementError(ValueError):
    """The sizes cannot be placed without splitting a domain; ``suggestions`` lists what can."""

    def __init__(self, message: str, suggestions: Sequence[dict[str, int]]):
        super().__init__(message)
        self.suggestions = list(suggestions)


class _MeshCache:
    """The DeviceMesh built for one placement, per device type and default process group."""

    __slots__ = ("_meshes",)

    def __init__(self) -> None:
        self._meshes: dict[str, tuple[object, DeviceMesh]] = {}

    def get(self, placement: Placement, device_type: str) -> DeviceMesh:
        world = dist.group.WORLD
        cached = self._meshes.get(device_type)
        if cached is not None and cached[0] is world:
            return cached[1]
        mesh = DeviceMesh(
            device_type,
            torch.tensor(placement.mesh, dtype=torch.int),
            mesh_dim_names=placement.mesh_dim_names,
        )
        for axis in placement.mesh_dim_names:
            inherit_timeout(mesh.get_group(axis))
        self._meshes[device_type] = (world, mesh)
        return mesh


@dataclass(frozen=True, slots=True)
class Placement:
    """Parallel axes on a topology: the rank grid, its groups, their predicted communication.

    Built by ``plan``; ``mesh_dim_names`` lists the axes outermost first, ``ranks`` the grid
    row-major over ``shape``.
    """

    topology: Topology
    mesh_dim_names: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    workload: Workload
    layout: str
    """``"traffic"`` (planned), ``"user"`` (an ``order=`` override) or ``"arange"`` (naive)."""
    notes: tuple[str, ...] = ()
    """Why the order differs from the traffic order, for ``explain``."""
    violations: tuple[BlockViolation, ...] = ()
    """Domain-integrity breaks that ``allow_split=True`` let through."""
    training: TrainingLayout | None = None
    """The auto-planner's whole choice (micro-batching, recomputation, sharding), if it chose."""
    _meshes: _MeshCache = field(default_factory=_MeshCache, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        assert sorted(self.ranks) == list(range(self.topology.world_size)), "not a permutation"
        assert math.prod(self.shape) == len(self.ranks)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def sizes(self) -> dict[str, int]:
        """Axis name -> size, outermost first."""
        return dict(zip(self.mesh_dim_names, self.shape, strict=True))

    @property
    def dims(self) -> dict[str, int]:
        """The parallel dimensions: ``pp, dp, ep, cp, tp`` (and the dp split, if any)."""
        sizes = self.sizes
        return {"dp": self.dp, **sizes} if "dp" not in sizes else sizes

    @property
    def dp(self) -> int:
        sizes = self.sizes
        return sizes.get("dp") or sizes["dp_replicate"] * sizes["dp_shard"]

    @property
    def grid(self) -> np.ndarray:
        return rank_grid(self.ranks, self.shape)

    @property
    def mesh(self) -> list:
        """The rank grid as nested lists, outermost axis first (what the DeviceMesh holds)."""
        return self.grid.tolist()

    def groups(self, axes: str | Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """The ranks of every group of ``axes`` (one axis name, or several together).

        ``"dp"`` means both data-parallel axes when dp is split. Each group lists its ranks
        by mesh coordinate along the axis.

        Raises:
            ValueError: an unknown axis name (the valid ones are listed).
        """
        names = self._resolve_axes(axes)
        return tuple(tuple(int(r) for r in row) for row in self._groups_array(names))

    def _groups_array(self, names: tuple[str, ...]) -> np.ndarray:
        return axis_groups(self.grid, self.mesh_dim_names, names)

    def _resolve_axes(self, axes: str | Sequence[str]) -> tuple[str, ...]:
        requested = (axes,) if isinstance(axes, str) else tuple(axes)
        names: list[str] = []
        for axis in requested:
            axis = str(axis)
            if axis == "dp" and "dp" not in self.mesh_dim_names:
                names += ["dp_replicate", "dp_shard"]
            elif axis in self.mesh_dim_names:
                names.append(axis)
            else:
                raise ValueError(
                    f"unknown mesh axis {axis!r}; valid: {', '.join(self.mesh_dim_names)}"
                    + ("" if "dp" in self.mesh_dim_names else ", dp")
                )
        if not names or len(set(names)) != len(names):
            raise ValueError(f"axes {list(requested)} must name each axis once")
        return tuple(names)

    def device_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """A torch ``DeviceMesh`` over the planned rank grid (a collective: every rank calls it).

        The mesh has every axis of ``mesh_dim_names``, size-1 axes included. It is built once
        per device type and process group and then reused. Its groups time out like the
        default group (``init_process_group(timeout=...)``, torchrun's), not after torch's
        30 minutes for new groups: a dead or stuck rank is reported within that timeout.

        Args:
            device_type (str): ``"cuda"``, ``"cpu"``, ... Defaults to the device of the default
                group's backend: ``"cpu"`` for gloo (also where CUDA is available), ``"cuda"``
                for NCCL or ``cpu:gloo,cuda:nccl``.

        Raises:
            RuntimeError: torch.distributed is not initialised.
            ValueError: the process group's world size is not the placement's, or
                ``device_type`` is not a device its backend is for (``"cuda"`` on gloo).
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "placement.device_mesh() needs an initialised process group "
                "(torch.distributed.init_process_group, or run under torchrun)"
            )
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"the process group has {dist.get_world_size()} ranks but the placement on "
                f"{self.topology.name!r} has {self.world_size}"
            )
        return self._meshes.get(self, backend_device_type(device_type))

    def collectives(self, algorithm: str | None = None) -> list[CollectiveCost]:
        """Every collective of a training step of ``workload``, with the predicted time.

        Args:
            algorithm (str): force ``ring``, ``tree``, ``hierarchical`` or ``switch`` where it
                can run (like ``NCCL_ALGO``). Defaults to the cost model's fastest.
        """
        return step_collectives(
            self.topology,
            self.sizes,
            self._groups_array,
            self.workload,
            algorithm=algorithm,
        )

    def comm_time_s(self, algorithm: str | None = None) -> float:
        """Predicted communication per step, seconds, with nothing overlapped."""
        return sum(c.total_s for c in self.collectives(algorithm))

    def explain(self, algorithm: str | None = None) -> str:
        """Per axis: group size, where its groups live, their collectives and predicted time."""
        planned = _traffic_placement(self) if self.layout == "user" else None
        return render_explanation(self, algorithm=algorithm, planned=planned)

    def to_dict(self, algorithm: str | None = None) -> dict:
        """The ``overlapkit plan --json`` document (keys fixed by docs/json-contracts.md)."""
        return placement_dict(self, algorithm=algorithm)


def plan(
    topology: Topology,
    tp: int = 1,
    ep: int = 1,
    cp: int = 1,
    pp: int = 1,
    dp: int = -1,
    *,
    dp_shard: int | None = None,
    order: Sequence[str] | None = None,
    allow_split: bool = False,
    workload: Workload | None = None,
) -> Placement:
    """Place tensor, expert, context, pipeline and data parallelism on ``topology``.

    Args:
        topology (Topology): ``ok.load_topology(...)`` or ``ok.detect_topology()``.
        tp (int): tensor-parallel size. Defaults to 1.
        ep (int): expert-parallel size (see the module doc's expert grid). Defaults to 1.
        cp (int): context-parallel size. Defaults to 1.
        pp (int): pipeline-parallel size. Defaults to 1.
        dp (int): data-parallel size; -1 means whatever is left. Defaults to -1.
        dp_shard (int): split dp into ``dp_replicate x dp_shard`` (HSDP; the shard axis
            inside), for ``ok.fsdp(mesh=mesh["dp_replicate", "dp_shard"])``. Defaults to None
            (one ``dp`` axis).
        order (Sequence[str]): mesh axis names outermost first, to override the traffic order.
        allow_split (bool): place it even when a group straddles domains; ``explain()`` then
            states the predicted penalty. Defaults to False.
        workload (Workload): the model whose communication ``explain`` predicts. Defaults to
            ``Workload()`` (7e9 parameters, bf16).

    Returns:
        Placement: the rank grid, its groups and predictions.

    Raises:
        TypeError: a size that is not an int, or a topology that is not a ``Topology``.
        ValueError: sizes < 1, sizes that do not multiply to (or divide) the world size, an
            ``order`` that does not name every axis once.
        PlacementError: (a ValueError) the sizes split a scale-up domain; the message proposes
            the nearest valid layouts.

    Example:
        >>> placement = ok.plan(ok.load_topology("dgx-h100x4"), tp=8, pp=2)
        >>> mesh = placement.device_mesh()          # dims ("pp", "dp", "ep", "cp", "tp")
        >>> print(placement.explain())
    """
    if not isinstance(topology, Topology):
        raise TypeError(
            f"topology must be an overlapkit Topology (ok.load_topology / ok.detect_topology), "
            f"got {type(topology).__name__}"
        )
    sizes = resolve_sizes(topology, tp=tp, ep=ep, cp=cp, pp=pp, dp=dp, dp_shard=dp_shard)
    workload = Workload() if workload is None else workload
    names = HSDP_AXES if dp_shard is not None else AXES
    layout = "traffic" if order is None else "user"
    candidates = (
        [check_order(order, names)] if order is not None else candidate_orders(names, sizes)
    )
    physical = physical_order(topology)
    chosen, violations = search(topology, sizes, candidates, physical)
    if chosen is not None:
        notes = (
            ()
            if chosen == candidates[0]
            else _reorder_notes(candidates[0], chosen, violations, sizes)
        )
        return _placed(topology, sizes, chosen, physical, workload, layout, notes=notes)
    forced = _placed(
        topology, sizes, candidates[0], physical, workload, layout, violations=tuple(violations)
    )
    if allow_split:
        logger.warning(
            "placement on %s splits scale-up domains (%s); allowed by allow_split",
            topology.name,
            ", ".join(v.axis for v in violations),
        )
        return forced
    own_orders = candidate_orders(names, sizes) if order is not None else None
    raise _refusal(forced, sizes, violations, dp_shard=dp_shard, own_orders=own_orders)


def _placed(
    topology: Topology,
    sizes: dict[str, int],
    order: tuple[str, ...],
    physical: tuple[int, ...],
    workload: Workload,
    layout: str,
    **extra: object,
) -> Placement:
    """The axes of ``sizes`` in ``order`` over the topology's ``physical`` order."""
    shape = tuple(sizes[a] for a in order)
    return Placement(topology, order, shape, physical, workload, layout, **extra)


def _traffic_placement(placement: Placement) -> Placement | None:
    """The planner's own layout for the same sizes, or None when it cannot place them."""
    sizes = placement.dims
    try:
        return plan(
            placement.topology,
            tp=sizes["tp"],
            ep=sizes["ep"],
            cp=sizes["cp"],
            pp=sizes["pp"],
            dp=sizes["dp"],
            dp_shard=sizes.get("dp_shard"),
            workload=placement.workload,
        )
    except PlacementError:
        return None


def naive_placement(placement: Placement) -> Placement:
    """The same sizes laid out as ``init_device_mesh`` would: ``arange`` in rank order."""
    names = HSDP_AXES if "dp_shard" in placement.mesh_dim_names else AXES
    sizes = placement.sizes
    return Placement(
        placement.topology,
        names,
        tuple(sizes[a] for a in names),
        tuple(range(placement.world_size)),
        placement.workload,
        "arange",
    )


def _reorder_notes(
    traffic: tuple[str, ...],
    chosen: tuple[str, ...],
    violations: list[BlockViolation],
    sizes: dict[str, int],
) -> tuple[str, ...]:
    broken = violations[0]
    return (
        f"order changed from the traffic order ({', '.join(traffic)}) to "
        f"({', '.join(chosen)}): {_block_text(broken, sizes)} {broken.reason}",
    )


def _block_text(violation: BlockViolation, sizes: dict[str, int]) -> str:
    axes = [a for a in reversed(violation.inner_axes) if sizes[a] > 1]
    if len(axes) == 1:
        return f"{axes[0]} = {violation.block_size} ranks"
    product = " x ".join(str(sizes[a]) for a in axes)
    return f"{' x '.join(axes)} = {product} = {violation.block_size} ranks"


def _refusal(
    forced: Placement,
    sizes: dict[str, int],
    violations: list[BlockViolation],
    *,
    dp_shard: int | None,
    own_orders: list[tuple[str, ...]] | None,
) -> PlacementError:
    """Why ``sizes`` cannot be placed whole, the nearest valid sizes, the penalty of forcing
    them (``forced``) and, for an ``order=`` override (``own_orders``: the planner's own
    candidates), how the planner would place them."""
    topology = forced.topology
    suggestions = nearest_valid(topology, sizes, dp_shard=dp_shard)
    first = violations[0]
    spread = ", ".join(f"{n} in domain {d}" for d, n, _ in first.domain_counts)
    lines = [
        f"cannot place {_format_sizes(sizes)} on {topology.name!r} without splitting a "
        f"scale-up domain: {_block_text(first, sizes)} {first.reason} "
        f"(ranks {_short(first.block)}: {spread})."
    ]
    traffic_order = None
    if own_orders is not None:
        traffic_order = search(topology, sizes, own_orders, forced.ranks)[0]
    if traffic_order is not None:
        lines.append(f"Without order=, the planner places them as ({', '.join(traffic_order)}).")
    if suggestions:
        lines.append(
            "Nearest valid layouts: " + "; ".join(_format_sizes(s) for s in suggestions) + "."
        )
    penalty = sum(p for _, p in split_penalties(forced))
    lines.append(
        "To place it anyway pass allow_split=True (overlapkit plan --allow-split): predicted "
        f"penalty {penalty * 1e3:+.4g} ms of communication per step for "
        f"{forced.workload.describe()}."
    )
    return PlacementError(" ".join(lines), suggestions)


def _short(ranks: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return shown + (", ..." if len(ranks) > limit else "")


def _format_sizes(sizes: dict[str, int]) -> str:
    """``tp=8 pp=2 dp=2``: the axes larger than 1, inner first, and dp always."""
    order = ("tp", "cp", "ep", "dp_shard", "dp_replicate", "pp")
    shown = [f"{a}={sizes[a]}" for a in order if sizes.get(a, 1) > 1]
    if "dp" in sizes:
        shown.append(f"dp={sizes['dp']}")
    return " ".join(shown)
