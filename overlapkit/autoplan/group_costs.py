"""Collective times per mesh axis without building the rank grid: what makes the search fast.

``ok.plan`` lays the axes over the topology's physical order (``planner.grid``) in the traffic
order ``pp, dp, ep, cp, tp`` (HSDP: ``pp, dp_replicate, dp_shard, ep, cp, tp``), innermost
fastest. When that order keeps every block inside a domain (or a union of whole domains), the
groups of an axis are the ranks at positions ``base + j x stride`` of the physical order, where
``stride`` is the product of the sizes inside the axis; on a topology of equal domains and
nodes every group of an axis then sits alike, so one representative group (``base = 0``) gives
the axis's cost. A group over several axes spans each with its own stride (HSDP's dense
replicas, ``dp_replicate x ep x cp``, skip the ``dp_shard`` axis between them).
``AxisCosts`` describes that group once (``cost.group_shape``: the walk over its ranks, the
slow part) and asks the cost model for each size on the shape
(``cost.estimate_shape``: arithmetic only), caching every (collective, size, group) it was
asked: the search prices thousands of layouts with a few hundred shapes and estimates, each
the cost model's own figure (no interpolation), and places only the few it shows.

Where a node has fewer NICs than ranks, concurrent groups share them (``group_shape``'s
``node_load``): the groups that share the representative's nodes are passed along with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from overlapkit.cost.estimate import estimate_shape
from overlapkit.cost.shape import GroupShape, group_shapes
from overlapkit.layout import TrainingLayout
from overlapkit.planner.grid import physical_order
from overlapkit.topology.model import Library, Topology

TRAFFIC_ORDER = ("pp", "dp", "ep", "cp", "tp")
HSDP_ORDER = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")


def uniform(topology: Topology) -> bool:
    """Equal domains and equal nodes: every group of an axis sits alike."""
    domain_sizes = {len(d.ranks) for d in topology.domains}
    node_sizes = {len(n) for n in topology.nodes()}
    return len(domain_sizes) == 1 and len(node_sizes) == 1


def domain_size(topology: Topology) -> int:
    return min(len(d.ranks) for d in topology.domains)


def blocks_intact(topology: Topology, sizes: Mapping[str, int], order: Sequence[str]) -> bool:
    """Whether every block of the innermost axes lies in one domain or covers whole ones.

    The equal-domain form of ``grid.block_violations``: each cumulative product of the sizes
    above 1, innermost first, divides the domain size or is a multiple of it.
    """
    d = domain_size(topology)
    product = 1
    for axis in reversed(order):
        if sizes.get(axis, 1) == 1:
            continue
        product *= sizes[axis]
        if d % product and product % d:
            return False
    return True


class AxisCosts:
    """Predicted collective times on the representative group of each axis, cached.

    Args:
        topology (Topology): a topology of equal domains and nodes (``uniform``).
        algorithm (str): force an algorithm where it can run (like ``NCCL_ALGO``).
    """

    def __init__(self, topology: Topology, *, algorithm: str | None = None) -> None:
        if not uniform(topology):
            raise ValueError(
                f"topology {topology.name!r} has unequal domains or nodes; the auto-planner "
                "prices layouts on equal ones"
            )
        self.topology = topology
        self.algorithm = algorithm
        self._physical = physical_order(topology)
        self._ranks_per_node = len(topology.nodes()[0])
        self._cache: dict[tuple, float] = {}
        self._shapes: dict[tuple, tuple[int, int]] = {}
        self._group_shapes: dict[tuple, list[GroupShape]] = {}
        self.estimates = 0
        """How many cost-model estimates were made (cache misses)."""

    def time_s(
        self,
        collective: str,
        nbytes: float,
        sizes: Mapping[str, int],
        order: Sequence[str],
        axes: Sequence[str],
    ) -> float:
        """Seconds for one ``collective`` of ``nbytes`` over the groups of ``axes`` together.

        ``axes`` are axes of ``order`` (``("dp", "ep")``: the dense replicas); a group of size
        1 costs 0. ``send_recv`` costs one pair of neighbours along the axis.
        """
        spans = self.shape(sizes, order, axes)
        if not spans or nbytes <= 0:
            return 0.0
        key = (collective, nbytes, spans)
        cached = self._cache.get(key)
        if cached is None:
            self.estimates += 1
            algorithm = self.algorithm if collective == "all_reduce" else None
            cached = max(
                estimate_shape(
                    collective,
                    nbytes=nbytes,
                    shape=shape,
                    topology=self.topology,
                    algorithm=algorithm,
                ).time_s
                for shape in self._shapes_of(collective, spans)
            )
            self._cache[key] = cached
        return cached

    def shape(
        self, sizes: Mapping[str, int], order: Sequence[str], axes: Sequence[str]
    ) -> tuple[tuple[int, int], ...]:
        """The groups of ``axes``: a (stride in the physical order, size) per run of adjacent
        axes above size 1, outermost first; empty for a group of one rank."""
        key = (tuple(sizes.items()), tuple(order), tuple(axes))
        cached = self._shapes.get(key)
        if cached is None:
            spans: list[tuple[int, int]] = []
            for index, axis in enumerate(order):
                if axis not in axes or sizes[axis] == 1:
                    continue
                stride = math.prod(sizes[a] for a in order[index + 1 :])
                if spans and spans[-1][0] == stride * sizes[axis]:  # adjacent: one run
                    spans[-1] = (stride, spans[-1][1] * sizes[axis])
                else:
                    spans.append((stride, sizes[axis]))
            cached = tuple(spans)
            self._shapes[key] = cached
        return cached

    def group(self, spans: Sequence[tuple[int, int]], *, base: int = 0) -> list[int]:
        """The ranks at physical positions ``base + sum(j_k x stride_k)``, ``j_k < size_k``:
        one group of the axes ``spans`` describes (``shape``)."""
        positions = [base]
        for stride, size in spans:
            positions = [p + j * stride for p in positions for j in range(size)]
        return [self._physical[p] for p in positions]

    def _shapes_of(self, collective: str, spans: tuple[tuple[int, int], ...]) -> list[GroupShape]:
        """The shapes whose slowest decides: the representative group's, or a pair of it."""
        pair = collective == "send_recv"
        if pair:  # one pair of neighbours along the (pipeline) axis
            spans = ((spans[-1][0], 2),)
        key = (pair, spans)
        shapes = self._group_shapes.get(key)
        if shapes is None:
            shapes = group_shapes(self.topology, self._groups(spans, pair))
            self._group_shapes[key] = shapes
        return shapes

    def _groups(self, spans: tuple[tuple[int, int], ...], pair: bool) -> list[list[int]]:
        group = self.group(spans)
        nics = self.topology.fabric.nics_per_node
        crosses = len({self.topology.domain_index(r) for r in group}) > 1
        if pair or not crosses or nics >= self._ranks_per_node:
            return [group]
        # Fewer NICs than ranks: the groups whose ranks share group 0's nodes load its NICs
        # (those that start at the positions below the innermost stride, within a node).
        inner = spans[-1][0]
        return [self.group(spans, base=b) for b in range(min(inner, self._ranks_per_node))]


