"""Detection: merging recorded per-rank views, and a real 2-rank gloo detection.

The GPU views are written the way ``local_view()`` records them; NVL72 fabric info is simulated
(no such rack here). The 2-node CPU split was recorded on this machine from two real torchrun
launchers (``--nnodes 2 --nproc-per-node 2``, node ranks 0 and 1).
"""

import copy
import types

import pytest
import torch

from overlapkit.topology import DomainKind, FabricKind, load_topology, merge_views
from overlapkit.topology.detect import detect_topology
from overlapkit.topology.nvml_probe import describe_gpu
from tests.multiproc import run_on_ranks
from tests.nvml_standin import pynvml as standin

# Recorded: four ranks of two torchrun "nodes" on one host.
TORCHRUN_2_NODES = [
    {
        "rank": 0,
        "hostname": "vm",
        "group_rank": 0,
        "local_rank": 0,
        "local_world_size": 2,
        "gpu": None,
        "nics": [],
    },
    {
        "rank": 1,
        "hostname": "vm",
        "group_rank": 0,
        "local_rank": 1,
        "local_world_size": 2,
        "gpu": None,
        "nics": [],
    },
    {
        "rank": 2,
        "hostname": "vm",
        "group_rank": 1,
        "local_rank": 0,
        "local_world_size": 2,
        "gpu": None,
        "nics": [],
    },
    {
        "rank": 3,
        "hostname": "vm",
        "group_rank": 1,
        "local_rank": 1,
        "local_world_size": 2,
        "gpu": None,
        "nics": [],
    },
]


def _gpu_view(
    rank,
    host,
    local,
    *,
    capability=(9, 0),
    links=18,
    remote="switch",
    fabric=None,
    nics=8,
    nic_order=None,
    peers=(),
):
    """A GPU rank's view; GPU ``local`` sits on PCIe switch ``local`` with NIC ``local``."""
    order = nic_order or list(range(nics))
    return {
        "rank": rank,
        "hostname": host,
        "group_rank": None,
        "local_rank": local,
        "local_world_size": None,
        "gpu": {
            "name": "GPU",
            "compute_capability": list(capability),
            "pci_bus_id": f"00000000:{local + 16:02x}:00.0",
            "pci_path": f"/sys/devices/pci0000:{local:02x}/0000:{local:02x}:01.0/sw/gpu",
            "nvlinks": [
                {
                    "link": i,
                    "remote_type": remote,
                    "remote_pci_bus_id": peers[i % len(peers)] if peers else None,
                }
                for i in range(links)
            ],
            "p2p_nvlink_peers": [],
            "pcie": {"generation": 5, "width": 16},
            "fabric": fabric,
        },
        "nics": [
            {
                "name": f"mlx5_{i}",
                "transport": "infiniband",
                "GBps": 50.0,
                "pci_path": f"/sys/devices/pci0000:{i:02x}/0000:{i:02x}:01.0/sw/nic",
            }
            for i in order
        ],
    }


def _nvl72_views(racks=1):
    views = []
    for rack in range(racks):
        fabric = {"cluster_uuid": f"{rack + 1:032x}", "clique_id": 7, "state": "completed"}
        for tray in range(18):
            for local in range(4):
                rank = len(views)
                view = _gpu_view(
                    rank,
                    f"rack{rack}-tray{tray}",
                    local,
                    capability=(10, 0),
                    fabric=fabric,
                    nics=4,
                    nic_order=[3, 2, 1, 0],
                )
                view["group_rank"] = rack * 18 + tray
                views.append(view)
    return views


def test_torchrun_split_gives_two_nodes_of_cpu_workers_with_preset_figures():
    topo = merge_views(TORCHRUN_2_NODES)
    cpu = load_topology("cpu-gloo").domains[0]
    assert topo.nodes() == ((0, 1), (2, 3))
    assert [d.ranks for d in topo.domains] == [(0, 1), (2, 3)]
    assert all(d.kind is DomainKind.NONE for d in topo.domains)
    assert topo.domains[0].bandwidth_GBps == cpu.bandwidth_GBps
    assert str(topo.library) == "gloo"
    assert topo.fabric.kind is FabricKind.FAT_TREE  # two domains need a fabric


