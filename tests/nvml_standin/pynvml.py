"""A stand-in for ``pynvml`` (nvidia-ml-py) on GPU-less machines: one H200 SXM as NVML sees it.

Put this folder first on ``PYTHONPATH`` and ``import pynvml`` finds it. It keeps the parts of
the real module that matter for the bugs of issue 18:

- The fabric-info calls reach a real C-ABI function through a ctypes function pointer without
  ``argtypes``, exactly as nvidia-ml-py's wrappers do (``fn(device, gpuFabricInfo)``). ctypes
  passes a Structure given there by value, so the function receives whatever the argument
  register held instead of the struct's address; like the driver writing through that stray
  pointer, it then dies of a real SIGSEGV. Given ``ctypes.byref(struct)`` it fills the struct.
- Handles are valid only between ``nvmlInit`` and ``nvmlShutdown`` (NVML_ERROR_UNINITIALIZED).
- ``NVML_STANDIN_CRASH=<function name>`` makes that function segfault (``ctypes.string_at(0)``);
  ``NVML_STANDIN_HANG=<function name>`` makes it hang.

The values model one H200 SXM in an HGX board: 18 NVLink 4 links to NVSwitches, PCIe Gen5 x16,
one GPU visible. The fabric-info values are chosen to be visible in the output (the lent
machine's own answer was not recorded).
"""

import ctypes
import os
import signal
import time
import types

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_NVLINK_MAX_LINKS = 18
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_DEVICE_TYPE_GPU, NVML_NVLINK_DEVICE_TYPE_SWITCH = 0, 2
NVML_P2P_CAPS_INDEX_NVLINK, NVML_P2P_STATUS_OK = 2, 0
NVML_GPU_FABRIC_UUID_LEN = 16
NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, NVML_GPU_FABRIC_STATE_NOT_STARTED = 0, 1
NVML_GPU_FABRIC_STATE_IN_PROGRESS, NVML_GPU_FABRIC_STATE_COMPLETED = 2, 3

UUID = "GPU-5f0f3b8e-4c1e-7d52-9a6b-0c2d4e6f8a10"
BUS_ID = b"00000000:18:00.0"
CLUSTER_UUID = bytes(range(0xA0, 0xB0))
CLIQUE_ID = 7


class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


# Field layouts copied from nvidia-ml-py 13 (c_nvmlGpuFabricInfo_t, c_nvmlGpuFabricInfo_v2_t).
_LIVE_STRUCTS = set()  # addresses of the fabric-info structs this module handed out


class c_nvmlGpuFabricInfo_t(ctypes.Structure):
    _fields_ = [
        ("clusterUuid", ctypes.c_uint8 * NVML_GPU_FABRIC_UUID_LEN),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
    ]

    def __init__(self):
        super().__init__()
        _LIVE_STRUCTS.add(ctypes.addressof(self))


nvmlGpuFabricInfo_v2 = 0x02000024


class c_nvmlGpuFabricInfoV_t(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        *c_nvmlGpuFabricInfo_t._fields_,
        ("healthMask", ctypes.c_uint32),
    ]

    def __init__(self):
        super().__init__(version=nvmlGpuFabricInfo_v2)
        _LIVE_STRUCTS.add(ctypes.addressof(self))


_initialised = 0


def _check(name, *, needs_init=True):
    if os.environ.get("NVML_STANDIN_CRASH") == name:
        ctypes.string_at(0)  # a real segmentation fault, as in the driver
    if os.environ.get("NVML_STANDIN_HANG") == name:
        time.sleep(3600)
    if needs_init and not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)


def nvmlInit():
    global _initialised
    _check("nvmlInit", needs_init=False)
    _initialised += 1


def nvmlShutdown():
    global _initialised
    _check("nvmlShutdown")
    _initialised -= 1


def nvmlDeviceGetHandleByUUID(uuid):
    _check("nvmlDeviceGetHandleByUUID")
    if uuid != UUID:
        raise NVMLError(6)  # NVML_ERROR_NOT_FOUND
    return ctypes.c_void_p(0x5000)


def nvmlDeviceGetHandleByIndex(index):
    _check("nvmlDeviceGetHandleByIndex")
    return ctypes.c_void_p(0x5000)


def nvmlDeviceGetCount():
    _check("nvmlDeviceGetCount")
    return 1


def nvmlDeviceGetPciInfo(handle):
    _check("nvmlDeviceGetPciInfo")
    return types.SimpleNamespace(busId=BUS_ID)


def nvmlDeviceGetNvLinkState(handle, link):
    _check("nvmlDeviceGetNvLinkState")
    return NVML_FEATURE_ENABLED


def nvmlDeviceGetNvLinkRemotePciInfo(handle, link):
    _check("nvmlDeviceGetNvLinkRemotePciInfo")
    return types.SimpleNamespace(busId=f"00000000:{0xC0 + link // 5:02X}:00.0".encode())


def nvmlDeviceGetNvLinkRemoteDeviceType(handle, link):
    _check("nvmlDeviceGetNvLinkRemoteDeviceType")
    return NVML_NVLINK_DEVICE_TYPE_SWITCH


def nvmlDeviceGetP2PStatus(a, b, caps):
    _check("nvmlDeviceGetP2PStatus")
    return NVML_P2P_STATUS_OK


def nvmlDeviceGetMaxPcieLinkGeneration(handle):
    _check("nvmlDeviceGetMaxPcieLinkGeneration")
    return 5


def nvmlDeviceGetMaxPcieLinkWidth(handle):
    _check("nvmlDeviceGetMaxPcieLinkWidth")
    return 16


@ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
def _c_get_fabric_info(device, info_address):
    """The driver's side: ``nvmlReturn_t f(nvmlDevice_t, nvmlGpuFabricInfo_t *)``."""
    if info_address not in _LIVE_STRUCTS:  # a stray pointer: the driver would write through it
        os.kill(os.getpid(), signal.SIGSEGV)
    versioned = ctypes.cast(info_address, ctypes.POINTER(ctypes.c_uint)).contents.value
    layout = c_nvmlGpuFabricInfoV_t if versioned == nvmlGpuFabricInfo_v2 else c_nvmlGpuFabricInfo_t
    info = ctypes.cast(info_address, ctypes.POINTER(layout)).contents
    info.clusterUuid[:] = list(CLUSTER_UUID)
    info.status, info.cliqueId = NVML_SUCCESS, CLIQUE_ID
    info.state = NVML_GPU_FABRIC_STATE_COMPLETED
    return NVML_SUCCESS


# As nvidia-ml-py reaches a C function: a pointer with no argtypes declared.
_fabric_fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.cast(_c_get_fabric_info, ctypes.c_void_p).value)


def nvmlDeviceGetGpuFabricInfoV(device, gpuFabricInfo):
    _check("nvmlDeviceGetGpuFabricInfoV")
    ret = _fabric_fn(device, gpuFabricInfo)
    if ret != NVML_SUCCESS:
        raise NVMLError(ret)


def nvmlDeviceGetGpuFabricInfo(device, gpuFabricInfo):
    _check("nvmlDeviceGetGpuFabricInfo")
    ret = _fabric_fn(device, gpuFabricInfo)
    if ret != NVML_SUCCESS:
        raise NVMLError(ret)
