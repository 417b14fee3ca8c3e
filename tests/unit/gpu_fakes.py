"""Test doubles that implement the sampler's protocols (GpuBackend, IdentitySource,
ProbeSource). They hold a scripted world; they do not reuse production code."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from gpuwatch.core.errors import NvmlCallFailed, NvmlUnavailable
from gpuwatch.core.model import (
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


class FakeNvml:
    """Stands in for the nvidia-ml-py functions NvmlBackend calls (installed with pytest's
    monkeypatch), over a scripted node: `gpus` devices, NVLinks, faults and Xid events.

    Handles are the ints 1..gpus (NvmlBackend compares handles by address). A name in
    `errors` makes that function raise NVMLError(code); `missing` functions raise
    FUNCTION_NOT_FOUND like an older driver; `calls` counts every call by name.
    `links[(gpu, link)]` is ("gpu", peer) or ("switch", n); other links are inactive.
    """

    BUS = 0x18

    def __init__(self, gpus: int = 2) -> None:
        self.gpus = gpus
        self.links: dict[tuple[int, int], tuple[str, int]] = {}
        self.levels: dict[tuple[int, int], int] = {}
        self.errors: dict[str, int] = {}
        self.missing: set[str] = set()
        self.calls: dict[str, int] = {}
        self.events: list[tuple[int, int]] = []  # (gpu, xid) waiting in the event set
        self.ecc_uncorrected = [0] * gpus
        self.remap_failure = [0] * gpus
        self.lost: set[int] = set()
        self.remote_bus_format = "{:08X}:{:02X}:00.0"

    def install(self, monkeypatch: Any) -> None:
        import pynvml

        monkeypatch.delenv("GPUWATCH_NVML_LIBRARY", raising=False)
        for name in dir(self):
            if name.startswith("nvml"):
                monkeypatch.setattr(pynvml, name, self._wrap(name, getattr(self, name)))
        monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", self._wrap("_nvmlGetFunctionPointer", self._pointer))

    # ---- plumbing ----

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        import pynvml

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            if name in self.missing:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            if name in self.errors:
                raise pynvml.NVMLError(self.errors[name])
            return fn(*args, **kwargs)

        return call

    @staticmethod
    def _pointer(name: str) -> Any:
        import pynvml

        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def _gpu(self, handle: int) -> int:
        import pynvml

        gpu = int(handle) - 1
        if gpu in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def bus_id(self, gpu: int) -> str:
        return f"00000000:{self.BUS + 0x10 * gpu:02X}:00.0"

    def count(self, name: str) -> int:
        return self.calls.get(name, 0)

    # ---- the NVML subset ----

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index + 1

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-fake-{self._gpu(handle)}"

    def nvmlDeviceGetName(self, handle: int) -> str:
        self._gpu(handle)
        return "Fake H100"

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:
        return SimpleNamespace(busId=self.bus_id(self._gpu(handle)))

    def nvmlDeviceGetMinorNumber(self, handle: int) -> int:
        return self._gpu(handle)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        self._gpu(handle)
        return 700000

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        self._gpu(handle)
        return (9, 0)

    def nvmlDeviceGetMigMode(self, handle: int) -> Any:
        import pynvml

        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: Any) -> None:
        self._gpu(handle)

    def nvmlEventSetFree(self, event_set: Any) -> None:
        pass

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        import pynvml

        if not self.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        gpu, xid = self.events.pop(0)
        return SimpleNamespace(device=gpu + 1, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid)

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int | None = None) -> Any:
        self._gpu(handle)
        return SimpleNamespace(total=80 * GIB, used=0, free=80 * GIB)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        self._gpu(handle)
        return SimpleNamespace(gpu=0, memory=0)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        self._gpu(handle)
        return 30

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        self._gpu(handle)
        return 70000

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter_type: int) -> int:
        gpu = self._gpu(handle)
        assert (error_type, counter_type) == (1, 0), "uncorrected, volatile"
        return self.ecc_uncorrected[gpu]

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        return (0, 0, 0, self.remap_failure[self._gpu(handle)])

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        i, j = self._gpu(a), self._gpu(b)
        return self.levels.get((min(i, j), max(i, j)), 50)

    def _link(self, handle: int, link: int) -> tuple[str, int] | None:
        import pynvml

        gpu = self._gpu(handle)
        if not 0 <= link < 18:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.links.get((gpu, link))

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        return 1 if self._link(handle, link) else 0

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: int, link: int) -> int:
        import pynvml

        remote = self._link(handle, link)
        if remote is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH if remote[0] == "switch" else pynvml.NVML_NVLINK_DEVICE_TYPE_GPU

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: int, link: int) -> Any:
        import pynvml

        remote = self._link(handle, link)
        if remote is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        bus = self.BUS + 0x10 * remote[1] if remote[0] == "gpu" else 0xC0 + remote[1]
        return SimpleNamespace(busId=self.remote_bus_format.format(0, bus), domain=0, bus=bus, device=0)
