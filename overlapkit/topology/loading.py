"""Load topologies from YAML: shipped presets, ``<preset>x<N>`` multi-node forms, and files.

A topology file describes identical nodes (see ``presets/*.yaml`` for commented examples)::

    name: dgx-h100
    library: nccl                 # whose achieved-bandwidth model applies: nccl | gloo | ideal
    nodes: 1
    devices_per_node: 8
    device_kind: gpu              # gpu | cpu | tpu | accelerator
    scale_up:
      kind: nvlink                # nvlink | ualink | ici | none
      nodes_per_domain: 1         # 18 for a GB200 NVL72 rack (its trays are nodes)
      links: 18
      link_bandwidth: 25GB/s      # per link and direction; or `bandwidth:` per device
      latency: 3.4us              # per collective step
      efficiency: 0.824           # achieved / specified bandwidth
      in_network_reduction: true
    scale_out:
      kind: rail-optimized        # none | fat-tree | rail-optimized | dragonfly
      transport: infiniband       # infiniband | roce | ultra-ethernet | ethernet
      nics_per_node: 8
      nic_bandwidth: 400Gbit/s
      latency: 14us
    accelerator:                  # optional: what the auto-planner needs (topology.accelerator)
      name: H100-SXM
      memory: 80GB
      peak_bf16_tflops: 989
      peak_fp8_tflops: 1979
      memory_bandwidth: 3.35TB/s
      sms: 132

Every error names the file, the line and the key (``dgx.yaml:12: scale_up.links: ...``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from overlapkit.topology import yaml_values as values
from overlapkit.topology.accelerator import Accelerator, HostCosts
from overlapkit.topology.model import (
    DeviceKind,
    DomainKind,
    FabricKind,
    Library,
    ScaleOutFabric,
    ScaleUpDomain,
    Topology,
    Transport,
    uniform_topology,
)

PRESET_DIR = Path(__file__).parent / "presets"
MAX_RANKS = 2**18
"""The largest world a topology may describe (262,144 ranks, beyond today's largest clusters);
a file asking for more is refused before a rank list of that size is built."""
_MULTI_NODE = re.compile(r"^(?P<base>.+)x(?P<count>\d+)$")

_KEYS = {
    "": {
        "name",
        "description",
        "library",
        "nodes",
        "devices_per_node",
        "device_kind",
        "scale_up",
        "scale_out",
        "accelerator",
    },
    "accelerator": {
        "name",
        "memory",
        "peak_bf16_tflops",
        "peak_fp8_tflops",
        "memory_bandwidth",
        "sms",
        "host",
    },
    "accelerator.host": {f.name.removesuffix("_s") for f in dataclasses.fields(HostCosts)},
    "scale_up": {
        "kind",
        "nodes_per_domain",
        "links",
        "link_bandwidth",
        "bandwidth",
        "latency",
        "efficiency",
        "in_network_reduction",
        "torus",
        "wraparound",
    },
    "scale_out": {
        "kind",
        "transport",
        "nics_per_node",
        "nic_bandwidth",
        "latency",
        "efficiency",
        "oversubscription",
        "nodes_per_leaf",
        "nodes_per_group",
        "global_taper",
        "in_network_reduction",
    },
}
_REQUIRED = object()


def preset_names() -> list[str]:
    """Names of the shipped presets (without the ``x<N>`` multi-node forms)."""
    return sorted(path.stem for path in PRESET_DIR.glob("*.yaml"))


def load_topology(name_or_path: str | Path, *, fabric: str | None = None) -> Topology:
    """A topology from a preset name, ``<preset>x<N>`` (N nodes of it) or a YAML file.

    Args:
        name_or_path (str | Path): ``"dgx-h100"``, ``"dgx-h100x4"``, ``"gb200-nvl72x2"`` or a
            path to a ``.yaml`` file.
        fabric (str): switch the scale-out fabric to ``fat-tree``, ``rail-optimized`` or
            ``dragonfly``. Defaults to what the file says.

    Returns:
        Topology: the validated topology.

    Raises:
        ValueError: unknown preset (the message suggests the nearest names), malformed YAML,
            unknown keys or bad values (file, line and key named).
        FileNotFoundError: a path that does not exist.
    """
    text = str(name_or_path)
    multiplier = 1
    if isinstance(name_or_path, Path) or text.endswith((".yaml", ".yml")) or "/" in text:
        path = Path(text)
        if not path.is_file():
            raise FileNotFoundError(f"topology file {text!r} does not exist")
        source, name = str(path), None
        try:
            contents = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not a UTF-8 text file ({err.reason})") from None
    else:
        presets = preset_names()
        match = _MULTI_NODE.match(text)
        if text not in presets and match and match["base"] in presets:
            if len(match["count"]) > 18:  # int() of a long digit string is slow, or refused
                raise ValueError(
                    f"topology {match['base']}x<N>: N has {len(match['count'])} digits; at most "
                    f"{MAX_RANKS} ranks are supported"
                )
            multiplier = int(match["count"])
            if multiplier < 1:
                raise ValueError(f"topology {text!r}: the node count after 'x' must be >= 1")
            text = match["base"]
        if text not in presets:
            raise ValueError(_unknown_preset_message(str(name_or_path), presets))
        path = PRESET_DIR / f"{text}.yaml"
        source = f"preset {text} ({path.name})"
        name = str(name_or_path)
        contents = path.read_text(encoding="utf-8")
    return parse_topology_yaml(
        contents, source=source, node_multiplier=multiplier, name=name, fabric=fabric
    )


def _unknown_preset_message(name: str, presets: list[str]) -> str:
    base = _MULTI_NODE.match(name)
    candidates = difflib.get_close_matches(base["base"] if base else name, presets, n=3, cutoff=0.4)
    hint = f" Did you mean {', '.join(candidates)}?" if candidates else ""
    return (
        f"unknown topology preset {name!r}.{hint} Presets: {', '.join(presets)}; add "
        "'x<N>' for N nodes (dgx-h100x4), or pass a .yaml file"
    )


def parse_topology_yaml(
    text: str,
    *,
    source: str,
    node_multiplier: int = 1,
    name: str | None = None,
    fabric: str | None = None,
) -> Topology:
    """Build a topology from YAML ``text``; errors name ``source``, the line and the key."""
    reader = _Reader.from_text(text, source)
    nodes = reader.value("nodes", values.integer(1), default=1) * node_multiplier
    scale_up = reader.section("scale_up")
    reader.section("scale_out")
    links = reader.value("scale_up.links", values.integer(0), default=1)
    domain = ScaleUpDomain(
        kind=reader.value("scale_up.kind", values.choice(DomainKind)),
        ranks=(0,),
        bandwidth_GBps=_domain_bandwidth(reader, scale_up, links),
        latency_us=reader.value("scale_up.latency", values.microseconds),
        links=links,
        in_network_reduction=reader.value(
            "scale_up.in_network_reduction", values.boolean, default=False
        ),
        efficiency=reader.value("scale_up.efficiency", values.fraction, default=1.0),
        torus=reader.value("scale_up.torus", values.int_tuple, default=None),
        wraparound=reader.value("scale_up.wraparound", values.bool_tuple, default=None),
    )
    fabric_kind = reader.value("scale_out.kind", values.choice(FabricKind))
    if fabric is not None:
        fabric_kind = FabricKind.parse(fabric, what="--fabric")
    nodes_per_leaf = reader.value("scale_out.nodes_per_leaf", values.integer(1), default=None)
    out = ScaleOutFabric(
        kind=fabric_kind,
        transport=reader.value("scale_out.transport", values.choice(Transport)),
        nics_per_node=reader.value("scale_out.nics_per_node", values.integer(0)),
        nic_GBps=reader.value("scale_out.nic_bandwidth", values.bandwidth),
        latency_us=reader.value("scale_out.latency", values.microseconds),
        efficiency=reader.value("scale_out.efficiency", values.fraction, default=1.0),
        oversubscription=reader.value("scale_out.oversubscription", values.real(1.0), default=1.0),
        nodes_per_leaf=nodes_per_leaf,
        # A preset switched to dragonfly by --fabric groups nodes like its leaves.
        nodes_per_group=reader.value(
            "scale_out.nodes_per_group", values.integer(1), default=nodes_per_leaf
        ),
        global_taper=reader.value("scale_out.global_taper", values.fraction, default=1.0),
        in_network_reduction=reader.value(
            "scale_out.in_network_reduction", values.boolean, default=False
        ),
    )
    nodes_per_domain = reader.value("scale_up.nodes_per_domain", values.integer(1), default=1)
    base_name = reader.value("name", values.string, default=source)
    if name is None:
        name = base_name if node_multiplier == 1 else f"{base_name}x{node_multiplier}"
    devices_per_node = reader.value("devices_per_node", values.integer(1))
    if nodes * devices_per_node > MAX_RANKS:
        raise ValueError(
            f"{reader.where('nodes')}: {nodes} nodes x {devices_per_node} devices_per_node = "
            f"{nodes * devices_per_node} ranks; at most {MAX_RANKS} are supported"
        )
    return uniform_topology(
        name=name,
        nodes=nodes,
        devices_per_node=devices_per_node,
        device_kind=reader.value("device_kind", values.choice(DeviceKind), default=DeviceKind.GPU),
        domain=domain,
        nodes_per_domain=nodes_per_domain,
        fabric=out,
        library=reader.value("library", values.choice(Library), default=Library.NCCL),
        source=source,
        accelerator=_accelerator(reader),
    )


def _accelerator(reader: _Reader) -> Accelerator | None:
    if "accelerator" not in reader.data:
        return None
    reader.section("accelerator")
    # Each value's error names its own line; what Accelerator refuses names the section's.
    fields = dict(
        name=reader.value("accelerator.name", values.string),
        memory_GB=reader.value("accelerator.memory", values.gigabytes),
        peak_bf16_tflops=reader.value("accelerator.peak_bf16_tflops", values.real(0.0)),
        peak_fp8_tflops=reader.value("accelerator.peak_fp8_tflops", values.real(0.0), default=None),
        memory_bandwidth_GBps=reader.value(
            "accelerator.memory_bandwidth", values.bandwidth, default=None
        ),
        sms=reader.value("accelerator.sms", values.integer(1), default=None),
        host=_host(reader),
    )
    try:
        return Accelerator(**fields)
    except ValueError as err:
        raise ValueError(f"{reader.where('accelerator')}: {err}") from None


def _host(reader: _Reader) -> HostCosts | None:
    if reader.data["accelerator"].get("host") is None:
        return None
    reader.section("accelerator.host")
    costs = {}
    for field in dataclasses.fields(HostCosts):
        # 0 is a measurement: on a host where nothing overlaps, nothing hides.
        convert = values.share if field.name == "overlap_efficiency" else values.seconds
        key = f"accelerator.host.{field.name.removesuffix('_s')}"
        costs[field.name] = reader.value(key, convert, default=field.default)
    return HostCosts(**costs)


def _domain_bandwidth(reader: _Reader, scale_up: dict, links: int) -> float:
    if "bandwidth" in scale_up and "link_bandwidth" in scale_up:
        raise ValueError(
            f"{reader.where('scale_up.bandwidth')}: give either bandwidth (per "
            "device) or link_bandwidth (per link), not both"
        )
    if "link_bandwidth" in scale_up:
        if links < 1:
            raise ValueError(f"{reader.where('scale_up.links')}: link_bandwidth needs links >= 1")
        per_link = reader.value("scale_up.link_bandwidth", values.bandwidth)
        total = float(links) * per_link if links <= 2**53 else math.inf
        if not math.isfinite(total):
            raise ValueError(
                f"{reader.where('scale_up.links')}: {links} links x {per_link:g} GB/s is not a "
                "finite bandwidth"
            )
        return total
    return reader.value("scale_up.bandwidth", values.bandwidth)


class _Reader:
    """Typed access to a parsed YAML document that knows each key's line."""

    def __init__(self, data: dict, lines: dict[str, int], source: str) -> None:
        self.data, self.lines, self.source = data, lines, source

    @classmethod
    def from_text(cls, text: str, source: str) -> _Reader:
        _check_bracket_depth(text, source)
        try:
            data = yaml.safe_load(text)
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"{source}:{mark.line + 1}" if mark is not None else source
            problem = getattr(err, "problem", None) or str(err)
            raise ValueError(f"{where}: not valid YAML: {problem}") from None
        except RecursionError:  # PyYAML composes nested collections recursively
            raise ValueError(f"{source}: nested too deeply for a topology file") from None
        except ValueError as err:
            # A scalar that resolves to a type whose constructor then refuses it: the date
            # 2001-13-01, the octal 0o99, an integer past sys.get_int_max_str_digits().
            raise ValueError(f"{source}: not valid YAML: a value cannot be read ({err})") from None
        if not isinstance(data, dict):
            raise ValueError(
                f"{source}: a topology file must be a mapping of keys (name, "
                f"scale_up, ...), got {type(data).__name__}"
            )
        _check_depth(node, source)
        lines: dict[str, int] = {}
        _record_lines(node, "", lines, source, set())
        reader = cls(data, lines, source)
        reader._check_keys("", data)
        return reader

    def where(self, key: str) -> str:
        line = self.lines.get(key)
        return f"{self.source}:{line}: {key}" if line else f"{self.source}: {key}"

    def _check_keys(self, section: str, mapping: dict) -> None:
        allowed = _KEYS[section]
        for key in mapping:
            if key not in allowed:
                path = f"{section}.{key}" if section else str(key)
                close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"{self.where(path)}: unknown key{hint}; valid keys"
                    f"{' in ' + section if section else ''}: "
                    f"{', '.join(sorted(allowed))}"
                )

    def section(self, name: str) -> dict:
        """The mapping at ``name`` (dotted for a nested one), its keys checked."""
        container: Any = self.data
        *parents, last = name.split(".")
        for part in parents:
            container = container[part]
        if last not in container:
            raise ValueError(f"{self.source}: missing section {name!r}")
        value = container[last]
        if not isinstance(value, dict):
            raise ValueError(f"{self.where(name)}: must be a mapping of keys, got {value!r}")
        self._check_keys(name, value)
        return value

    def value(self, key: str, convert: Callable[[Any], Any], *, default: Any = _REQUIRED) -> Any:
        container: Any = self.data
        *parents, last = key.split(".")
        for part in parents:
            container = container.get(part, {}) if isinstance(container, dict) else {}
        if last not in container or container[last] is None:
            if default is _REQUIRED:
                raise ValueError(f"{self.where(key)}: missing required key")
            return default
        try:
            return convert(container[last])
        except (ValueError, TypeError, OverflowError) as err:
            raise ValueError(f"{self.where(key)}: {err}") from None


