"""Test doubles that implement the sampler's protocols (GpuBackend, IdentitySource,
ProbeSource). They hold a scripted world; they do not reuse production code."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from gpuwatch.errors import NvmlCallFailed, NvmlUnavailable
from gpuwatch.model import (
    ContainerIdentity,
    DeviceInfo,
    GpuProcess,
    GpuSweep,
    ProbeCounters,
    ProcessIdentity,
)

GIB = 1 << 30


def device(index: int, total: int = 80 * GIB, used: int = 0, **kw: object) -> DeviceInfo:
    return DeviceInfo(index=index, uuid=f"GPU-fake-{index}", name="Fake H100",
                      pci_bus_id=f"0000:{index:02x}:00.0",
                      memory_total_bytes=total, memory_used_bytes=used, memory_free_bytes=total - used,
                      **kw)  # type: ignore[arg-type]


def container(cid: str, namespace: str = "", pod: str = "", name: str = "", pod_uid: str = "",
              cgroup_id: int | None = None) -> ContainerIdentity:
    return ContainerIdentity(runtime="containerd" if pod else "runc", cgroup_path=f"/kubepods/{cid}",
                             container_id=cid, container_name=name or cid, pod_name=pod,
                             pod_namespace=namespace, pod_uid=pod_uid, cgroup_id=cgroup_id)


@dataclass
class FakeWorld:
    """What the fake GPUs see: devices and per-pid (gpu index, memory, sm util)."""

    devices: list[DeviceInfo] = field(default_factory=lambda: [device(0), device(1)])
    procs: dict[tuple[int, int], tuple[int | None, float | None]] = field(default_factory=dict)
    now_s: float = 100.0
    down: bool = False
    creations: int = 0
    sweeps: int = 0
    field_errors: tuple[str, ...] = ()

    def clock(self) -> float:
        return self.now_s


class FakeBackend:
    """A GpuBackend over a FakeWorld; fails like NVML when the world is down."""

    def __init__(self, world: FakeWorld) -> None:
        self.world = world
        self.closed = False

    def sweep(self) -> GpuSweep:
        if self.closed:
            raise NvmlCallFailed("closed")
        if self.world.down:
            raise NvmlCallFailed("fake GPU lost", fix="bring the fake back")
        self.world.sweeps += 1
        procs = tuple(
            GpuProcess(pid=pid, gpu_uuid=f"GPU-fake-{gpu}", gpu_index=gpu, memory_bytes=mem,
                       sm_utilization_ratio=util)
            for (pid, gpu), (mem, util) in sorted(self.world.procs.items())
        )
        return GpuSweep(timestamp_s=self.world.now_s, devices=tuple(self.world.devices), processes=procs,
                        driver_version="fake", errors=self.world.field_errors)

    def close(self) -> None:
        self.closed = True


def factory_for(world: FakeWorld):  # type: ignore[no-untyped-def]
    def factory() -> FakeBackend:
        if world.down:
            raise NvmlUnavailable("fake NVML unavailable", fix="bring the fake back")
        world.creations += 1
        return FakeBackend(world)

    return factory


class FakeResolver:
    """IdentitySource over a pid -> ProcessIdentity table."""

    def __init__(self, table: dict[int, ProcessIdentity] | None = None) -> None:
        self.table = dict(table or {})
        self.sweeps = 0

    def add(self, pid: int, identity: ContainerIdentity, container_pid: int | None = None) -> None:
        self.table[pid] = ProcessIdentity(pid=pid, container_pid=container_pid, comm=f"proc{pid}",
                                          identity=identity)

    def begin_sweep(self) -> None:
        self.sweeps += 1

    def resolve_pids(self, pids: Iterable[int]) -> dict[int, ProcessIdentity]:
        return {pid: self.table[pid] for pid in pids if pid in self.table}

    def identity_for_cgroup_id(self, cgroup_id: int) -> ContainerIdentity | None:
        for ident in self.table.values():
            if ident.identity.cgroup_id == cgroup_id:
                return ident.identity
        return None


class FakeProbes:
    def __init__(self, counters: tuple[ProbeCounters, ...] = (), fail: bool = False) -> None:
        self.counters = counters
        self.fail = fail

    def read(self) -> tuple[ProbeCounters, ...]:
        if self.fail:
            raise OSError("map gone")
        return self.counters
