"""NVML is queried in a subprocess: a crash or hang there cannot end the caller (issue 18).

No GPU here, so ``tests/nvml_standin/pynvml.py`` stands in for nvidia-ml-py through
``PYTHONPATH``, as the real module would be found: one H200 SXM whose fabric-info call goes
through a real C-ABI function pointer without declared argument types, as nvidia-ml-py's does.
"""

import logging
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from overlapkit.topology import detect, detect_topology, nvml_probe
from tests.cuda import requires_cuda
from tests.nvml_standin import pynvml as standin

STANDIN_DIR = Path(standin.__file__).parent


@pytest.fixture
def h200(monkeypatch):
    """This process sees one CUDA device, an H200, and the stand-in is the pynvml it finds."""
    monkeypatch.setenv("PYTHONPATH", str(STANDIN_DIR))
    props = types.SimpleNamespace(
        name="NVIDIA H200", major=9, minor=0, uuid=standin.UUID.removeprefix("GPU-")
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_detection_reads_the_h200s_links_and_fabric_info_through_the_probe(h200, caplog):
    view = detect.local_view(rank=0)["gpu"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert view["name"] == "NVIDIA H200" and view["nvml"] is True
    assert view["pci_bus_id"] == "00000000:18:00.0"
    assert len(view["nvlinks"]) == 18
    assert {link["remote_type"] for link in view["nvlinks"]} == {"switch"}
    assert view["pcie"] == {"generation": 5, "width": 16}
    # Written by the stand-in's C function through the pointer it was given.
    assert view["fabric"] == {
        "cluster_uuid": standin.CLUSTER_UUID.hex(),
        "clique_id": standin.CLIQUE_ID,
        "state": "completed",
    }


def test_standin_segfaults_like_the_driver_when_the_fabric_struct_goes_by_value():
    """The pre-fix call, ``nvmlDeviceGetGpuFabricInfo(handle, info)``, dies in the stand-in."""
    code = (
        "import pynvml; pynvml.nvmlInit(); "
        "h = pynvml.nvmlDeviceGetHandleByUUID(pynvml.UUID); "
        "pynvml.nvmlDeviceGetGpuFabricInfo(h, pynvml.c_nvmlGpuFabricInfo_t())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(STANDIN_DIR)},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -signal.SIGSEGV


@pytest.mark.parametrize("call", ["nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetHandleByUUID"])
def test_segfault_in_nvml_is_a_warning_and_detection_falls_back(h200, monkeypatch, caplog, call):
    monkeypatch.setenv("NVML_STANDIN_CRASH", call)
    topo = detect_topology()  # still alive
    assert "died of SIGSEGV" in caplog.text
    assert topo.library.value == "nccl" and topo.devices[0].kind.value == "gpu"
    # No NVML facts: no known NVLinks, so the GPU forms a PCIe ("none") domain.
    assert [d.kind.value for d in topo.domains] == ["none"]


def test_hung_nvml_probe_is_killed_after_its_timeout(h200, monkeypatch, caplog):
    monkeypatch.setenv("NVML_STANDIN_HANG", "nvmlInit")
    view = detect._gpu_view(0, timeout_s=1.0)
    assert view["nvml"] is False and view["nvlinks"] == []
    assert "did not answer within 1 s" in caplog.text


def test_missing_nvml_library_is_logged_as_unavailable(monkeypatch, caplog, tmp_path):
    (tmp_path / "pynvml.py").write_text("raise ImportError('no libnvidia-ml.so.1 here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    caplog.set_level(logging.INFO, logger=detect.__name__)
    assert detect._run_nvml_probe(standin.UUID, timeout_s=60) is None
    assert "NVML unavailable: no libnvidia-ml.so.1 here" in caplog.text


@requires_cuda
def test_real_nvml_describes_this_gpu_many_times_in_process_and_through_the_probe():
    """The H200 crash came after repeated in-process detection: repeat both, with the real NVML."""
    import pynvml

    pynvml.nvmlInit()
    try:
        uuid = f"GPU-{torch.cuda.get_device_properties(0).uuid}"
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        views = [nvml_probe.describe_gpu(pynvml, handle) for _ in range(50)]
    finally:
        pynvml.nvmlShutdown()
    assert all(view == views[0] for view in views)
    for _ in range(5):
        topo = detect_topology()
        assert topo.library.value == "nccl"
    assert detect.local_view(rank=0)["gpu"]["nvml"] is True