_MAX_DEPTH = 8  # a topology file nests 3 levels: section, key, list
_BRACKET = re.compile(r"[\[\]{}]")


def _check_bracket_depth(text: str, source: str) -> None:
    """Refuse flow collections (``[``, ``{``) nested deeper than ``_MAX_DEPTH`` before PyYAML
    reads them: its scanner takes time quadratic in that depth (seconds for 4,000 levels).

    Brackets inside quoted strings count too, which can only overestimate the depth.
    """
    depth = 0
    for match in _BRACKET.finditer(text):
        depth = depth + 1 if match[0] in "[{" else max(depth - 1, 0)
        if depth > _MAX_DEPTH:
            line = text.count("\n", 0, match.start()) + 1
            raise ValueError(
                f"{source}:{line}: brackets nested deeper than {_MAX_DEPTH} levels; not a "
                "topology file"
            )


def _check_depth(root: yaml.Node, source: str) -> None:
    """Refuse collections nested deeper than ``_MAX_DEPTH``, before anything recurses into them
    (a repr of a value nested a thousand levels deep raises RecursionError)."""
    pending, seen = [(root, 0)], set()
    while pending:
        node, depth = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if depth > _MAX_DEPTH:
            raise ValueError(
                f"{source}:{node.start_mark.line + 1}: nested deeper than {_MAX_DEPTH} levels; "
                "not a topology file"
            )
        if isinstance(node, yaml.MappingNode):
            pending.extend((child, depth + 1) for pair in node.value for child in pair)
        elif isinstance(node, yaml.SequenceNode):
            pending.extend((child, depth + 1) for child in node.value)


def _record_lines(
    node: yaml.Node, path: str, lines: dict[str, int], source: str, seen_nodes: set[int]
) -> None:
    lines[path] = node.start_mark.line + 1
    # An alias is the same node object as its anchor: walk each node once, so that a chain of
    # aliases (a "billion laughs" document) or an anchor that contains itself stays linear.
    if id(node) in seen_nodes:
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            child = f"{path}.{key}" if path else key
            if key in seen:
                raise ValueError(
                    f"{source}:{key_node.start_mark.line + 1}: {child}: key appears twice"
                )
            seen.add(key)
            _record_lines(value_node, child, lines, source, seen_nodes)