class LayoutCollectives:
    """One layout's collectives priced on ``AxisCosts``, each call with a fixed overhead.

    The axes are ``layout``'s sizes in the traffic order (``TRAFFIC_ORDER``; under hsdp
    ``HSDP_ORDER``, dp split into ``dp_replicate x dp_shard``).

    Args:
        costs (AxisCosts): the topology's representative groups.
        layout (TrainingLayout): the sizes of the axes.
        call_overhead_s (float): seconds every call costs beyond the cost model's transfer (its
            launch and the wait for the last rank); added only to a call that moves something.
    """

    def __init__(
        self, costs: AxisCosts, layout: TrainingLayout, *, call_overhead_s: float = 0.0
    ) -> None:
        self.costs = costs
        self.call_overhead_s = call_overhead_s
        self.sizes = dict(layout.dims)
        self.order = TRAFFIC_ORDER
        if layout.sharding == "hsdp":
            self.order = HSDP_ORDER
            self.sizes |= {
                "dp_replicate": layout.dp // layout.dp_shard,
                "dp_shard": layout.dp_shard,
            }
            del self.sizes["dp"]

    @property
    def library(self) -> Library:
        """The collective library the topology's ranks run."""
        return self.costs.topology.library

    def __call__(self, collective: str, nbytes: float, *axes: str) -> float:
        """Seconds of one ``collective`` call of ``nbytes`` over the groups of ``axes``; 0 for a
        group of one rank or no bytes."""
        seconds = self.costs.time_s(collective, nbytes, self.sizes, self.order, axes)
        return seconds + self.call_overhead_s if seconds > 0 else 0.0

    def in_chunks(self, collective: str, nbytes: float, chunks: int, *axes: str) -> float:
        """Seconds of ``nbytes`` sent as ``chunks`` equal calls over the groups of ``axes``."""
        return chunks * self(collective, nbytes / chunks, *axes)
