"""ctypes mirror of bpf/gpuwatch.h: every key, value and event the kernel programs share.

The header is the single definition; this module repeats it for user space and
tests/unit/test_probes_layout.py compiles the header to check every size, offset and
constant listed in STRUCTS / CONSTANTS against it, so the two cannot drift apart.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path


def find_bpf_dir() -> Path:
    """Where the kernel programs' C sources are: bpf/ of a source checkout (also what an
    editable install runs from), else <prefix>/share/gpuwatch/bpf where a wheel installs them
    (pyproject.toml data-files)."""
    checkout = Path(__file__).resolve().parents[2] / "bpf"
    if (checkout / "gpuwatch.h").is_file():
        return checkout
    installed = Path(sys.prefix) / "share" / "gpuwatch" / "bpf"
    if (installed / "gpuwatch.h").is_file():
        return installed
    return checkout  # neither: BCC's load then names this path in its error


BPF_DIR = find_bpf_dir()
HEADER_PATH = BPF_DIR / "gpuwatch.h"

# ---- constants (checked against the header) ----------------------------------------------
GW_PREFIX_MAX = 112
GW_PATH_MAX = 128
GW_DEV_SLOTS = 17
GW_DEV_UNKNOWN = 16
GW_DEV_CUDA = 0xFFFF

GW_KIND_CTL = 1
GW_KIND_GPU = 2
GW_KIND_UVM = 3
GW_KIND_OTHER = 4

GW_NV_ESC_RM_ALLOC = 0x2B
GW_NV_ESC_RM_FREE = 0x29
GW_NV_ESC_RM_CONTROL = 0x2A
GW_NV_ESC_RM_VID_HEAP_CONTROL = 0x4A
GW_NV_ESC_RM_DUP_OBJECT = 0x34
GW_NV_ESC_CARD_INFO = 200
GW_NV_ESC_IOCTL_XFER_CMD = 211
GW_NVOS21_SIZE = 32
GW_NVOS64_SIZE = 48
GW_NVOS00_SIZE = 16
GW_NVOS54_SIZE = 32
GW_NVOS32_SIZE = 184
GW_NVOS55_SIZE = 28
GW_XFER_SIZE = 16
GW_CARD_INFO_SIZE = 72
GW_CARD_INFO_MAX = 32
GW_NV01_ROOT_CLIENT = 0x41
GW_NV01_DEVICE_0 = 0x80
GW_NV20_SUBDEVICE_0 = 0x2080
GW_NV01_MEMORY_LOCAL_USER = 0x40
GW_NV01_MEMORY_LOCAL_PHYSICAL = 0xC2
GW_NV_MEMORY_PARAMS_SIZE_OFFSET = 64

# RM_ALLOC parameter bytes by class, as the RM sizes them (it ignores paramsSize; real libcuda
# sends 0): bpf/gpuwatch.h GW_RM_ALLOC_PARAMS_TABLE, checked by tests/unit/test_probes_layout.py.
RM_ALLOC_PARAMS_BYTES: dict[int, int] = {
    0x0000: 4, 0x0001: 4, 0x0041: 4,  # root/client classes: NvHandle (optional)
    0x0080: 56,                       # NV01_DEVICE_0: NV0080_ALLOC_PARAMETERS, deviceId@0
    0x2080: 4, 0x2081: 4,             # subdevice, binapi
    0x0040: 128, 0x003E: 128, 0x50A0: 128,  # NV_MEMORY_ALLOCATION_PARAMS (120 on 535), size@64
    0x00C2: 24,                       # NV_PHYSICAL_MEMORY_ALLOCATION_PARAMS
    0x0071: 40,                       # OS descriptor memory
    0x90F1: 56,                       # FERMI_VASPACE_A
    0x00F8: 48, 0x00FD: 80,           # fabric / multicast fabric memory
    0x00DE: 8, 0x503C: 4, 0xC8B5: 8, 0x83DE: 12, 0xCB33: 4, 0xC661: 2, 0xCBC0: 16,
    0xC86F: 368, 0xA06C: 20, 0x9067: 12,
    0x0079: 24,                       # NV01_EVENT_OS_EVENT: NV0005_ALLOC_PARAMETERS
    0x90E6: 0,                        # GF100_SUBDEVICE_MASTER: no parameters
}
GW_NV0000_CTRL_CMD_GPU_GET_ID_INFO = 0x202
GW_NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2 = 0x205
GW_NVOS32_FUNCTION_ALLOC_SIZE = 2
GW_NVOS32_FUNCTION_FREE = 3
GW_NVOS32_ATTR_LOCATION_SHIFT = 25
GW_NVOS32_ALLOC_FLAGS_VIRTUAL = 0x80000
GW_NVOS32_FREE_FLAGS_MEMORY_HANDLE_PROVIDED = 0x1
GW_RM_DEPTH = 6

GW_EV_NEW_GPU_PROCESS = 1
GW_EV_OOM = 2
GW_EV_OVER_LIMIT = 3
GW_EV_KILL = 4
GW_EV_STOP = 5
GW_EV_DEVICE_OPEN = 10
GW_EV_ALLOC = 11
GW_EV_FREE = 12
GW_EV_PROCESS_EXIT = 13
GW_EV_PROCESS_EXEC = 14

GW_SRC_RM = 1
GW_SRC_CUDA = 2

GW_ACTION_EVENT = 0
GW_ACTION_KILL = 1
GW_ACTION_STOP = 2

GW_STAT_FD_OVERFLOW = 0
GW_STAT_TGID_OVERFLOW = 1
GW_STAT_CGROUP_OVERFLOW = 2
GW_STAT_RM_ALLOC_OVERFLOW = 3
GW_STAT_CUDA_ALLOC_OVERFLOW = 4
GW_STAT_INFLIGHT_OVERFLOW = 5
GW_STAT_RM_FREE_UNMATCHED = 6
GW_STAT_CUDA_FREE_UNMATCHED = 7
GW_STAT_EVENTS_DROPPED = 8
GW_STAT_EXITS = 9
GW_STAT_READ_FAULTS = 10
GW_STAT_FORK_FDS_UNSCANNED = 11
GW_STAT_RM_CLIENT_OVERFLOW = 12
GW_STAT_RM_CHAIN_BROKEN = 13
GW_STAT_RM_DEPTH_EXCEEDED = 14
GW_STAT_GPU_MAP_OVERFLOW = 15
GW_STAT_UVM_OVERFLOW = 16
GW_STAT_COUNT = 17

GW_GATE_MAX_GPUS = 64
GW_GATE_MAX_NODES = 256
GW_GATE_MAX_CGROUPS = 4096
GW_GATE_MAX_DEPTH = 32

STAT_NAMES: tuple[str, ...] = (
    "fd_overflow", "tgid_overflow", "cgroup_overflow", "rm_alloc_overflow",
    "cuda_alloc_overflow", "inflight_overflow", "rm_free_unmatched", "cuda_free_unmatched",
    "events_dropped", "exits", "read_faults", "fork_fds_unscanned",
    "rm_client_overflow", "rm_chain_broken", "rm_depth_exceeded", "gpu_map_overflow", "uvm_overflow",
)

CONSTANTS: tuple[str, ...] = (
    "GW_PREFIX_MAX", "GW_PATH_MAX", "GW_DEV_SLOTS", "GW_DEV_UNKNOWN", "GW_DEV_CUDA",
    "GW_KIND_CTL", "GW_KIND_GPU", "GW_KIND_UVM", "GW_KIND_OTHER",
    "GW_NV_ESC_RM_ALLOC", "GW_NV_ESC_RM_FREE", "GW_NV_ESC_RM_CONTROL", "GW_NV_ESC_RM_VID_HEAP_CONTROL",
    "GW_NV_ESC_CARD_INFO", "GW_NV_ESC_IOCTL_XFER_CMD",
    "GW_NV_ESC_RM_DUP_OBJECT", "GW_NVOS55_SIZE",
    "GW_NVOS21_SIZE", "GW_NVOS64_SIZE", "GW_NVOS00_SIZE", "GW_NVOS54_SIZE", "GW_NVOS32_SIZE", "GW_XFER_SIZE",
    "GW_CARD_INFO_SIZE", "GW_CARD_INFO_MAX", "GW_NV01_ROOT_CLIENT", "GW_NV01_DEVICE_0", "GW_NV20_SUBDEVICE_0",
    "GW_NV01_MEMORY_LOCAL_USER", "GW_NV01_MEMORY_LOCAL_PHYSICAL", "GW_NV_MEMORY_PARAMS_SIZE_OFFSET",
    "GW_NV0000_CTRL_CMD_GPU_GET_ID_INFO", "GW_NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2",
    "GW_NVOS32_FUNCTION_ALLOC_SIZE", "GW_NVOS32_FUNCTION_FREE", "GW_NVOS32_ATTR_LOCATION_SHIFT",
    "GW_NVOS32_ALLOC_FLAGS_VIRTUAL", "GW_NVOS32_FREE_FLAGS_MEMORY_HANDLE_PROVIDED", "GW_RM_DEPTH",
    "GW_EV_NEW_GPU_PROCESS", "GW_EV_OOM", "GW_EV_OVER_LIMIT", "GW_EV_KILL", "GW_EV_STOP",
    "GW_EV_DEVICE_OPEN", "GW_EV_ALLOC", "GW_EV_FREE", "GW_EV_PROCESS_EXIT", "GW_EV_PROCESS_EXEC",
    "GW_SRC_RM", "GW_SRC_CUDA", "GW_ACTION_EVENT", "GW_ACTION_KILL", "GW_ACTION_STOP",
    "GW_STAT_FD_OVERFLOW", "GW_STAT_TGID_OVERFLOW", "GW_STAT_CGROUP_OVERFLOW",
    "GW_STAT_RM_ALLOC_OVERFLOW", "GW_STAT_CUDA_ALLOC_OVERFLOW", "GW_STAT_INFLIGHT_OVERFLOW",
    "GW_STAT_RM_FREE_UNMATCHED", "GW_STAT_CUDA_FREE_UNMATCHED", "GW_STAT_EVENTS_DROPPED",
    "GW_STAT_EXITS", "GW_STAT_READ_FAULTS", "GW_STAT_FORK_FDS_UNSCANNED", "GW_STAT_RM_CLIENT_OVERFLOW",
    "GW_STAT_RM_CHAIN_BROKEN", "GW_STAT_RM_DEPTH_EXCEEDED", "GW_STAT_GPU_MAP_OVERFLOW", "GW_STAT_UVM_OVERFLOW",
    "GW_STAT_COUNT",
    "GW_GATE_MAX_GPUS", "GW_GATE_MAX_NODES", "GW_GATE_MAX_CGROUPS", "GW_GATE_MAX_DEPTH",
)

u32 = ctypes.c_uint32
u64 = ctypes.c_uint64
s64 = ctypes.c_int64


class GwConfig(ctypes.Structure):
    _fields_ = [("prefix_len", u32), ("flags", u32), ("prefix", ctypes.c_char * GW_PREFIX_MAX)]


class GwTgidState(ctypes.Structure):
    _fields_ = [("cgroup_id", u64), ("gen", u64), ("gpu_mask", u32), ("fd_hi", u32),
                ("rm_bytes", s64 * GW_DEV_SLOTS), ("cuda_bytes", s64)]


class GwFdKey(ctypes.Structure):
    _fields_ = [("tgid", u32), ("fd", u32)]


class GwFdVal(ctypes.Structure):
    _fields_ = [("kind", u32), ("minor", u32), ("tgid_gen", u64), ("fd_gen", u64),
                ("rm_bytes", s64 * GW_DEV_SLOTS)]


class GwIoctlKey(ctypes.Structure):
    _fields_ = [("cgroup_id", u64), ("nr", u32), ("pad", u32)]


class GwIoctlVal(ctypes.Structure):
    _fields_ = [("calls", u64), ("failures", u64)]


class GwMemKey(ctypes.Structure):
    _fields_ = [("cgroup_id", u64), ("device", u32), ("pad", u32)]


class GwMemVal(ctypes.Structure):
    _fields_ = [("live_bytes", s64), ("allocs", u64), ("frees", u64), ("failures", u64)]


class GwLaunchVal(ctypes.Structure):
    _fields_ = [("kernel_launches", u64), ("graph_launches", u64)]


class GwLimit(ctypes.Structure):
    _fields_ = [("limit_bytes", u64), ("action", u32), ("pad", u32)]


class GwRmKey(ctypes.Structure):
    _fields_ = [("tgid", u32), ("h_root", u32), ("h_object", u32), ("pad", u32)]


class GwRmVal(ctypes.Structure):
    _fields_ = [("bytes", s64), ("gen", u64), ("parent_gen", u64), ("tgid_gen", u64), ("fd_gen", u64),
                ("fd", u32), ("device", u32), ("h_parent", u32), ("h_class", u32)]


class GwClientKey(ctypes.Structure):
    _fields_ = [("tgid", u32), ("h_client", u32)]


class GwClientVal(ctypes.Structure):
    _fields_ = [("gen", u64), ("tgid_gen", u64), ("fd_gen", u64), ("fd", u32), ("pad", u32),
                ("bytes", s64 * GW_DEV_SLOTS)]


class GwCudaKey(ctypes.Structure):
    _fields_ = [("tgid", u32), ("pad", u32), ("ptr", u64)]


class GwCudaVal(ctypes.Structure):
    _fields_ = [("bytes", u64), ("tgid_gen", u64)]


class GwEvent(ctypes.Structure):
    _fields_ = [("ts_ns", u64), ("cgroup_id", u64), ("bytes", u64), ("value", u64),
                ("type", u32), ("tgid", u32), ("tid", u32), ("device", u32), ("source", u32),
                ("kind", u32), ("comm", ctypes.c_char * 16)]


class GwGateNodeKey(ctypes.Structure):
    _fields_ = [("major", u32), ("minor", u32)]


class GwGateNode(ctypes.Structure):
    _fields_ = [("index", u32), ("pad", u32)]


class GwGateAllow(ctypes.Structure):
    _fields_ = [("gpu_mask", u64)]


# C struct name -> ctypes mirror (checked field by field against the header)
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "gw_config": GwConfig,
    "gw_tgid_state": GwTgidState,
    "gw_fd_key": GwFdKey,
    "gw_fd_val": GwFdVal,
    "gw_ioctl_key": GwIoctlKey,
    "gw_ioctl_val": GwIoctlVal,
    "gw_mem_key": GwMemKey,
    "gw_mem_val": GwMemVal,
    "gw_launch_val": GwLaunchVal,
    "gw_limit": GwLimit,
    "gw_rm_key": GwRmKey,
    "gw_rm_val": GwRmVal,
    "gw_cuda_key": GwCudaKey,
    "gw_cuda_val": GwCudaVal,
    "gw_client_key": GwClientKey,
    "gw_client_val": GwClientVal,
    "gw_event": GwEvent,
    "gw_gate_node_key": GwGateNodeKey,
    "gw_gate_node": GwGateNode,
    "gw_gate_allow": GwGateAllow,
}
