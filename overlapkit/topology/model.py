"""A typed, immutable model of a cluster: devices, scale-up domains and the scale-out fabric.

Both detection (``ok.detect_topology()``) and YAML presets (``ok.load_topology("dgx-h100x4")``)
produce a ``Topology``. Bandwidths are per device (or per NIC) and per direction, in GB/s
(10^9 bytes/s), as vendors' specifications give them; ``efficiency`` says which fraction of that a
collective library achieves for bulk transfers (the preset says where its figure comes from).
Latencies are per collective step, in microseconds.

A group of size n on a topology means its first n devices in rank order (``Topology.first(n)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from overlapkit.topology.accelerator import Accelerator


class _Choice(str, Enum):
    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: object, *, what: str = "") -> _Choice:
        """The member spelled ``value``; ValueError naming ``what`` and the valid set if none."""
        try:
            return cls(str(value))
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            lead = f"{what}: " if what else ""
            raise ValueError(f"{lead}unknown value {value!r}; valid: {valid}") from None


class DomainKind(_Choice):
    """The fabric that joins a scale-up domain's devices."""

    NVLINK = "nvlink"  # NVLink through NVSwitch: a node's GPUs, or a whole NVL72 rack
    UALINK = "ualink"  # UALink pod behind UALink switches
    ICI = "ici"  # TPU-style inter-chip interconnect: a torus (or mesh) of direct links
    NONE = "none"  # no fast fabric: PCIe or shared memory (CPU workers) only


class FabricKind(_Choice):
    """How the nodes' NICs are switched."""

    NONE = "none"  # a single node: nothing to switch
    FAT_TREE = "fat-tree"  # Clos; nodes_per_leaf nodes share a leaf, oversubscribed above it
    RAIL_OPTIMIZED = "rail-optimized"  # NIC i of every node on rail switch i (one hop apart)
    DRAGONFLY = "dragonfly"  # groups of nodes, joined by global links (tapered by global_taper)


class Transport(_Choice):
    INFINIBAND = "infiniband"
    ROCE = "roce"
    ULTRA_ETHERNET = "ultra-ethernet"
    ETHERNET = "ethernet"  # plain TCP sockets (gloo)


class DeviceKind(_Choice):
    GPU = "gpu"
    CPU = "cpu"
    TPU = "tpu"
    ACCELERATOR = "accelerator"


class Library(_Choice):
    """Which collective library's achieved-bandwidth model applies (see ``cost.libraries``)."""

    NCCL = "nccl"
    GLOO = "gloo"
    IDEAL = "ideal"  # line rate, no protocol overhead: a bare link

    @property
    def moves_host_tensors(self) -> bool:
        """The library reduces tensors in host memory: gloo, torch's backend for CPU ranks.

        A framework runs its host-device code there, its CUDA code on the others, and the two
        may issue different collectives for the same work (overlapkit-train's context
        parallelism gathers K and V with a call each on host devices, in one buffer on CUDA).
        """
        return self is Library.GLOO


@dataclass(frozen=True, slots=True)
class Device:
    """One rank-addressable accelerator or CPU worker."""

    rank: int
    node: int
    local_index: int
    """Index within its node (torchrun's LOCAL_RANK)."""
    kind: DeviceKind = DeviceKind.GPU
    nic: int = 0
    """Rail: index of the node's NIC this device sends through (its nearest NIC)."""


@dataclass(frozen=True, slots=True)
class ScaleUpDomain:
    """Devices joined by a fast fabric; every device belongs to exactly one domain."""

    kind: DomainKind
    ranks: tuple[int, ...]
    bandwidth_GBps: float
    """Per device, per direction, all links together (specification)."""
    latency_us: float
    """Per collective step."""
    links: int
    """Links per device (0 for kind "none")."""
    in_network_reduction: bool = False
    """The switch can reduce (NVLS / SHARP-style), so all-reduce moves each byte once."""
    efficiency: float = 1.0
    """Achieved fraction of ``bandwidth_GBps`` for bulk collective transfers."""
    torus: tuple[int, ...] | None = None
    """ICI only: the torus (or mesh) shape, e.g. (4, 4, 4)."""
    wraparound: tuple[bool, ...] | None = None
    """ICI only: per torus dimension, whether it wraps around (torus) or not (mesh)."""

    @property
    def achieved_GBps(self) -> float:
        """What a library achieves per device and direction: bandwidth x efficiency, GB/s."""
        return self.bandwidth_GBps * self.efficiency

    @property
    def link_class(self) -> str:
        """``"nvlink"`` for switched/direct accelerator links, ``"pci"`` for kind "none"."""
        return "pci" if self.kind is DomainKind.NONE else "nvlink"


