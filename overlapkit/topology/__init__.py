"""Topology: devices, scale-up domains and scale-out fabric; presets, YAML files and detection."""

from overlapkit.topology.detect import detect_topology, local_view, merge_views
from overlapkit.topology.loading import load_topology, parse_topology_yaml, preset_names
from overlapkit.topology.model import (
    Device,
    DeviceKind,
    DomainKind,
    FabricKind,
    Library,
    ScaleOutFabric,
    ScaleUpDomain,
    Topology,
    Transport,
    bare_link,
)

__all__ = [
    "Device",
    "DeviceKind",
    "DomainKind",
    "FabricKind",
    "Library",
    "ScaleOutFabric",
    "ScaleUpDomain",
    "Topology",
    "Transport",
    "bare_link",
    "detect_topology",
    "load_topology",
    "local_view",
    "merge_views",
    "parse_topology_yaml",
    "preset_names",
]
