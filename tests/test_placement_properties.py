"""Properties of ok.plan over random topologies and sizes (hypothesis).

- the placement is a permutation of all ranks, and every axis's groups partition them into
  groups of the axis's size;
- when tp divides the domain size, every tp group sits inside one domain;
- an independent oracle, the cumulative-product rule for equal domains (``_valid``), decides:
  the planner refuses exactly when no allowed order is valid (and then every suggested layout is
  placeable); otherwise its order is valid, and it is the traffic order whenever that one is;
- a user order with ``dp_shard`` outside ``dp_replicate`` is refused before placing.
"""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlapkit.planner import PlacementError, plan
from overlapkit.topology.model import (
    DeviceKind,
    DomainKind,
    FabricKind,
    Library,
    ScaleOutFabric,
    ScaleUpDomain,
    Transport,
    uniform_topology,
)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def topologies(draw):
    devices_per_node = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    nodes_per_domain = draw(st.sampled_from([1, 2, 3]))
    nodes = nodes_per_domain * draw(st.integers(1, 6))
    nics = draw(st.sampled_from(sorted({1, 2, devices_per_node})))
    domain = ScaleUpDomain(
        kind=DomainKind.NVLINK, ranks=(0,), bandwidth_GBps=450, latency_us=3.4, links=18
    )
    fabric = ScaleOutFabric(
        kind=draw(st.sampled_from([FabricKind.FAT_TREE, FabricKind.RAIL_OPTIMIZED])),
        transport=Transport.INFINIBAND,
        nics_per_node=nics,
        nic_GBps=50,
        latency_us=14,
    )
    return uniform_topology(
        name="random",
        nodes=nodes,
        devices_per_node=devices_per_node,
        device_kind=DeviceKind.GPU,
        domain=domain,
        nodes_per_domain=nodes_per_domain,
        fabric=fabric,
        library=Library.NCCL,
        source="hypothesis",
    )


@st.composite
def layouts(draw):
    topology = draw(topologies())
    left = topology.world_size
    sizes = {}
    for axis in ("tp", "cp", "ep", "pp"):
        sizes[axis] = draw(st.sampled_from(_divisors(left)))
        left //= sizes[axis]
    dp_shard = draw(st.none() | st.sampled_from(_divisors(left)))
    return topology, sizes, dp_shard


def _valid(domain, sizes, order):
    """The oracle for equal domains of ``domain`` ranks and an order (innermost first).

    Each cumulative product of the sizes divides ``domain`` or is a multiple of it, and each
    scale-up axis that fits with the heavier ones (tp, then cp, then ep: their product divides
    ``domain``) has its own cumulative product dividing ``domain`` (its groups stay inside).
    """
    product, inner = 1, {}
    for axis in order:
        product *= sizes[axis]
        inner[axis] = product
        if sizes[axis] > 1 and domain % product and product % domain:
            return False
    heavy = 1
    for axis in ("tp", "cp", "ep"):
        heavy *= sizes[axis]
        if sizes[axis] > 1 and domain % heavy == 0 and domain % inner[axis]:
            return False
    return True


def _orders(dp_shard):
    """Innermost first: the traffic order, then every order the planner may pick instead."""
    light = ["dp"] if dp_shard is None else ["dp_shard", "dp_replicate"]
    out = []
    for heavy in itertools.permutations(["tp", "cp", "ep"]):
        for outer in itertools.permutations([*light, "pp"]):
            if dp_shard is None or outer.index("dp_shard") < outer.index("dp_replicate"):
                out.append([*heavy, *outer])
    return out


def _all_sizes(topology, sizes, dp_shard):
    dp = topology.world_size // math.prod(sizes.values())
    extra = (
        {"dp": dp} if dp_shard is None else {"dp_shard": dp_shard, "dp_replicate": dp // dp_shard}
    )
    return sizes | extra


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_placement_is_a_permutation_and_every_group_has_its_size(layout):
    topology, sizes, dp_shard = layout
    placement = plan(topology, **sizes, dp_shard=dp_shard, allow_split=True)
    world = topology.world_size
    assert sorted(placement.ranks) == list(range(world))
    for axis, size in placement.sizes.items():
        groups = placement.groups(axis)
        assert len(groups) == world // size
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world))


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_tp_groups_sit_in_one_domain_when_tp_fits_and_refusals_match_the_oracle(layout):
    topology, sizes, dp_shard = layout
    domain = len(topology.domains[0].ranks)
    every = _all_sizes(topology, sizes, dp_shard)
    orders = _orders(dp_shard)
    try:
        placement = plan(topology, **sizes, dp_shard=dp_shard)
    except PlacementError as err:
        assert not any(_valid(domain, every, order) for order in orders)
        for suggestion in err.suggestions:
            plan(topology, **suggestion, dp_shard=dp_shard)
        return
    chosen = list(reversed(placement.mesh_dim_names))
    assert _valid(domain, every, chosen)
    if _valid(domain, every, orders[0]):
        assert chosen == orders[0] and not placement.notes
    else:
        assert placement.notes
    assert placement.ranks == tuple(range(topology.world_size))  # ranks are node by node here
    if domain % sizes["tp"] == 0:
        for group in placement.groups("tp"):
            assert len({topology.domain_index(r) for r in group}) == 1


@settings(max_examples=150, deadline=None)
@given(layouts(), st.randoms(use_true_random=False))
def test_a_user_order_is_placed_exactly_when_the_oracle_says_it_is_valid(layout, random):
    topology, sizes, dp_shard = layout
    every = _all_sizes(topology, sizes, dp_shard)
    order = list(every)
    random.shuffle(order)
    outermost_first = list(reversed(order))
    if dp_shard is not None and outermost_first.index("dp_shard") < outermost_first.index(
        "dp_replicate"
    ):
        # Refused before placing: mesh["dp_replicate", "dp_shard"] could not be sliced.
        with pytest.raises(ValueError, match="puts dp_shard outside dp_replicate"):
            plan(topology, **sizes, dp_shard=dp_shard, order=outermost_first)
        return
    try:
        placement = plan(topology, **sizes, dp_shard=dp_shard, order=outermost_first)
    except PlacementError:
        assert not _valid(len(topology.domains[0].ranks), every, order)
        return
    assert _valid(len(topology.domains[0].ranks), every, order)
    assert placement.mesh_dim_names == tuple(reversed(order))