@dataclass(frozen=True, slots=True)
class ScaleOutFabric:
    """The network between scale-up domains: NICs per node and how they are switched."""

    kind: FabricKind
    transport: Transport
    nics_per_node: int
    nic_GBps: float
    """Per NIC, per direction (specification)."""
    latency_us: float
    """Per collective step across the network."""
    efficiency: float = 1.0
    oversubscription: float = 1.0
    """Fat-tree / rail-optimized: bandwidth divides by this once traffic leaves a leaf."""
    nodes_per_leaf: int | None = None
    """Nodes under one leaf (fat-tree) or one rail-switch group (rail-optimized)."""
    nodes_per_group: int | None = None
    """Dragonfly: nodes per group."""
    global_taper: float = 1.0
    """Dragonfly: fraction of NIC bandwidth the global links carry between groups."""
    in_network_reduction: bool = False
    """Switches reduce in the network (InfiniBand SHARP)."""

    @property
    def achieved_GBps(self) -> float:
        """Per NIC and direction: nic_GBps x efficiency, GB/s."""
        return self.nic_GBps * self.efficiency


@dataclass(frozen=True, slots=True)
class Topology:
    """A cluster: devices in rank order, their scale-up domains and the scale-out fabric.

    Raises:
        ValueError: inconsistent contents; the message starts with ``source`` (the file or
            preset it came from) and names the offending device, domain or field.
    """

    name: str
    devices: tuple[Device, ...]
    domains: tuple[ScaleUpDomain, ...]
    fabric: ScaleOutFabric
    library: Library = Library.NCCL
    source: str = "<python>"
    accelerator: Accelerator | None = None
    """Memory and peak TFLOP/s of every device (the planner's memory and compute model)."""
    _domain_of: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = self.source if self.source == self.name else f"{self.source} ({self.name})"
        if not self.devices:
            raise ValueError(f"{where}: a topology needs at least one device")
        for position, device in enumerate(self.devices):
            if device.rank != position:
                raise ValueError(
                    f"{where}: devices must be in rank order 0..{len(self.devices) - 1}; "
                    f"position {position} holds rank {device.rank}"
                )
            if not 0 <= device.nic < max(self.fabric.nics_per_node, 1):
                raise ValueError(
                    f"{where}: device rank {device.rank}: rail (nic) index {device.nic} is out of "
                    f"range for {self.fabric.nics_per_node} NIC(s) per node"
                )
        self._check_nodes(where)
        domain_of = [-1] * len(self.devices)
        for index, domain in enumerate(self.domains):
            _check_domain(domain, f"{where}: scale-up domain #{index}")
            for rank in domain.ranks:
                if not 0 <= rank < len(self.devices):
                    raise ValueError(
                        f"{where}: scale-up domain #{index} names rank {rank}, "
                        f"which is not a device (world size {len(self.devices)})"
                    )
                if domain_of[rank] != -1:
                    raise ValueError(
                        f"{where}: device rank {rank} is in two scale-up domains "
                        f"(#{domain_of[rank]} and #{index})"
                    )
                domain_of[rank] = index
        if -1 in domain_of:
            raise ValueError(f"{where}: device rank {domain_of.index(-1)} is in no scale-up domain")
        _check_fabric(self.fabric, where)
        if len(self.domains) > 1 and self.fabric.kind is FabricKind.NONE:
            raise ValueError(
                f"{where}: {len(self.domains)} scale-up domains need a scale-out "
                "fabric between them, but fabric kind is 'none'"
            )
        object.__setattr__(self, "_domain_of", tuple(domain_of))

    def _check_nodes(self, where: str) -> None:
        seen: dict[int, set[int]] = {}
        for device in self.devices:
            local = seen.setdefault(device.node, set())
            if device.local_index in local:
                raise ValueError(
                    f"{where}: device rank {device.rank}: local index "
                    f"{device.local_index} appears twice on node {device.node}"
                )
            local.add(device.local_index)
        if sorted(seen) != list(range(len(seen))):
            raise ValueError(f"{where}: node ids must be 0..{len(seen) - 1}, got {sorted(seen)}")

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def num_nodes(self) -> int:
        return 1 + max(d.node for d in self.devices)

    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """Ranks of each node, by node id."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for device in self.devices:
            out[device.node].append(device.rank)
        return tuple(tuple(ranks) for ranks in out)

    def rails(self) -> tuple[tuple[int, ...], ...]:
        """Ranks sending through NIC i of their node, for each rail i."""
        out: list[list[int]] = [[] for _ in range(max(self.fabric.nics_per_node, 1))]
        for device in self.devices:
            out[device.nic].append(device.rank)
        return tuple(tuple(ranks) for ranks in out)

    def domain_of(self, rank: int) -> ScaleUpDomain:
        """The scale-up domain holding ``rank``."""
        return self.domains[self.domain_index(rank)]

    def domain_index(self, rank: int) -> int:
        self._check_rank(rank)
        return self._domain_of[rank]

    def first(self, n: int) -> tuple[int, ...]:
        """The group of size ``n``: this topology's first ``n`` devices in rank order.

        Raises:
            ValueError: ``n`` < 1 or larger than the topology.
        """
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"group_size must be an int, got {n!r}")
        if not 1 <= n <= self.world_size:
            raise ValueError(
                f"group_size {n} must be between 1 and the {self.world_size} "
                f"devices of topology {self.name!r}"
            )
        return tuple(range(n))

    def switch_hops(self, a: int, b: int) -> int:
        """Network switch hops between ranks ``a`` and ``b``; 0 inside one scale-up domain.

        Rail-optimized: 1 between equal rails in one rail group, else 3 (rail, spine, rail).
        Fat-tree: 1 under one leaf, else 3. Dragonfly: 1 inside a group, else 3
        (local, global, local).
        """
        if self.domain_index(a) == self.domain_index(b):
            return 0
        da, db = self.devices[a], self.devices[b]
        fabric = self.fabric
        if fabric.kind is FabricKind.DRAGONFLY:
            return 1 if self._same_block(da.node, db.node, fabric.nodes_per_group) else 3
        same_leaf = self._same_block(da.node, db.node, fabric.nodes_per_leaf)
        if fabric.kind is FabricKind.RAIL_OPTIMIZED:
            return 1 if same_leaf and da.nic == db.nic else 3
        return 1 if same_leaf else 3

    @staticmethod
    def _same_block(node_a: int, node_b: int, block: int | None) -> bool:
        return block is None or node_a // block == node_b // block

    def with_accelerator(self, accelerator: Accelerator) -> Topology:
        """This topology with every device an ``accelerator``."""
        return dataclasses.replace(self, accelerator=accelerator)

    def with_fabric(self, kind: FabricKind | str) -> Topology:
        """This topology with the scale-out fabric switched as ``kind``."""
        fabric_kind = FabricKind.parse(kind, what="fabric")
        return dataclasses.replace(self, fabric=dataclasses.replace(self.fabric, kind=fabric_kind))

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank!r} is not a device of topology {self.name!r} "
                f"(ranks 0..{self.world_size - 1})"
            )

    def to_dict(self) -> dict:
        """The ``overlapkit topo --json`` document (keys fixed by docs/json-contracts.md)."""
        fabric = self.fabric
        return {
            "name": self.name,
            "world_size": self.world_size,
            "library": str(self.library),
            "nodes": [{"node": i, "ranks": list(r)} for i, r in enumerate(self.nodes())],
            "domains": [
                {
                    "kind": str(d.kind),
                    "ranks": list(d.ranks),
                    "bandwidth_GBps": d.bandwidth_GBps,
                    "achieved_GBps": d.achieved_GBps,
                    "latency_us": d.latency_us,
                    "links": d.links,
                    "in_network_reduction": d.in_network_reduction,
                    **({"torus": list(d.torus)} if d.torus else {}),
                }
                for d in self.domains
            ],
            "fabric": {
                "kind": str(fabric.kind),
                "transport": str(fabric.transport),
                "nics_per_node": fabric.nics_per_node,
                "nic_GBps": fabric.nic_GBps,
                "achieved_GBps": fabric.achieved_GBps,
                "latency_us": fabric.latency_us,
                "oversubscription": fabric.oversubscription,
                "in_network_reduction": fabric.in_network_reduction,
                "rails": [list(r) for r in self.rails()],
            },
            "accelerator": None if self.accelerator is None else self.accelerator.to_dict(),
        }


def _check_domain(domain: ScaleUpDomain, where: str) -> None:
    if not domain.ranks:
        raise ValueError(f"{where}: has no ranks")
    _check_positive(domain.bandwidth_GBps, f"{where}: bandwidth_GBps")
    _check_efficiency(domain.efficiency, where)
    if not domain.latency_us >= 0:
        raise ValueError(f"{where}: latency_us must be >= 0, got {domain.latency_us!r}")
    if domain.links < 0:
        raise ValueError(f"{where}: links must be >= 0, got {domain.links!r}")
    if domain.torus is not None:
        if domain.kind is not DomainKind.ICI:
            raise ValueError(f"{where}: a torus shape needs kind 'ici', got {domain.kind}")
        size = 1
        for extent in domain.torus:
            size *= extent
        if size != len(domain.ranks):
            raise ValueError(
                f"{where}: torus {list(domain.torus)} holds {size} devices, but the "
                f"domain has {len(domain.ranks)}"
            )
        if domain.wraparound is not None and len(domain.wraparound) != len(domain.torus):
            raise ValueError(
                f"{where}: wraparound has {len(domain.wraparound)} entries for a "
                f"{len(domain.torus)}-D torus"
            )


def _check_fabric(fabric: ScaleOutFabric, where: str) -> None:
    where = f"{where}: scale-out fabric"
    if fabric.nics_per_node < 0:
        raise ValueError(f"{where}: nics_per_node must be >= 0, got {fabric.nics_per_node!r}")
    _check_positive(fabric.nic_GBps, f"{where}: nic_GBps")
    _check_efficiency(fabric.efficiency, where)
    if not fabric.latency_us >= 0:
        raise ValueError(f"{where}: latency_us must be >= 0, got {fabric.latency_us!r}")
    if not fabric.oversubscription >= 1:
        raise ValueError(
            f"{where}: oversubscription must be >= 1 (downlinks per uplink), "
            f"got {fabric.oversubscription!r}"
        )
    if not 0 < fabric.global_taper <= 1:
        raise ValueError(f"{where}: global_taper must be in (0, 1], got {fabric.global_taper!r}")
    for name in ("nodes_per_leaf", "nodes_per_group"):
        value = getattr(fabric, name)
        if value is not None and value < 1:
            raise ValueError(f"{where}: {name} must be >= 1, got {value!r}")


def _check_positive(value: float, what: str) -> None:
    if not value > 0:
        raise ValueError(f"{what} must be > 0, got {value!r}")


def _check_efficiency(value: float, where: str) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{where}: efficiency must be in (0, 1], got {value!r}")


def uniform_topology(
    *,
    name: str,
    nodes: int,
    devices_per_node: int,
    device_kind: DeviceKind,
    domain: ScaleUpDomain,
    nodes_per_domain: int,
    fabric: ScaleOutFabric,
    library: Library,
    source: str,
    accelerator: Accelerator | None = None,
) -> Topology:
    """A topology of ``nodes`` identical nodes; domains cover ``nodes_per_domain`` nodes each.

    ``domain`` is a template: its ``ranks`` are ignored and filled in per domain. Ranks are
    node-major (node 0's devices first); device i of a node sends through NIC
    ``i * nics_per_node // devices_per_node``.
    """
    if nodes < 1 or devices_per_node < 1:
        raise ValueError(
            f"{source}: nodes ({nodes}) and devices_per_node ({devices_per_node}) must be >= 1"
        )
    if nodes_per_domain < 1 or nodes % nodes_per_domain:
        raise ValueError(
            f"{source}: scale_up.nodes_per_domain ({nodes_per_domain}) must divide nodes ({nodes})"
        )
    nics = max(fabric.nics_per_node, 1)
    devices = tuple(
        Device(
            rank=node * devices_per_node + local,
            node=node,
            local_index=local,
            kind=device_kind,
            nic=local * nics // devices_per_node,
        )
        for node in range(nodes)
        for local in range(devices_per_node)
    )
    per_domain = nodes_per_domain * devices_per_node
    domains = tuple(
        dataclasses.replace(domain, ranks=tuple(range(start, start + per_domain)))
        for start in range(0, len(devices), per_domain)
    )
    return Topology(
        name=name,
        devices=devices,
        domains=domains,
        fabric=fabric,
        library=library,
        source=source,
        accelerator=accelerator,
    )


def bare_link(bandwidth_GBps: float, latency_us: float, world_size: int) -> Topology:
    """``world_size`` ranks that each have one link of ``bandwidth_GBps`` per direction.

    Nothing is lost to protocol (library "ideal"), so a ring all-reduce of S bytes takes
    ``2(n-1) * latency + 2(n-1)/n * S / bandwidth`` — the worked example of docs/cost-model.md.
    """
    domain = ScaleUpDomain(
        kind=DomainKind.NONE,
        ranks=tuple(range(world_size)),
        bandwidth_GBps=bandwidth_GBps,
        latency_us=latency_us,
        links=1,
    )
    fabric = ScaleOutFabric(
        kind=FabricKind.NONE,
        transport=Transport.ETHERNET,
        nics_per_node=1,
        nic_GBps=bandwidth_GBps,
        latency_us=latency_us,
    )
    name = f"link({bandwidth_GBps:g} GB/s, {latency_us:g} us)"
    return uniform_topology(
        name=name,
        nodes=1,
        devices_per_node=world_size,
        device_kind=DeviceKind.ACCELERATOR,
        domain=domain,
        nodes_per_domain=1,
        fabric=fabric,
        library=Library.IDEAL,
        source=name,
    )


def group_ranks(topology: Topology, ranks: Sequence[int]) -> tuple[int, ...]:
    """Validate an explicit group: distinct ranks of ``topology``; returns them as a tuple."""
    group = tuple(ranks)
    if not group:
        raise ValueError("group must name at least one rank")
    for rank in group:
        topology._check_rank(rank)
    if len(set(group)) != len(group):
        raise ValueError(f"group {list(group)} names a rank twice")
    return group