def test_without_group_rank_nodes_come_from_hostnames():
    views = copy.deepcopy(TORCHRUN_2_NODES)
    for view in views:
        view["group_rank"] = None
    views[2]["hostname"] = views[3]["hostname"] = "other"
    assert merge_views(views).nodes() == ((0, 1), (2, 3))
    for view in views:
        view["hostname"] = "vm"
        view["local_rank"] = None
    assert merge_views(views).nodes() == ((0, 1, 2, 3),)


def test_simulated_nvl72_fabric_info_makes_one_domain_across_18_trays():
    topo = merge_views(_nvl72_views(), fabric="rail-optimized")
    assert topo.world_size == 72 and topo.num_nodes == 18
    assert len(topo.domains) == 1
    domain = topo.domains[0]
    assert domain.kind is DomainKind.NVLINK and domain.links == 18
    assert domain.bandwidth_GBps == pytest.approx(900)
    assert domain.achieved_GBps == pytest.approx(18 * 40.1)
    assert domain.in_network_reduction
    assert topo.fabric.nics_per_node == 4 and topo.fabric.nic_GBps == 50
    # NICs are listed in reverse PCI order: affinity, not position, decides the rail.
    assert [topo.devices[r].nic for r in range(4)] == [3, 2, 1, 0]


def test_two_nvl72_racks_are_two_domains_joined_by_the_fabric():
    topo = merge_views(_nvl72_views(racks=2))
    assert [len(d.ranks) for d in topo.domains] == [72, 72]
    assert topo.fabric.kind is FabricKind.FAT_TREE
    assert topo.switch_hops(0, 71) == 0 and topo.switch_hops(0, 72) > 0


def test_fabric_info_not_completed_falls_back_to_the_node():
    views = _nvl72_views()
    for view in views:
        view["gpu"]["fabric"]["state"] = "in_progress"
    assert [len(d.ranks) for d in merge_views(views).domains] == [4] * 18


def test_dgx_h100_nodes_are_nvswitch_domains_with_nvls():
    views = [_gpu_view(r, f"dgx{r // 8}", r % 8) for r in range(16)]
    topo = merge_views(views, fabric="rail-optimized")
    assert [d.ranks for d in topo.domains] == [tuple(range(8)), tuple(range(8, 16))]
    domain = topo.domains[0]
    assert domain.bandwidth_GBps == pytest.approx(450) and domain.in_network_reduction
    assert domain.achieved_GBps == pytest.approx(18 * 20.6)
    assert topo.fabric.kind is FabricKind.RAIL_OPTIMIZED
    assert [topo.devices[r].nic for r in range(8, 16)] == list(range(8))


def test_a100_nvswitch_has_no_in_network_reduction():
    views = [_gpu_view(r, "dgx", r, capability=(8, 0), links=12) for r in range(8)]
    domain = merge_views(views).domains[0]
    assert domain.bandwidth_GBps == pytest.approx(300)
    assert not domain.in_network_reduction


def test_gpus_without_nvlink_form_a_pcie_domain():
    views = [_gpu_view(r, "box", r, links=0) for r in range(4)]
    domain = merge_views(views).domains[0]
    assert domain.kind is DomainKind.NONE
    assert domain.bandwidth_GBps == pytest.approx(16 * 3.938)


def test_nvlink_pairs_that_do_not_connect_the_node_are_modelled_as_pcie():
    bus = [f"00000000:{i + 16:02x}:00.0" for i in range(4)]
    pairs = {0: [bus[1]], 1: [bus[0]], 2: [bus[3]], 3: [bus[2]]}
    views = [_gpu_view(r, "box", r, links=4, remote="gpu", peers=pairs[r]) for r in range(4)]
    assert merge_views(views).domains[0].kind is DomainKind.NONE
    ring = {0: [bus[1]], 1: [bus[2]], 2: [bus[3]], 3: [bus[0]]}
    views = [_gpu_view(r, "box", r, links=4, remote="gpu", peers=ring[r]) for r in range(4)]
    domain = merge_views(views).domains[0]
    assert domain.kind is DomainKind.NVLINK and not domain.in_network_reduction


