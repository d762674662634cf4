"""Check 2, NIC-GPU affinity: each GPU's nearest NIC (NCCL's PCI path types), from sysfs.

``affinity_facts`` reads what one rank needs (PCI paths and NUMA nodes of its GPU and NICs);
``check_nic_affinity`` classifies the facts of every rank and is pure, so it is tested on
recorded PCIe trees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from overlapkit.doctor.check import PASS, WARN, Check, worst

# NCCL's path types, nearest first (``nvidia-smi topo -m``): one PCIe switch, several switches,
# the same host bridge, the same NUMA node across host bridges, across the CPU interconnect.
PATH_TYPES = ("PIX", "PXB", "PHB", "NODE", "SYS")


def pci_path_type(a: str, b: str, numa_a: int | None = None, numa_b: int | None = None) -> str:
    """NCCL's path type between two devices from their sysfs paths and NUMA nodes.

    The paths are ``/sys/devices/pciDDDD:BB/<bridge>/.../<device>``: devices under one root port
    share at least two components (PIX when each is at most one bridge below the fork, PXB
    otherwise), under one root complex one (PHB); otherwise NODE on one NUMA node and SYS across
    NUMA nodes (unknown NUMA nodes count as one).
    """
    pa = Path(a).parts[3:]
    pb = Path(b).parts[3:]
    common = 0
    for x, y in zip(pa, pb, strict=False):
        if x != y:
            break
        common += 1
    if common >= 2:
        return "PIX" if len(pa) - common <= 2 and len(pb) - common <= 2 else "PXB"
    if common == 1:
        return "PHB"
    if numa_a is not None and numa_b is not None and numa_a >= 0 and numa_b >= 0:
        return "NODE" if numa_a == numa_b else "SYS"
    return "NODE"


def numa_node(pci_path: str | None) -> int | None:
    """The NUMA node sysfs gives a PCI device, or None (no path, no NUMA info: -1)."""
    if not pci_path:
        return None
    try:
        value = int((Path(pci_path) / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


def affinity_facts(view: Mapping[str, Any], rail: int) -> dict[str, Any]:
    """What check 2 needs of one rank: its GPU's and NICs' PCI paths and NUMA nodes (sysfs).

    Args:
        view (Mapping): the rank's ``topology.local_view()``.
        rail (int): the NIC index the topology assigned the rank (``Device.nic``).
    """
    gpu = view.get("gpu") or {}
    path = gpu.get("pci_path")
    return {
        "rank": view["rank"],
        "hostname": view.get("hostname"),
        "gpu_pci_path": path,
        "gpu_numa": numa_node(path),
        "rail": rail,
        "nics": [
            {"name": n["name"], "pci_path": n.get("pci_path"), "numa": numa_node(n.get("pci_path"))}
            for n in view.get("nics", [])
        ],
    }


def check_nic_affinity(facts: Sequence[Mapping[str, Any]], *, nodes: int) -> Check:
    """Check 2: each GPU's nearest NIC is the one it uses, and none is across sockets.

    Args:
        facts (Sequence[Mapping]): ``affinity_facts`` of every rank.
        nodes (int): nodes in the job (with one, NICs carry no collective traffic).
    """
    gpu_ranks = [f for f in facts if f.get("gpu_pci_path")]
    if not gpu_ranks:
        return Check(
            "nic_affinity",
            PASS,
            "not applicable: no rank has a GPU with a visible PCI path",
            "nothing to do on CPU ranks; on GPUs this compares each GPU's PCI path with the NICs'",
        )
    findings: list[tuple[str, str]] = []
    rows = []
    for f in gpu_ranks:
        nics = [n for n in f["nics"] if n.get("pci_path")]
        if not nics:
            status = PASS if nodes == 1 else WARN
            findings.append(
                (status, f"rank {f['rank']}: no NIC with a PCI path is visible (container?)")
            )
            continue
        types = [
            pci_path_type(f["gpu_pci_path"], n["pci_path"], f.get("gpu_numa"), n.get("numa"))
            for n in nics
        ]
        best = min(PATH_TYPES.index(t) for t in types)
        nearest = [
            n["name"] for n, t in zip(nics, types, strict=True) if PATH_TYPES.index(t) == best
        ]
        used = nics[f["rail"]]["name"] if f["rail"] < len(nics) else None
        used_type = types[f["rail"]] if f["rail"] < len(nics) else None
        rows.append({"rank": f["rank"], "nic": used, "path": used_type, "nearest": nearest})
        if PATH_TYPES[best] == "SYS":
            findings.append(
                (
                    WARN,
                    f"rank {f['rank']}: every NIC is across the CPU interconnect (SYS) from "
                    "its GPU; GPUDirect RDMA is off at that distance by default",
                )
            )
        elif used is not None and used not in nearest:
            findings.append(
                (
                    WARN,
                    f"rank {f['rank']} sends through {used} ({used_type}) but "
                    f"{', '.join(nearest)} is nearer ({PATH_TYPES[best]})",
                )
            )
    value = ", ".join(f"rank {r['rank']} -> {r['nic']} ({r['path']})" for r in rows) or (
        "no NIC visible"
    )
    if nodes == 1:
        value += "; single node: collectives do not use the NICs"
    status = worst(s for s, _ in findings) if nodes > 1 else PASS
    advice = "; ".join(t for _, t in findings) or "each GPU uses its nearest NIC"
    if status == WARN:
        advice += (
            ". Pin each rank's NIC (NCCL_IB_HCA / the launcher's NIC binding) to the GPU's "
            "nearest one, or fix the topology file's rails"
        )
    return Check("nic_affinity", status, value, advice, {"ranks": rows})
