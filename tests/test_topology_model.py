"""The topology model: validation, groups, rails, hops and the JSON document."""

import dataclasses

import pytest

from overlapkit.topology import (
    Device,
    DomainKind,
    FabricKind,
    ScaleOutFabric,
    ScaleUpDomain,
    Topology,
    Transport,
    bare_link,
    load_topology,
)

FABRIC = ScaleOutFabric(
    kind=FabricKind.FAT_TREE,
    transport=Transport.INFINIBAND,
    nics_per_node=2,
    nic_GBps=50,
    latency_us=14,
)


def _domain(ranks, **changes):
    base = ScaleUpDomain(
        kind=DomainKind.NVLINK, ranks=tuple(ranks), bandwidth_GBps=450, latency_us=3.4, links=18
    )
    return dataclasses.replace(base, **changes)


def _devices(n, per_node=2):
    return tuple(
        Device(rank=r, node=r // per_node, local_index=r % per_node, nic=r % per_node)
        for r in range(n)
    )


def test_valid_topology_reports_nodes_rails_and_domains():
    topo = Topology(
        name="t", devices=_devices(4), domains=(_domain([0, 1]), _domain([2, 3])), fabric=FABRIC
    )
    assert topo.world_size == 4
    assert topo.nodes() == ((0, 1), (2, 3))
    assert topo.rails() == ((0, 2), (1, 3))
    assert topo.domain_index(3) == 1
    assert topo.first(3) == (0, 1, 2)


def test_device_in_two_domains_is_rejected_naming_it():
    with pytest.raises(ValueError, match=r"rank 1 is in two scale-up domains \(#0 and #1\)"):
        Topology(
            name="t",
            devices=_devices(4),
            domains=(_domain([0, 1]), _domain([1, 2, 3])),
            fabric=FABRIC,
        )


def test_device_in_no_domain_is_rejected():
    with pytest.raises(ValueError, match="rank 3 is in no scale-up domain"):
        Topology(name="t", devices=_devices(4), domains=(_domain([0, 1, 2]),), fabric=FABRIC)


def test_rail_index_out_of_range_is_rejected():
    devices = (*_devices(3), Device(rank=3, node=1, local_index=1, nic=2))
    with pytest.raises(ValueError, match=r"rank 3: rail \(nic\) index 2 is out of range for 2"):
        Topology(name="t", devices=devices, domains=(_domain([0, 1, 2, 3]),), fabric=FABRIC)


def test_duplicate_local_index_on_a_node_is_rejected():
    devices = (Device(0, 0, 0), Device(1, 0, 0))
    with pytest.raises(ValueError, match="local index 0 appears twice on node 0"):
        Topology(name="t", devices=devices, domains=(_domain([0, 1]),), fabric=FABRIC)


def test_devices_out_of_rank_order_are_rejected():
    devices = (Device(1, 0, 0), Device(0, 0, 1))
    with pytest.raises(ValueError, match="position 0 holds rank 1"):
        Topology(name="t", devices=devices, domains=(_domain([0, 1]),), fabric=FABRIC)


def test_two_domains_without_a_fabric_are_rejected():
    fabric = dataclasses.replace(FABRIC, kind=FabricKind.NONE)
    with pytest.raises(ValueError, match="need a scale-out fabric"):
        Topology(
            name="t", devices=_devices(4), domains=(_domain([0, 1]), _domain([2, 3])), fabric=fabric
        )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"bandwidth_GBps": 0}, "bandwidth_GBps must be > 0"),
        ({"efficiency": 1.5}, r"efficiency must be in \(0, 1\]"),
        ({"latency_us": -1}, "latency_us must be >= 0"),
        ({"torus": (2, 2)}, "a torus shape needs kind 'ici'"),
        ({"kind": DomainKind.ICI, "torus": (2, 3)}, r"torus \[2, 3\] holds 6 devices"),
    ],
)
def test_bad_domain_fields_are_rejected(changes, message):
    with pytest.raises(ValueError, match=message):
        Topology(
            name="t", devices=_devices(4), domains=(_domain(range(4), **changes),), fabric=FABRIC
        )


def test_bad_fabric_oversubscription_is_rejected():
    fabric = dataclasses.replace(FABRIC, oversubscription=0.5)
    with pytest.raises(ValueError, match="oversubscription must be >= 1"):
        Topology(name="t", devices=_devices(2), domains=(_domain([0, 1]),), fabric=fabric)


def test_first_rejects_a_group_larger_than_the_topology():
    with pytest.raises(ValueError, match="group_size 16 must be between 1 and the 8 devices"):
        load_topology("dgx-h100").first(16)


def test_rail_optimized_peers_with_equal_local_index_are_one_hop_apart():
    topo = load_topology("dgx-h100x4")
    assert topo.switch_hops(0, 1) == 0  # same NVLink domain
    assert topo.switch_hops(3, 11) == 1  # rail 3 on nodes 0 and 1
    assert topo.switch_hops(3, 12) == 3  # rail 3 to rail 4 goes over the spine
    assert topo.with_fabric("fat-tree").switch_hops(3, 12) == 1  # one leaf holds 32 nodes


def test_dragonfly_hops_cross_groups_through_global_links():
    topo = load_topology("dgx-h100x4").with_fabric("dragonfly")
    topo = dataclasses.replace(topo, fabric=dataclasses.replace(topo.fabric, nodes_per_group=2))
    assert topo.switch_hops(0, 8) == 1
    assert topo.switch_hops(0, 16) == 3


def test_to_dict_has_the_design_keys():
    doc = load_topology("dgx-h100x2").to_dict()
    assert {"name", "world_size", "nodes", "domains", "fabric"} <= doc.keys()
    assert doc["nodes"][1] == {"node": 1, "ranks": list(range(8, 16))}
    assert {"kind", "ranks", "bandwidth_GBps", "latency_us", "in_network_reduction"} <= doc[
        "domains"
    ][0].keys()
    assert {"kind", "nic_GBps", "rails"} <= doc["fabric"].keys()
    assert doc["fabric"]["rails"][0] == [0, 8]


def test_bare_link_is_one_domain_at_line_rate():
    topo = bare_link(1800.0, 0.0, 1024)
    assert topo.world_size == 1024 and len(topo.domains) == 1
    assert topo.domains[0].achieved_GBps == 1800.0
    assert str(topo.library) == "ideal"
