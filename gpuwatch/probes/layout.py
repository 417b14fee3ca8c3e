"""ctypes mirror of bpf/gpuwatch.h: every key, value and event the kernel programs share.

The header is the single definition; this module repeats it for user space and
tests/unit/test_probes_layout.py compiles the header to check every size, offset and
constant listed in STRUCTS / CONSTANTS against it, so the two cannot drift apart.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

BPF_DIR = Path(__file__).resolve().parents[2] / "bpf"
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
GW_NV_ESC_IOCTL_XFER_CMD = 211

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
GW_STAT_COUNT = 12

GW_GATE_MAX_GPUS = 64
GW_GATE_MAX_NODES = 256
GW_GATE_MAX_CGROUPS = 4096
GW_GATE_MAX_DEPTH = 32

STAT_NAMES: tuple[str, ...] = (
    "fd_overflow", "tgid_overflow", "cgroup_overflow", "rm_alloc_overflow",
    "cuda_alloc_overflow", "inflight_overflow", "rm_free_unmatched", "cuda_free_unmatched",
    "events_dropped", "exits", "read_faults", "fork_fds_unscanned",
)

CONSTANTS: tuple[str, ...] = (
    "GW_PREFIX_MAX", "GW_PATH_MAX", "GW_DEV_SLOTS", "GW_DEV_UNKNOWN", "GW_DEV_CUDA",
    "GW_KIND_CTL", "GW_KIND_GPU", "GW_KIND_UVM", "GW_KIND_OTHER",
    "GW_NV_ESC_RM_ALLOC", "GW_NV_ESC_RM_FREE", "GW_NV_ESC_IOCTL_XFER_CMD",
    "GW_EV_NEW_GPU_PROCESS", "GW_EV_OOM", "GW_EV_OVER_LIMIT", "GW_EV_KILL", "GW_EV_STOP",
    "GW_EV_DEVICE_OPEN", "GW_EV_ALLOC", "GW_EV_FREE", "GW_EV_PROCESS_EXIT", "GW_EV_PROCESS_EXEC",
    "GW_SRC_RM", "GW_SRC_CUDA", "GW_ACTION_EVENT", "GW_ACTION_KILL", "GW_ACTION_STOP",
    "GW_STAT_FD_OVERFLOW", "GW_STAT_TGID_OVERFLOW", "GW_STAT_CGROUP_OVERFLOW",
    "GW_STAT_RM_ALLOC_OVERFLOW", "GW_STAT_CUDA_ALLOC_OVERFLOW", "GW_STAT_INFLIGHT_OVERFLOW",
    "GW_STAT_RM_FREE_UNMATCHED", "GW_STAT_CUDA_FREE_UNMATCHED", "GW_STAT_EVENTS_DROPPED",
    "GW_STAT_EXITS", "GW_STAT_READ_FAULTS", "GW_STAT_FORK_FDS_UNSCANNED", "GW_STAT_COUNT",
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
    _fields_ = [("bytes", u64), ("tgid_gen", u64), ("fd_gen", u64), ("fd", u32), ("device", u32)]


class GwCudaKey(ctypes.Structure):
    _fields_ = [("tgid", u32), ("pad", u32), ("ptr", u64)]


class GwCudaVal(ctypes.Structure):
    _fields_ = [("bytes", u64), ("tgid_gen", u64)]


class GwDevhVal(ctypes.Structure):
    _fields_ = [("device", u32), ("pad", u32), ("tgid_gen", u64)]


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
    "gw_devh_val": GwDevhVal,
    "gw_event": GwEvent,
    "gw_gate_node_key": GwGateNodeKey,
    "gw_gate_node": GwGateNode,
    "gw_gate_allow": GwGateAllow,
}
