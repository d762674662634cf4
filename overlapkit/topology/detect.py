"""Detect the topology a job runs on: every rank describes itself, rank views are merged.

``local_view()`` describes this process: node identity from torchrun's environment
(``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) and the hostname; on an NVIDIA GPU, its
NVLinks (state, remote device type and PCI address, version), NVLink peer-to-peer status, PCIe
link, and the GPU fabric info that NVL72-style racks report (same cluster UUID and clique id =
same NVLink domain, even across trays); the node's RDMA NICs (or Ethernet ports) and their PCI
paths, for NIC-to-GPU affinity. NVML is asked in a subprocess (``nvml_probe``), where a crash in
the driver cannot end the caller. ``merge_views(views)`` turns the views of all ranks into one
``Topology``; it is a pure function, tested on recorded views. ``detect_topology()`` is the
collective that all-gathers the views and merges them.

Domains: GPUs with completed fabric info and the same (cluster UUID, clique id) form one NVLink
domain; otherwise the GPUs of a node that share an NVSwitch or NVLink peers form one; a node
whose GPUs are not all NVLink-connected is one PCIe ("none") domain, as a ring over it is
limited by PCIe. CPU workers of a node form one "none" domain with the ``cpu-gloo`` preset's
figures.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from overlapkit.topology import nvml_probe
from overlapkit.topology.loading import load_topology
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
)

logger = logging.getLogger(__name__)

# Per-link NVLink rate per direction (GB/s) and NCCL's achieved per-link figure, by compute
# capability major. Spec: NVLink 2/3/4 carry 50 GB/s per link bidirectional (V100, A100, H100
# datasheets), NVLink 5 100 GB/s (Blackwell). Achieved: NCCL src/graph/topo.h SM70/SM80 20.0,
# SM90 20.6, SM100 40.1 GB/s.
_NVLINK_GBPS = {7: (25.0, 20.0), 8: (25.0, 20.0), 9: (25.0, 20.6), 10: (50.0, 40.1)}
# PCIe per lane and direction (GB/s) by generation: 8/16/32/64 GT/s with 128b/130b encoding.
_PCIE_LANE_GBPS = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.877}
# NCCL src/graph/topo.h PCI_BW: 12 GB/s achieved on a Gen3 x16 link (15.75 GB/s specified).
_PCIE_EFFICIENCY = 12.0 / 15.75
# NCCL src/graph/tuning.cc hwLat, Ring/Simple step latency (us).
_STEP_LATENCY_US = {"nvlink": 3.4, "pci": 5.7, "net": 14.0}
# Seconds the NVML probe may take: nvmlInit alone can take seconds on a node without
# persistence mode; a probe past this is taken as hung and killed.
NVML_PROBE_TIMEOUT_S = 30.0
_NVML_PROBE = Path(nvml_probe.__file__)
# What a GPU view holds when NVML could not describe the device.
_NO_NVML_FACTS: dict[str, Any] = {
    "pci_bus_id": None,
    "pci_path": None,
    "nvlinks": [],
    "p2p_nvlink_peers": [],
    "pcie": {"generation": None, "width": None},
    "fabric": None,
}


def local_view(*, rank: int | None = None, cuda_index: int | None = None) -> dict[str, Any]:
    """This process's description of itself (JSON-serialisable; see module doc).

    Args:
        rank (int): the rank to record. Defaults to the process group rank, or RANK, or 0.
        cuda_index (int): the CUDA device this rank uses. Defaults to the current device
            when CUDA is available; None on CPU.
    """
    if rank is None:
        rank = (
            dist.get_rank()
            if dist.is_available() and dist.is_initialized()
            else int(os.environ.get("RANK", 0))
        )
    if cuda_index is None and torch.cuda.is_available():
        cuda_index = torch.cuda.current_device()
    gpu = _gpu_view(cuda_index) if cuda_index is not None else None
    return {
        "rank": rank,
        "hostname": socket.gethostname(),
        "group_rank": _env_int("GROUP_RANK"),
        "local_rank": _env_int("LOCAL_RANK"),
        "local_world_size": _env_int("LOCAL_WORLD_SIZE"),
        "gpu": gpu,
        "nics": _nics(),
    }


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value is not None and value.strip().lstrip("-").isdigit() else None


def _gpu_view(cuda_index: int, *, timeout_s: float = NVML_PROBE_TIMEOUT_S) -> dict[str, Any]:
    """One CUDA device: its name and capability from torch, the rest from NVML.

    NVML is queried by ``nvml_probe`` in a subprocess (see its module doc), so a segmentation
    fault or a hang in the driver costs this process the NVML facts, never its life. Without
    them (``"nvml": False``) the device is still a GPU, with no known NVLinks: a PCIe domain.

    Args:
        cuda_index (int): the CUDA device.
        timeout_s (float): seconds the probe may take before it is killed.
    """
    props = torch.cuda.get_device_properties(cuda_index)
    facts = _run_nvml_probe(f"GPU-{props.uuid}", timeout_s=timeout_s)
    return {
        "name": props.name,
        "compute_capability": [props.major, props.minor],
        "nvml": facts is not None,
        **(facts or _NO_NVML_FACTS),
    }


def _run_nvml_probe(uuid: str, *, timeout_s: float) -> dict[str, Any] | None:
    """Run ``nvml_probe.py`` for the GPU ``uuid`` with this interpreter; its JSON or None."""
    try:
        done = subprocess.run(
            [sys.executable, str(_NVML_PROBE), uuid],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        logger.warning(
            "NVML probe of %s did not answer within %.0f s and was killed; "
            "GPU links are not detected",
            uuid,
            timeout_s,
        )
        return None
    except OSError as err:
        logger.warning(
            "NVML probe of %s could not start (%s); GPU links are not detected", uuid, err
        )
        return None
    reason = done.stderr.strip().splitlines()[-1:] or ["no message"]
    if done.returncode == nvml_probe.EXIT_NVML_UNAVAILABLE:
        logger.info("%s; GPU links are not detected", reason[0])
        return None
    if done.returncode < 0:
        logger.warning(
            "NVML probe of %s died of %s (%s); GPU links are not detected",
            uuid,
            signal.Signals(-done.returncode).name,
            reason[0],
        )
        return None
    try:
        facts = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        facts = None
    if not isinstance(facts, dict):
        logger.warning(
            "NVML probe of %s failed (exit status %s: %s); GPU links are not detected",
            uuid,
            done.returncode,
            reason[0],
        )
        return None
    return facts


def _nics() -> list[dict[str, Any]]:
    """RDMA NICs (InfiniBand / RoCE) of this host; Ethernet ports when there are none."""
    nics = []
    for port_dir in sorted(Path("/sys/class/infiniband").glob("*/ports/*")):
        state = _read(port_dir / "state")
        rate = _read(port_dir / "rate")  # e.g. "400 Gb/sec (4X NDR)"
        if not state or "ACTIVE" not in state or not rate:
            continue
        layer = _read(port_dir / "link_layer") or "InfiniBand"
        device = port_dir.parent.parent
        nics.append(
            {
                "name": f"{device.name}/{port_dir.name}",
                "transport": "infiniband" if layer == "InfiniBand" else "roce",
                "GBps": float(rate.split()[0]) / 8,
                "pci_path": str((device / "device").resolve())
                if (device / "device").exists()
                else None,
            }
        )
    if nics:
        return nics
    for iface in sorted(Path("/sys/class/net").glob("*")):
        speed = _read(iface / "speed")
        if not (iface / "device").exists() or not speed or not speed.lstrip("-").isdigit():
            continue  # loopback and virtual interfaces have no device
        if int(speed) > 0:
            nics.append(
                {
                    "name": iface.name,
                    "transport": "ethernet",
                    "GBps": int(speed) / 8000,
                    "pci_path": str((iface / "device").resolve()),
                }
            )
    return nics


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def merge_views(
    views: Sequence[Mapping[str, Any]], *, fabric: str | None = None, name: str = "detected"
) -> Topology:
    """Merge every rank's ``local_view()`` into one ``Topology`` (pure; see module doc).

    Args:
        views (Sequence[Mapping]): one view per rank, any order, ranks 0..n-1.
        fabric (str): scale-out fabric kind for multi-node jobs (``fat-tree``,
            ``rail-optimized``, ``dragonfly``); switches are not visible from a host.
            Defaults to fat-tree.
        name (str): the topology's name.

    Raises:
        ValueError: missing or duplicated ranks, or two ranks claiming one local index.
    """
    views = sorted(views, key=lambda v: v["rank"])
    ranks = [v["rank"] for v in views]
    if ranks != list(range(len(views))):
        raise ValueError(f"rank views must cover ranks 0..{len(views) - 1} once each, got {ranks}")
    nodes = _node_ids(views)
    local = _local_indices(views, nodes)
    node_count = 1 + max(nodes)
    nics_by_node = [
        next(v["nics"] for v, n in zip(views, nodes, strict=True) if n == node)
        for node in range(node_count)
    ]
    nics_per_node = min(len(nics) for nics in nics_by_node)
    devices = tuple(
        Device(
            rank=r,
            node=nodes[r],
            local_index=local[r],
            kind=DeviceKind.GPU if v["gpu"] else DeviceKind.CPU,
            nic=_nearest_nic(
                v,
                nics_by_node[nodes[r]],
                local[r],
                nics_per_node,
                sum(1 for n in nodes if n == nodes[r]),
            ),
        )
        for r, v in enumerate(views)
    )
    domains = _domains(views, nodes)
    kind = (
        FabricKind.parse(fabric, what="fabric")
        if fabric
        else (FabricKind.FAT_TREE if len(domains) > 1 else FabricKind.NONE)
    )
    gpu = any(v["gpu"] for v in views)
    return Topology(
        name=name,
        devices=devices,
        domains=tuple(domains),
        fabric=_fabric(kind, nics_by_node, nics_per_node),
        library=Library.NCCL if gpu else Library.GLOO,
        source="detected",
    )


def _node_ids(views: Sequence[Mapping[str, Any]]) -> list[int]:
    # torchrun's GROUP_RANK names the node when every rank has it; hostnames otherwise.
    if all(v.get("group_rank") is not None for v in views):
        keys = [("group", v["group_rank"]) for v in views]
    else:
        keys = [("host", v["hostname"]) for v in views]
    order: dict[tuple, int] = {}
    return [order.setdefault(key, len(order)) for key in keys]


def _local_indices(views: Sequence[Mapping[str, Any]], nodes: list[int]) -> list[int]:
    counters: dict[int, int] = {}
    out = []
    for view, node in zip(views, nodes, strict=True):
        position = counters.get(node, 0)
        counters[node] = position + 1
        local = view.get("local_rank")
        out.append(position if local is None else local)
    for node in set(nodes):
        indices = [i for i, n in zip(out, nodes, strict=True) if n == node]
        if len(set(indices)) != len(indices):
            raise ValueError(
                f"node {node}: two ranks report the same LOCAL_RANK ({indices}); "
                "are GROUP_RANK/hostnames telling nodes apart?"
            )
    return out


def _nearest_nic(
    view: Mapping[str, Any], nics: list[dict], local: int, nics_per_node: int, devices_on_node: int
) -> int:
    """Rail of a device: the NIC sharing the longest PCI path with its GPU, else by position."""
    gpu_path = (view.get("gpu") or {}).get("pci_path")
    if gpu_path and nics_per_node:
        depth = [_common_depth(gpu_path, nic.get("pci_path")) for nic in nics[:nics_per_node]]
        best = max(depth)
        if best > 1 and depth.count(best) == 1:  # deeper than the root complex, and unique
            return depth.index(best)
    return local * max(nics_per_node, 1) // max(devices_on_node, 1)


def _common_depth(a: str | None, b: str | None) -> int:
    if not a or not b:
        return 0
    depth = 0
    for x, y in zip(Path(a).parts, Path(b).parts, strict=False):
        if x != y:
            break
        depth += 1
    return depth - 3  # /sys/devices/pciDDDD:BB is shared by everything on a root complex


def _domains(views: Sequence[Mapping[str, Any]], nodes: list[int]) -> list[ScaleUpDomain]:
    assigned: dict[tuple, list[int]] = {}
    for rank, view in enumerate(views):
        fabric = (view.get("gpu") or {}).get("fabric") or {}
        if fabric.get("state") == "completed" and int(fabric.get("cluster_uuid", "0") or "0", 16):
            assigned.setdefault(("fabric", fabric["cluster_uuid"], fabric["clique_id"]), []).append(
                rank
            )
        else:
            assigned.setdefault(("node", nodes[rank]), []).append(rank)
    domains = []
    for key, ranks in assigned.items():
        members = [views[r] for r in ranks]
        gpus = [v["gpu"] for v in members if v["gpu"]]
        if key[0] == "fabric" or (len(gpus) == len(members) and _nvlink_connected(members)):
            domains.append(_nvlink_domain(ranks, gpus))
        elif gpus:
            domains.append(_pcie_domain(ranks, gpus))
        else:
            domains.append(_cpu_domain(ranks))
    return sorted(domains, key=lambda d: d.ranks[0])


def _nvlink_connected(members: list[Mapping[str, Any]]) -> bool:
    """All GPUs reach each other over NVLink: through one switch fabric or as NVLink peers."""
    gpus = [v["gpu"] for v in members]
    if not all(g["nvlinks"] for g in gpus):
        return False
    if len(gpus) == 1 or all(
        any(link["remote_type"] == "switch" for link in g["nvlinks"]) for g in gpus
    ):
        return True
    buses = {g["pci_bus_id"] for g in gpus}
    parent = {b: b for b in buses}

    def root(b: str) -> str:
        while parent[b] != b:
            b = parent[b]
        return b

    for g in gpus:
        peers = set(g.get("p2p_nvlink_peers", [])) | {
            link["remote_pci_bus_id"] for link in g["nvlinks"] if link["remote_type"] == "gpu"
        }
        for peer in peers & buses:
            parent[root(peer)] = root(g["pci_bus_id"])
    return len({root(b) for b in buses}) == 1


def _nvlink_domain(ranks: list[int], gpus: list[Mapping[str, Any]]) -> ScaleUpDomain:
    major = min(g["compute_capability"][0] for g in gpus)
    spec, achieved = _NVLINK_GBPS.get(
        major, _NVLINK_GBPS[min(_NVLINK_GBPS, key=lambda k: abs(k - major))]
    )
    links = min(len(g["nvlinks"]) for g in gpus)
    switched = all(any(link["remote_type"] == "switch" for link in g["nvlinks"]) for g in gpus)
    return ScaleUpDomain(
        kind=DomainKind.NVLINK,
        ranks=tuple(ranks),
        bandwidth_GBps=links * spec,
        latency_us=_STEP_LATENCY_US["nvlink"],
        links=links,
        # NVLS needs a 3rd-generation (Hopper) NVSwitch or newer.
        in_network_reduction=switched and major >= 9,
        efficiency=achieved / spec,
    )


def _pcie_domain(ranks: list[int], gpus: list[Mapping[str, Any]]) -> ScaleUpDomain:
    lanes = [(g["pcie"].get("generation"), g["pcie"].get("width")) for g in gpus]
    known = [_PCIE_LANE_GBPS.get(gen, 0) * width for gen, width in lanes if gen and width]
    bandwidth = min(known) if known and min(known) > 0 else _PCIE_LANE_GBPS[3] * 16
    return ScaleUpDomain(
        kind=DomainKind.NONE,
        ranks=tuple(ranks),
        bandwidth_GBps=bandwidth,
        latency_us=_STEP_LATENCY_US["pci"],
        links=0,
        efficiency=_PCIE_EFFICIENCY,
    )


def _cpu_preset() -> Topology:
    return load_topology("cpu-gloo")


def _cpu_domain(ranks: list[int]) -> ScaleUpDomain:
    template = _cpu_preset().domains[0]
    return ScaleUpDomain(
        kind=DomainKind.NONE,
        ranks=tuple(ranks),
        bandwidth_GBps=template.bandwidth_GBps,
        latency_us=template.latency_us,
        links=0,
        efficiency=template.efficiency,
    )


def _fabric(kind: FabricKind, nics_by_node: list[list[dict]], nics_per_node: int) -> ScaleOutFabric:
    nics = [nic for node in nics_by_node for nic in node[:nics_per_node]]
    if not nics:
        # Nothing visible (containers often hide NICs): the CPU preset's nominal Ethernet port.
        template = _cpu_preset().fabric
        return ScaleOutFabric(
            kind=kind,
            transport=template.transport,
            nics_per_node=1,
            nic_GBps=template.nic_GBps,
            latency_us=template.latency_us,
        )
    transports = {nic["transport"] for nic in nics}
    transport = Transport(transports.pop()) if len(transports) == 1 else Transport.ETHERNET
    return ScaleOutFabric(
        kind=kind,
        transport=transport,
        nics_per_node=nics_per_node,
        nic_GBps=min(nic["GBps"] for nic in nics),
        latency_us=_STEP_LATENCY_US["net"],
    )


def detect_topology(
    process_group: dist.ProcessGroup | None = None, *, fabric: str | None = None
) -> Topology:
    """Detect the topology of this job; a collective that every rank of the group calls.

    Each rank's ``local_view()`` is all-gathered over ``process_group`` (the group's timeout
    applies) and merged, so every rank returns the same ``Topology``. Without an initialised
    process group it describes this host alone: one rank per visible GPU, or
    ``LOCAL_WORLD_SIZE`` (default 1) CPU workers.

    Args:
        process_group (ProcessGroup): the group to detect. Defaults to the default group.
            With NCCL, set the CUDA device first (``torch.cuda.set_device``).
        fabric (str): scale-out fabric kind (not visible from hosts). Defaults to fat-tree.

    Returns:
        Topology: devices in group-rank order, their domains and fabric.
    """
    if dist.is_available() and dist.is_initialized():
        group = process_group or dist.group.WORLD
        views: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(views, local_view(rank=dist.get_rank(group)), group=group)
        return merge_views(views, fabric=fabric)
    if torch.cuda.is_available():
        views = [local_view(rank=i, cuda_index=i) for i in range(torch.cuda.device_count())]
    else:
        views = [local_view(rank=i) for i in range(_env_int("LOCAL_WORLD_SIZE") or 1)]
    for view in views:
        view.update(group_rank=None, local_rank=view["rank"])
    return merge_views(views, fabric=fabric)
