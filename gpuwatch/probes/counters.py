"""Per-cgroup BPF counter maps -> ProbeCounters (one read of each map per interval).

gw_ioctls (per-CPU: summed over CPUs) gives calls and failures per escape number, gw_mem live
bytes and counts per device slot (GW_DEV_CUDA: libcuda uprobes), gw_launches (per-CPU, when
the launch group is on) kernel and graph launches. gw_uvm_ioctls (per-CPU) counts nvidia-uvm
ioctls apart, by their bare numbers (read_uvm_ioctls).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from gpuwatch.core.model import ProbeCounters, ProcessProbe
from gpuwatch.probes import layout
from gpuwatch.probes.bpfsys import BpfMap
from gpuwatch.probes.kernel_events import device_index, ioctl_op_name


def read_counters(maps: Mapping[str, BpfMap], launches_on: bool, cuda_on: bool) -> tuple[ProbeCounters, ...]:
    """One ProbeCounters per cgroup present in any counter map, sorted by cgroup id.
    `launches_on` / `cuda_on`: whether those groups run (else their fields are None)."""
    acc: dict[int, _CgroupAcc] = {}

    def get(cg: int) -> _CgroupAcc:
        if cg not in acc:
            acc[cg] = _CgroupAcc()
        return acc[cg]

    ioctls = maps["gw_ioctls"]
    for key, value in ioctls.items():
        k = layout.GwIoctlKey.from_buffer_copy(key)
        a = get(k.cgroup_id)
        for slot in ioctls.percpu_slots(value):
            v = layout.GwIoctlVal.from_buffer_copy(slot)
            a.calls[k.nr] = a.calls.get(k.nr, 0) + v.calls
            a.failures[k.nr] = a.failures.get(k.nr, 0) + v.failures
    for key, value in maps["gw_mem"].items():
        mk = layout.GwMemKey.from_buffer_copy(key)
        mv = layout.GwMemVal.from_buffer_copy(value)
        a = get(mk.cgroup_id)
        if mk.device == layout.GW_DEV_CUDA:
            a.cuda = mv
        else:
            dev = device_index(mk.device)
            a.rm[-1 if dev is None else dev] = mv
    launches = maps.get("gw_launches")
    if launches is not None:
        for key, value in launches.items():
            a = get(struct.unpack("<Q", key)[0])
            for slot in launches.percpu_slots(value):
                lv = layout.GwLaunchVal.from_buffer_copy(slot)
                a.kernel_launches += lv.kernel_launches
                a.graph_launches += lv.graph_launches
    for (cgroup_id, nr), (calls, _failures) in read_uvm_ioctls(maps).items():
        get(cgroup_id).uvm_calls[nr] = calls
    return tuple(a.counters(cg, launches_on, cuda_on) for cg, a in sorted(acc.items()))


def read_process_counters(maps: Mapping[str, BpfMap]) -> tuple[ProcessProbe, ...]:
    """Live bytes per process from gw_tgids (the same charges as the per-cgroup gw_mem, kept
    per tgid), sorted by tgid: what a per-process join needs when one cgroup holds the
    processes of several containers."""
    out: list[ProcessProbe] = []
    for key, value in maps["gw_tgids"].items():
        st = layout.GwTgidState.from_buffer_copy(value)
        rm: dict[int, int] = {}
        for slot in range(layout.GW_DEV_SLOTS):
            size = int(st.rm_bytes[slot])
            if size:
                dev = device_index(slot)
                gpu = -1 if dev is None else dev
                rm[gpu] = rm.get(gpu, 0) + size
        out.append(ProcessProbe(tgid=struct.unpack("<I", key[:4])[0], cgroup_id=int(st.cgroup_id),
                                allocated_bytes_by_gpu=tuple(sorted(rm.items())),
                                cuda_allocated_bytes=int(st.cuda_bytes)))
    return tuple(sorted(out, key=lambda p: p.tgid))


def read_uvm_ioctls(maps: Mapping[str, BpfMap]) -> dict[tuple[int, int], tuple[int, int]]:
    """(cgroup id, nvidia-uvm ioctl number) -> (calls, failures), summed over CPUs. UVM numbers
    are bare (not 'F'-encoded): they are kept apart from the RM escape counters."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    uvm = maps.get("gw_uvm_ioctls")
    if uvm is None:
        return out
    for key, value in uvm.items():
        k = layout.GwIoctlKey.from_buffer_copy(key)
        calls = failures = 0
        for slot in uvm.percpu_slots(value):
            v = layout.GwIoctlVal.from_buffer_copy(slot)
            calls += v.calls
            failures += v.failures
        out[(k.cgroup_id, k.nr)] = (calls, failures)
    return out


class _CgroupAcc:
    """What one cgroup's entries add up to."""

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}
        self.failures: dict[int, int] = {}
        self.rm: dict[int, layout.GwMemVal] = {}
        self.cuda: layout.GwMemVal | None = None
        self.kernel_launches = 0
        self.graph_launches = 0
        self.uvm_calls: dict[int, int] = {}

    def counters(self, cgroup_id: int, launches_on: bool, cuda_on: bool) -> ProbeCounters:
        cuda = self.cuda
        return ProbeCounters(
            cgroup_id=cgroup_id,
            ioctl_calls_by_op=tuple(sorted((ioctl_op_name(nr), n) for nr, n in self.calls.items())),
            ioctl_failures_total=sum(self.failures.values()),
            ioctl_failures_by_op=tuple(sorted((ioctl_op_name(nr), n)
                                              for nr, n in self.failures.items() if n)),
            allocated_bytes_by_gpu=tuple(sorted((dev, v.live_bytes) for dev, v in self.rm.items())),
            allocations_total=sum(v.allocs for v in self.rm.values()),
            frees_total=sum(v.frees for v in self.rm.values()),
            allocation_failures_total=sum(v.failures for v in self.rm.values())
            + (cuda.failures if cuda else 0),
            launches_total=self.kernel_launches + self.graph_launches if launches_on else None,
            graph_launches_total=self.graph_launches if launches_on else None,
            uvm_ioctl_calls_by_cmd=tuple(sorted((f"{nr:#x}", n) for nr, n in self.uvm_calls.items())),
            cuda_allocated_bytes=(cuda.live_bytes if cuda else 0) if cuda_on else None,
            cuda_allocations_total=cuda.allocs if cuda else 0,
            cuda_frees_total=cuda.frees if cuda else 0,
            cuda_oom_total=cuda.failures if cuda else 0,
        )
