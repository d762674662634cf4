"""NVML's facts about one GPU, queried in a process of its own.

``python overlapkit/topology/nvml_probe.py GPU-<uuid>`` prints one JSON object: the GPU's PCI
bus id and sysfs path, its NVLinks, NVLink peer-to-peer peers, PCIe link and GPU fabric info
(see ``detect`` for how they are used). ``detect._gpu_view`` runs it as a subprocess because
NVML is a C library reached through ctypes without declared argument types: a wrong call or a
driver bug there is a segmentation fault, and in the training process that would end the run
(issue 18: the fabric-info struct was passed by value and NVML wrote through a stray pointer).
A crash here costs the caller only the NVML facts.

The file imports nothing but the standard library and ``pynvml`` so that it starts in a fraction
of a second (no torch) and runs by path without importing the ``overlapkit`` package.

Exit status: 0 with the JSON on stdout; ``EXIT_NVML_UNAVAILABLE`` when NVML cannot be
initialised here (no driver, no library); 1 with the reason on stderr when NVML failed to
describe the GPU.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path
from typing import Any

EXIT_NVML_UNAVAILABLE = 3


def describe_gpu(nvml: Any, handle: Any) -> dict[str, Any]:
    """The NVML facts of the GPU behind ``handle`` (JSON-serialisable).

    Args:
        nvml (module): ``pynvml``, initialised, or a stand-in with its interface.
        handle: the device handle, valid until ``nvmlShutdown``.
    """

    def attempt(call, *args, default=None):
        try:
            return call(handle, *args)
        except nvml.NVMLError:
            return default

    bus_id = decode(nvml.nvmlDeviceGetPciInfo(handle).busId)
    links = []
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        if attempt(nvml.nvmlDeviceGetNvLinkState, link) != nvml.NVML_FEATURE_ENABLED:
            continue
        remote = attempt(nvml.nvmlDeviceGetNvLinkRemotePciInfo, link)
        kind = attempt(nvml.nvmlDeviceGetNvLinkRemoteDeviceType, link)
        links.append(
            {
                "link": link,
                "remote_type": {
                    nvml.NVML_NVLINK_DEVICE_TYPE_GPU: "gpu",
                    nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH: "switch",
                }.get(kind, "unknown"),
                "remote_pci_bus_id": decode(remote.busId) if remote is not None else None,
            }
        )
    peers = []
    for index in range(nvml.nvmlDeviceGetCount()):
        other = nvml.nvmlDeviceGetHandleByIndex(index)
        other_bus = decode(nvml.nvmlDeviceGetPciInfo(other).busId)
        if other_bus == bus_id:
            continue
        try:
            status = nvml.nvmlDeviceGetP2PStatus(handle, other, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
        except nvml.NVMLError:
            continue
        if status == nvml.NVML_P2P_STATUS_OK:
            peers.append(other_bus)
    return {
        "pci_bus_id": bus_id,
        "pci_path": pci_path(bus_id),
        "nvlinks": links,
        "p2p_nvlink_peers": peers,
        "pcie": {
            "generation": attempt(nvml.nvmlDeviceGetMaxPcieLinkGeneration),
            "width": attempt(nvml.nvmlDeviceGetMaxPcieLinkWidth),
        },
        "fabric": fabric_info(nvml, handle),
    }


def fabric_info(nvml: Any, handle: Any) -> dict[str, Any] | None:
    """Cluster UUID and clique id of the NVLink fabric (NVL72-style racks), if reported.

    The versioned call (``nvmlDeviceGetGpuFabricInfoV``, driver R550+) is asked first; the
    unversioned one, which NVML deprecates, only where the driver lacks it. Either way the
    struct goes by pointer: pynvml hands this argument to the C function as it is, and ctypes
    passes a bare Structure by value, so NVML would write through whatever the argument
    register held.
    """
    try:
        try:
            info = nvml.c_nvmlGpuFabricInfoV_t()  # its constructor sets .version (v2)
            nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        except (AttributeError, nvml.NVMLError) as err:
            if isinstance(err, nvml.NVMLError) and err.value != nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
            info = nvml.c_nvmlGpuFabricInfo_t()
            nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
    except (nvml.NVMLError, AttributeError):
        return None
    states = {
        nvml.NVML_GPU_FABRIC_STATE_COMPLETED: "completed",
        nvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS: "in_progress",
        nvml.NVML_GPU_FABRIC_STATE_NOT_STARTED: "not_started",
    }
    state = states.get(info.state, "not_supported")
    # NVML: ``status`` "must be checked only if state returns complete".
    if state == "completed" and info.status != nvml.NVML_SUCCESS:
        state = "failed"
    return {
        "cluster_uuid": bytes(info.clusterUuid).hex(),
        "clique_id": int(info.cliqueId),
        "state": state,
    }


def decode(value: Any) -> str:
    """An NVML string (bytes or str), lower-cased."""
    return (value.decode() if isinstance(value, bytes) else str(value)).lower()


def pci_path(bus_id: str | None) -> str | None:
    """The sysfs PCI path of a device (its chain of bridges), for NIC affinity."""
    if not bus_id:
        return None
    # NVML pads the domain to 8 hex digits; sysfs uses 4.
    domain, _, rest = bus_id.partition(":")
    path = Path("/sys/bus/pci/devices") / f"{domain[-4:]}:{rest}"
    return str(path.resolve()) if path.exists() else None


def main(argv: list[str]) -> int:
    """Describe the GPU whose NVML UUID (``GPU-...``) is ``argv[0]``; see the module doc."""
    if len(argv) != 1:
        print("usage: nvml_probe.py GPU-<uuid>", file=sys.stderr)
        return 2
    try:
        import pynvml as nvml

        nvml.nvmlInit()
    except Exception as err:  # no driver, no library: the caller falls back to PCIe/CPU
        print(f"NVML unavailable: {err}", file=sys.stderr)
        return EXIT_NVML_UNAVAILABLE
    try:
        # Handles live until nvmlShutdown, so everything is read before it.
        view = describe_gpu(nvml, nvml.nvmlDeviceGetHandleByUUID(argv[0]))
    except Exception as err:
        print(f"NVML could not describe {argv[0]}: {err!r}", file=sys.stderr)
        return 1
    finally:
        nvml.nvmlShutdown()
    json.dump(view, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
