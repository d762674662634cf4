"""Shipped presets (vendor figures), the <preset>x<N> form, --fabric, and YAML errors."""

import pytest

from overlapkit.topology import (
    DomainKind,
    FabricKind,
    load_topology,
    parse_topology_yaml,
    preset_names,
)
from overlapkit.topology.loading import PRESET_DIR

REQUIRED_PRESETS = {
    "dgx-a100",
    "dgx-h100",
    "hgx-h200",
    "hgx-b200",
    "hgx-b300",
    "gb200-nvl72",
    "ualink-pod",
    "tpu-v5p-cube",
    "cpu-gloo",
}


def test_every_required_preset_ships_and_loads():
    assert set(preset_names()) >= REQUIRED_PRESETS
    for name in preset_names():
        topo = load_topology(name)
        assert topo.world_size >= 2, name


def test_every_preset_cites_its_figures_in_a_comment():
    for path in PRESET_DIR.glob("*.yaml"):
        comments = [line for line in path.read_text().splitlines() if line.startswith("#")]
        assert len(comments) >= 3, f"{path.name} has no citation comment"


# (preset, GB/s per GPU per direction, links, NICs per node, GB/s per NIC) from vendor figures:
# NVLink 3/4 at 600/900 GB/s bidirectional, NVLink 5 at 1.8 TB/s; 200/400/800 Gb/s NICs.
VENDOR_FIGURES = [
    ("dgx-a100", 300, 12, 8, 25),
    ("dgx-h100", 450, 18, 8, 50),
    ("hgx-h200", 450, 18, 8, 50),
    ("hgx-b200", 900, 18, 8, 50),
    ("hgx-b300", 900, 18, 8, 100),
    ("gb200-nvl72", 900, 18, 4, 50),
]


@pytest.mark.parametrize(("name", "gbps", "links", "nics", "nic_gbps"), VENDOR_FIGURES)
def test_gpu_presets_carry_the_vendor_specification_figures(name, gbps, links, nics, nic_gbps):
    topo = load_topology(name)
    domain = topo.domains[0]
    assert domain.kind is DomainKind.NVLINK
    assert domain.bandwidth_GBps == pytest.approx(gbps)
    assert domain.links == links
    assert topo.fabric.nics_per_node == nics
    assert topo.fabric.nic_GBps == pytest.approx(nic_gbps)


def test_achieved_nvlink_matches_nccls_per_link_figures():
    # NCCL topo.h: SM80 20.0, SM90 20.6, SM100 40.1 GB/s per link.
    assert load_topology("dgx-a100").domains[0].achieved_GBps == pytest.approx(12 * 20.0)
    assert load_topology("dgx-h100").domains[0].achieved_GBps == pytest.approx(18 * 20.6)
    assert load_topology("hgx-b200").domains[0].achieved_GBps == pytest.approx(18 * 40.1, 1e-3)


@pytest.mark.parametrize("name", ["dgx-h100", "hgx-h200", "hgx-b200", "gb200-nvl72"])
def test_ndr_nics_run_at_the_47_gb_s_nvidia_quotes(name):
    # nccl-tests #290: "For NDR @ 400Gbps you should see 46-48GB/s per NIC".
    assert load_topology(name).fabric.achieved_GBps == pytest.approx(47)
    assert "46-48GB/s per NIC" in (PRESET_DIR / f"{name}.yaml").read_text()


def test_nvl72_is_one_nvlink_domain_over_18_trays():
    topo = load_topology("gb200-nvl72")
    assert topo.num_nodes == 18 and topo.world_size == 72
    assert len(topo.domains) == 1 and topo.domains[0].in_network_reduction


def test_multi_node_form_repeats_the_preset_rail_optimized():
    topo = load_topology("dgx-h100x4")
    assert topo.name == "dgx-h100x4"
    assert topo.world_size == 32 and topo.num_nodes == 4 and len(topo.domains) == 4
    assert topo.fabric.kind is FabricKind.RAIL_OPTIMIZED
    racks = load_topology("gb200-nvl72x2")
    assert racks.world_size == 144 and [len(d.ranks) for d in racks.domains] == [72, 72]


def test_group_of_16_on_two_dgx_nodes_spans_both():
    topo = load_topology("dgx-h100x2")
    assert {topo.devices[r].node for r in topo.first(16)} == {0, 1}


def test_fabric_choice_replaces_the_scale_out_kind():
    assert load_topology("dgx-h100x2", fabric="fat-tree").fabric.kind is FabricKind.FAT_TREE
    assert load_topology("dgx-h100x2", fabric="dragonfly").fabric.nodes_per_group == 32
    with pytest.raises(ValueError, match="--fabric: unknown value 'torus'"):
        load_topology("dgx-h100x2", fabric="torus")


