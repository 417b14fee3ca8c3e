"""Model types shared by every layer: sources produce them, consumers read them.

Everything here is an immutable value (frozen dataclasses, tuples), so a Snapshot can be
published by a single reference swap and read by the exporter, `top` and the enforcer
without locks. Units are in the field names (`_bytes`, `_ratio`, `_seconds`, `_watts`).
A value that a source could not read is ``None`` ("N/A"), never a made-up zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class ProcessKind(StrEnum):
    """How NVML lists a process on a device."""

    COMPUTE = "compute"
    GRAPHICS = "graphics"


@dataclass(frozen=True)
class DeviceInfo:
    """One GPU (or one MIG instance) as seen in one sweep of the GPU backend."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    memory_free_bytes: int | None
    utilization_gpu_ratio: float | None = None
    utilization_memory_ratio: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    minor_number: int | None = None
    is_mig: bool = False
    parent_uuid: str | None = None
    healthy: bool = True
    xid_errors_total: int = 0
    simulated: bool = False
    mig_index: int | None = None


@dataclass(frozen=True)
class GpuProcess:
    """One process holding memory or running work on one GPU (host PID)."""

    pid: int
    gpu_uuid: str
    gpu_index: int
    memory_bytes: int | None
    kind: ProcessKind = ProcessKind.COMPUTE
    sm_utilization_ratio: float | None = None


@dataclass(frozen=True)
class GpuSweep:
    """Everything the GPU backend read in one sweep (one call per interval)."""

    timestamp_s: float
    devices: tuple[DeviceInfo, ...]
    processes: tuple[GpuProcess, ...]
    driver_version: str | None = None
    cuda_driver_version: int | None = None
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class ContainerIdentity:
    """Who a cgroup belongs to. Unknown cgroups are kept as runtime="host"/"unknown"."""

    runtime: str
    cgroup_path: str
    container_id: str = ""
    container_name: str = ""
    pod_name: str = ""
    pod_namespace: str = ""
    pod_uid: str = ""
    qos_class: str = ""
    cgroup_id: int | None = None
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def is_container(self) -> bool:
        return bool(self.container_id)

    @property
    def key(self) -> str:
        """Stable key for per-container state (counters survive process churn)."""
        return self.container_id or f"cgroup:{self.cgroup_path}"

    @property
    def display_name(self) -> str:
        if self.pod_name:
            return f"{self.pod_namespace}/{self.pod_name}/{self.container_name or '?'}"
        if self.container_name:
            return self.container_name
        if self.container_id:
            return self.container_id[:12]
        return self.cgroup_path or "/"


HOST_IDENTITY = ContainerIdentity(runtime="host", cgroup_path="/")


@dataclass(frozen=True)
class ProcessIdentity:
    """A host process and the container it runs in."""

    pid: int
    container_pid: int | None
    comm: str
    identity: ContainerIdentity


@dataclass(frozen=True)
class ProbeCounters:
    """Per-cgroup counters read from BPF maps once per interval (all cumulative)."""

    cgroup_id: int
    ioctl_calls_by_op: tuple[tuple[str, int], ...] = ()
    ioctl_failures_total: int = 0
    allocated_bytes_by_gpu: tuple[tuple[int, int], ...] = ()
    allocations_total: int = 0
    frees_total: int = 0
    allocation_failures_total: int = 0
    launches_total: int | None = None
    # added by the probes (issue 4). allocated_bytes_by_gpu / allocations_total / frees_total
    # above are decoded driver ioctls (RM_ALLOC/RM_FREE of video memory; GPU index -1 = device
    # not known); the cuda_* fields come from libcuda uprobes (None when that group is off).
    cuda_allocated_bytes: int | None = None
    cuda_allocations_total: int = 0
    cuda_frees_total: int = 0
    cuda_oom_total: int = 0
    ioctl_failures_by_op: tuple[tuple[str, int], ...] = ()
    graph_launches_total: int | None = None


@dataclass(frozen=True)
class ProcessUsage:
    pid: int
    container_pid: int | None
    comm: str
    memory_bytes: int | None
    sm_utilization_ratio: float | None


@dataclass(frozen=True)
class ContainerUsage:
    """One container's use of one GPU in one interval."""

    identity: ContainerIdentity
    gpu_index: int
    gpu_uuid: str
    memory_bytes: int
    sm_utilization_ratio: float
    kernel_seconds_total: float
    processes: tuple[ProcessUsage, ...] = ()
    probe: ProbeCounters | None = None


@dataclass(frozen=True)
class GroupUsage:
    """A rollup (pod or namespace) across its containers and GPUs."""

    namespace: str
    pod: str
    pod_uid: str
    memory_bytes: int
    sm_utilization_ratio: float
    kernel_seconds_total: float
    containers: int


@dataclass(frozen=True)
class Snapshot:
    """The one published view of the node for one sample interval."""

    timestamp_s: float
    node: str
    devices: tuple[DeviceInfo, ...]
    containers: tuple[ContainerUsage, ...]
    pods: tuple[GroupUsage, ...] = ()
    namespaces: tuple[GroupUsage, ...] = ()
    gpu_up: bool = True
    gpu_error: str | None = None
    probes_up: bool = False
    probe_counters: tuple[ProbeCounters, ...] = ()
    cycle_seconds: float = 0.0
    interval_s: float = 1.0
    simulated: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    cycle_cpu_seconds: float = 0.0
    gpu_errors_total: int = 0
    probe_identities: tuple[tuple[int, ContainerIdentity], ...] = ()


EMPTY_SNAPSHOT = Snapshot(timestamp_s=0.0, node="", devices=(), containers=(), gpu_up=False)
