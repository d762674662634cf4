"""topology.accelerator: presets carry GPU memory and peaks; the YAML section is checked."""

import pytest

from overlapkit.topology import load_topology, parse_topology_yaml
from overlapkit.topology.loading import PRESET_DIR


@pytest.mark.parametrize(
    ("preset", "memory", "bf16"),
    [("dgx-a100", 80, 312), ("dgx-h100", 80, 989), ("hgx-h200", 141, 989), ("hgx-b200", 180, 2250)],
)
def test_gpu_presets_carry_memory_and_dense_peak(preset, memory, bf16):
    accelerator = load_topology(preset).accelerator
    assert accelerator.memory_GB == memory and accelerator.peak_bf16_tflops == bf16


def test_multi_node_presets_keep_the_accelerator():
    assert load_topology("dgx-h100x4").accelerator == load_topology("dgx-h100").accelerator


def test_a100_has_no_fp8_peak_and_says_so():
    with pytest.raises(ValueError, match="has no FP8 peak"):
        load_topology("dgx-a100").accelerator.peak_tflops("fp8")


def _with_accelerator(section: str) -> str:
    text = (PRESET_DIR / "dgx-h100.yaml").read_text()
    return text[: text.index("accelerator:")] + section


def test_unknown_accelerator_key_is_refused_with_its_line():
    text = _with_accelerator("accelerator:\n  name: X\n  memory: 80GB\n  peak_bf16: 1\n")
    with pytest.raises(ValueError, match=r"accelerator.peak_bf16: unknown key"):
        parse_topology_yaml(text, source="t.yaml")


def test_accelerator_memory_needs_a_unit():
    text = _with_accelerator("accelerator:\n  name: X\n  memory: 80\n  peak_bf16_tflops: 1\n")
    with pytest.raises(ValueError, match=r"^t.yaml:\d+: accelerator.memory: expected a size"):
        parse_topology_yaml(text, source="t.yaml")


def test_topology_json_includes_the_accelerator():
    doc = load_topology("dgx-h100").to_dict()
    assert doc["accelerator"]["peak_fp8_tflops"] == 1979


def _host_section(efficiency: str) -> str:
    return _with_accelerator(
        "accelerator:\n  name: measured-cpu\n  memory: 16GB\n  peak_bf16_tflops: 0.01\n"
        f"  host:\n    collective_overhead: 1.9ms\n    overlap_efficiency: {efficiency}\n"
    )


def test_a_measured_host_that_hides_nothing_loads_and_a_share_above_one_is_refused():
    host = parse_topology_yaml(_host_section("0.0"), source="t.yaml").accelerator.host
    assert (host.overlap_efficiency, host.collective_overhead_s) == (0.0, pytest.approx(1.9e-3))
    with pytest.raises(
        ValueError, match=r"^t.yaml:\d+: accelerator.host.overlap_efficiency: .*\[0, 1\], got 1.5$"
    ):
        parse_topology_yaml(_host_section("1.5"), source="t.yaml")