def test_torus_preset_has_shape_and_wraparound():
    domain = load_topology("tpu-v5p-cube").domains[0]
    assert domain.kind is DomainKind.ICI
    assert domain.torus == (4, 4, 4) and domain.wraparound == (True, True, True)
    assert domain.bandwidth_GBps == pytest.approx(600)  # 1200 GB/s bidirectional per chip


def test_unknown_preset_suggests_the_nearest_names():
    with pytest.raises(ValueError, match="preset 'dgx-h10'. Did you mean dgx-h100"):
        load_topology("dgx-h10")
    with pytest.raises(ValueError, match="Did you mean gb200-nvl72"):
        load_topology("gb200-nvl27x2")


def test_missing_file_is_reported():
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_topology("/tmp/overlapkit-does-not-exist/nope.yaml")


GOOD = """\
name: box
nodes: 2
devices_per_node: 4
scale_up:
  kind: nvlink
  links: 4
  link_bandwidth: 25GB/s
  latency: 3us
scale_out:
  kind: fat-tree
  transport: roce
  nics_per_node: 2
  nic_bandwidth: 200Gbit/s
  latency: 10us
  oversubscription: 2
  nodes_per_leaf: 1
"""


def test_a_topology_file_loads_with_its_figures(tmp_path):
    path = tmp_path / "box.yaml"
    path.write_text(GOOD)
    topo = load_topology(path)
    assert topo.world_size == 8 and topo.domains[0].bandwidth_GBps == 100
    assert topo.domains[0].latency_us == pytest.approx(3.0)
    assert topo.fabric.nic_GBps == 25 and topo.fabric.oversubscription == 2
    assert [d.nic for d in topo.devices[:4]] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("  links: 4", "  linkz: 4"),
            r"box.yaml:6: scale_up.linkz: unknown key \(did you mean 'links'\?\)",
        ),
        (("  links: 4", "  links: -3"), r"box.yaml:6: scale_up.links: must be >= 0, got -3"),
        (
            ("  latency: 3us", "  latency: 3"),
            "box.yaml:8: scale_up.latency: expected a duration with a unit",
        ),
        (("nodes: 2", "nodes: two"), "box.yaml:2: nodes: expected an integer, got 'two'"),
        (
            ("  kind: nvlink", "  kind: nvswitch"),
            "box.yaml:5: scale_up.kind: unknown value 'nvswitch'; valid: nvlink, ualink, ici, none",
        ),
        (
            ("  nic_bandwidth: 200Gbit/s", "  nic_bandwidth: fast"),
            "box.yaml:13: scale_out.nic_bandwidth: cannot read 'fast' as a bandwidth",
        ),
        (
            ("  oversubscription: 2", "  oversubscription: 0.5"),
            "scale_out.oversubscription: must be >= 1",
        ),
        (("nodes: 2", "nodes: 3\nscale_up_extra: 1"), "box.yaml:3: scale_up_extra: unknown key"),
        (("  links: 4", "  links: 4\n  links: 5"), "box.yaml:7: scale_up.links: key appears twice"),
    ],
)
def test_bad_files_name_the_file_line_and_key(tmp_path, edit, message):
    path = tmp_path / "box.yaml"
    path.write_text(GOOD.replace(*edit, 1))
    with pytest.raises(ValueError, match=message):
        load_topology(path)


def test_malformed_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nscale_up: {kind: nvlink\nscale_out: 1\n")
    with pytest.raises(ValueError, match=r"bad.yaml:\d+: not valid YAML"):
        load_topology(path)


def test_a_section_that_is_not_a_mapping_is_named():
    with pytest.raises(ValueError, match=r"box:2: scale_up: must be a mapping of keys"):
        parse_topology_yaml("name: x\nscale_up: [1, 2]\nscale_out: {}\n", source="box")


def test_a_file_that_is_not_a_mapping_is_rejected():
    with pytest.raises(ValueError, match="must be a mapping of keys"):
        parse_topology_yaml("- 1\n- 2\n", source="list.yaml")


def test_missing_section_and_key_are_named():
    with pytest.raises(ValueError, match="box: missing section 'scale_out'"):
        parse_topology_yaml(GOOD.split("scale_out:")[0], source="box")
    with pytest.raises(ValueError, match="box: devices_per_node: missing required key"):
        parse_topology_yaml(GOOD.replace("devices_per_node: 4\n", ""), source="box")


def test_domain_span_must_divide_the_nodes():
    text = GOOD.replace("  kind: nvlink", "  kind: nvlink\n  nodes_per_domain: 3")
    with pytest.raises(ValueError, match=r"nodes_per_domain \(3\) must divide nodes \(2\)"):
        parse_topology_yaml(text, source="box")
