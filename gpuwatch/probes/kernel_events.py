"""Rare probe events (ring buffer records) decoded into immutable values, and op names."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from gpuwatch.probes import layout

EVENT_NAMES: dict[int, str] = {
    layout.GW_EV_NEW_GPU_PROCESS: "new_gpu_process",
    layout.GW_EV_OOM: "oom",
    layout.GW_EV_OVER_LIMIT: "over_limit",
    layout.GW_EV_KILL: "kill",
    layout.GW_EV_STOP: "stop",
    layout.GW_EV_DEVICE_OPEN: "device_open",
    layout.GW_EV_ALLOC: "alloc",
    layout.GW_EV_FREE: "free",
    layout.GW_EV_PROCESS_EXIT: "process_exit",
    layout.GW_EV_PROCESS_EXEC: "process_exec",
}

SOURCE_NAMES = {0: "", layout.GW_SRC_RM: "ioctl", layout.GW_SRC_CUDA: "cuda"}
KIND_NAMES = {0: "", layout.GW_KIND_CTL: "ctl", layout.GW_KIND_GPU: "gpu", layout.GW_KIND_UVM: "uvm",
              layout.GW_KIND_OTHER: "other"}

# NVIDIA escape numbers (_IOC_NR) -> names used as the `op` label
IOCTL_OP_NAMES: dict[int, str] = {
    0x27: "rm_alloc_memory", 0x28: "rm_alloc_object", 0x29: "rm_free", 0x2A: "rm_control",
    0x2B: "rm_alloc", 0x34: "rm_dup_object", 0x4A: "rm_vid_heap_control", 0x4E: "rm_map_memory",
    0x4F: "rm_unmap_memory", 0x57: "rm_map_memory_dma", 200: "card_info", 201: "register_fd",
    211: "ioctl_xfer_cmd",
}


def ioctl_op_name(nr: int) -> str:
    return IOCTL_OP_NAMES.get(nr, f"esc_{nr:#04x}")


def device_index(slot: int) -> int | None:
    """Kernel device slot -> GPU minor; None for CUDA-API records, -1 when unknown."""
    if slot == layout.GW_DEV_CUDA:
        return None
    if slot >= layout.GW_DEV_UNKNOWN:
        return -1
    return slot


@dataclass(frozen=True)
class KernelEvent:
    """One rare event from the kernel (or, with verbose events, one open/alloc/free)."""

    type: str
    ts_ns: int
    cgroup_id: int
    tgid: int
    tid: int
    comm: str
    size_bytes: int
    value: int
    device: int | None
    source: str
    kind: str

    @classmethod
    def from_record(cls, raw: bytes) -> KernelEvent:
        ev = layout.GwEvent.from_buffer_copy(raw[:ctypes.sizeof(layout.GwEvent)])
        return cls(type=EVENT_NAMES.get(ev.type, f"unknown_{ev.type}"), ts_ns=ev.ts_ns,
                   cgroup_id=ev.cgroup_id, tgid=ev.tgid, tid=ev.tid,
                   comm=ev.comm.decode(errors="replace"), size_bytes=ev.bytes, value=ev.value,
                   device=device_index(ev.device), source=SOURCE_NAMES.get(ev.source, str(ev.source)),
                   kind=KIND_NAMES.get(ev.kind, str(ev.kind)))