def test_missing_rank_is_rejected():
    with pytest.raises(ValueError, match=r"cover ranks 0..2 once each, got \[0, 1, 3\]"):
        merge_views([TORCHRUN_2_NODES[i] for i in (0, 1, 3)])


def test_two_ranks_with_one_local_rank_on_a_node_are_rejected():
    views = copy.deepcopy(TORCHRUN_2_NODES)
    views[1]["local_rank"] = 0
    with pytest.raises(ValueError, match="two ranks report the same LOCAL_RANK"):
        merge_views(views)


class _FakeNvml:
    """Stands in for pynvml on this GPU-less machine: an 8-GPU NVSwitch node, GPU 0 asked."""

    class NVMLError(Exception):
        pass

    NVML_NVLINK_MAX_LINKS = 36
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_DEVICE_TYPE_GPU, NVML_NVLINK_DEVICE_TYPE_SWITCH = 0, 2
    NVML_P2P_CAPS_INDEX_NVLINK, NVML_P2P_STATUS_OK = 2, 0
    NVML_GPU_FABRIC_STATE_NOT_STARTED, NVML_GPU_FABRIC_STATE_IN_PROGRESS = 1, 2
    NVML_GPU_FABRIC_STATE_COMPLETED = 3
    NVML_SUCCESS, NVML_ERROR_FUNCTION_NOT_FOUND = 0, 13
    c_nvmlGpuFabricInfoV_t = standin.c_nvmlGpuFabricInfoV_t

    def __init__(self):
        self.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 5
        self.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16

    def _pci(self, index):
        return types.SimpleNamespace(busId=f"00000000:{index + 16:02X}:00.0".encode())

    def nvmlDeviceGetPciInfo(self, handle):
        return self._pci(handle)

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link >= 18:
            raise self.NVMLError("not supported")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle, link):
        return types.SimpleNamespace(busId=b"00000000:C0:00.0")

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link):
        return self.NVML_NVLINK_DEVICE_TYPE_SWITCH

    def nvmlDeviceGetCount(self):
        return 8

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetP2PStatus(self, a, b, caps):
        return self.NVML_P2P_STATUS_OK

    def nvmlDeviceGetGpuFabricInfoV(self, handle, info):
        info._obj.clusterUuid[:], info._obj.cliqueId, info._obj.state = range(16), 3, 3


def test_gpu_description_reads_links_peers_and_fabric_from_nvml():
    view = describe_gpu(_FakeNvml(), 0)
    assert len(view["nvlinks"]) == 18
    assert view["nvlinks"][0] == {
        "link": 0,
        "remote_type": "switch",
        "remote_pci_bus_id": "00000000:c0:00.0",
    }
    assert len(view["p2p_nvlink_peers"]) == 7
    assert view["fabric"] == {
        "cluster_uuid": bytes(range(16)).hex(),
        "clique_id": 3,
        "state": "completed",
    }
    assert view["pcie"] == {"generation": 5, "width": 16}


def _detect(rank, world_size):
    return detect_topology().to_dict()


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="checks CPU workers; on a CUDA host both gloo ranks describe GPU 0, as detection "
    "reports the hardware (GPU detection: test_nvml_probe.py, bench/gpu/check.py topo_nvml)",
)
def test_real_two_rank_gloo_detection_agrees_on_every_rank():
    results = run_on_ranks(_detect, 2)
    assert results[0] == results[1]
    doc = results[0]
    assert doc["world_size"] == 2 and doc["library"] == "gloo"
    assert doc["nodes"] == [{"node": 0, "ranks": [0, 1]}]
    cpu = load_topology("cpu-gloo").to_dict()["domains"][0]
    assert doc["domains"] == [dict(cpu, ranks=[0, 1])]
