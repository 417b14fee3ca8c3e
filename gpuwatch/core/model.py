"""Model types shared by every layer: sources produce them, consumers read them.

Everything here is an immutable value (frozen dataclasses, tuples), so a Snapshot can be
published by a single reference swap and read by the exporter, `top` and the enforcer
without locks. Units are in the field names (`_bytes`, `_ratio`, `_seconds`, `_watts`).
A value that a source could not read is ``None`` ("N/A"), never a made-up zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum


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
    # health inputs read by the backend (issue 8); the verdict is signals/health.py's
    lost: bool = False  # NVML answered GPU_IS_LOST in this sweep
    xid_events: tuple[int, ...] = ()  # Xid codes NVML delivered since the previous sweep
    ecc_uncorrected_volatile: int | None = None  # uncorrectable ECC errors since the last reset
    row_remap_failure: bool | None = None  # nvmlDeviceGetRemappedRows: failureOccurred
    compute_capability: tuple[int, int] | None = None  # CUDA (major, minor)
    # DCGM's default fields that the sweep reads besides the above (issue 19; DeviceFields)
    fields: DeviceFields | None = None  # None: not read (MIG instance, lost GPU, another backend)
    last_xid: int = 0  # the code of the last Xid NVML delivered since the backend started; 0: none


@dataclass(frozen=True)
class DeviceFields:
    """The per-GPU readings dcgm-exporter publishes by default that gpuwatch reads besides memory,
    utilisation, temperature and power (issue 19): one batched nvmlDeviceGetFieldValues plus the
    clock and encoder/decoder getters per sweep. Each is None where the GPU or driver does not
    support it (NVLink on a PCIe card, PCIe byte counters on older drivers). Counters (`_total`)
    are the driver's, cumulative since it was loaded."""

    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    energy_joules_total: float | None = None  # NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ) / 1000
    memory_temperature_celsius: float | None = None
    pcie_transmitted_bytes_total: int | None = None
    pcie_received_bytes_total: int | None = None
    pcie_replays_total: int | None = None
    nvlink_transmitted_bytes_total: int | None = None  # data payload, all links (KiB x 1024)
    nvlink_received_bytes_total: int | None = None
    encoder_utilization_ratio: float | None = None
    decoder_utilization_ratio: float | None = None
    remapped_rows_correctable: int | None = None  # nvmlDeviceGetRemappedRows (read with the health inputs)
    remapped_rows_uncorrectable: int | None = None
    row_remap_pending: bool | None = None


class TopologyLevel(IntEnum):
    """NVML's nvmlGpuTopologyLevel_t: the closest common ancestor of two GPUs (lower is closer)."""

    INTERNAL = 0  # same board (multi-GPU board)
    SINGLE = 10  # one PCIe switch
    MULTIPLE = 20  # several PCIe switches, no host bridge
    HOSTBRIDGE = 30  # the same host bridge
    NODE = 40  # the same NUMA node (CPU), different host bridges
    SYSTEM = 50  # across CPUs (SMP interconnect)


@dataclass(frozen=True)
class GpuLink:
    """How one GPU reaches a peer: PCIe common ancestor and active NVLinks between them."""

    gpu_index: int
    peer_index: int
    level: TopologyLevel | None  # None: NVML could not say
    nvlinks: int  # active NVLinks from gpu to peer (direct, or through an NVSwitch)


@dataclass(frozen=True)
class GpuTopology:
    """The node's GPU interconnect, read once per backend (it changes only with hardware).

    `links` holds both orders of every pair of physical GPUs. `nvswitch` is true when the
    GPUs' NVLinks end on NVSwitches (every GPU reaches every other at full NVLink width).
    `nvlink_supported` is false where NVML answers NOT_SUPPORTED (VMs, PCIe cards).
    """

    links: tuple[GpuLink, ...] = ()
    nvswitch: bool = False
    nvlink_supported: bool = False


@dataclass(frozen=True)
class GpuProcess:
    """One process holding memory or running work on one GPU (host PID)."""

    pid: int
    gpu_uuid: str
    gpu_index: int
    memory_bytes: int | None
    kind: ProcessKind = ProcessKind.COMPUTE
    sm_utilization_ratio: float | None = None
    # GPU seconds the process ran since the backend's previous sweep, from NVML's samples by
    # the time each covers (gpu/samples.py); None: the backend has no samples (share x interval)
    kernel_seconds: float | None = None


@dataclass(frozen=True)
class GpuSweep:
    """Everything the GPU backend read in one sweep (one call per interval)."""

    timestamp_s: float
    devices: tuple[DeviceInfo, ...]
    processes: tuple[GpuProcess, ...]
    driver_version: str | None = None
    cuda_driver_version: int | None = None
    errors: tuple[str, ...] = ()
    topology: GpuTopology | None = None


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
    # the process's cgroup v2 path (what the kernel probes key its counters by); None: no v2
    # line. On hybrid hosts it can differ from identity.cgroup_path (a v1 line named the container)
    unified_path: str | None = None


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
    # nvidia-uvm ioctls by their bare number (hex), apart from the RM escapes whose numbers they
    # collide with; managed memory itself is not RM bytes (issue 11)
    uvm_ioctl_calls_by_cmd: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class ProcessProbe:
    """One process's live bytes as the probes keep them per process (gw_tgids), with the
    cgroup its per-cgroup counters go to. Read only where the per-cgroup counters cannot be
    joined to containers whole (pipeline/probe_join.py: hybrid hosts)."""

    tgid: int
    cgroup_id: int
    allocated_bytes_by_gpu: tuple[tuple[int, int], ...] = ()  # decoded RM video memory (GPU -1: unknown)
    cuda_allocated_bytes: int = 0  # libcuda uprobe bytes


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
class GpuHealth:
    """The health verdict for one GPU (signals/health.py decides it)."""

    index: int
    uuid: str
    healthy: bool
    reason: str  # "ok", "xid", "lost", "ecc-uncorrectable", "row-remap-failure", "nvml-errors"
    detail: str = ""  # human sentence: "XID 79 (fallen off the bus)"
    transitions_total: int = 0
    xid: int | None = None  # the Xid that made it unhealthy


@dataclass(frozen=True)
class NicStats:
    """One network interface of the node (signals/network.py)."""

    device: str
    operstate: str  # "up", "down", "unknown", ...
    speed_bytes_per_second: float | None  # link speed; None: unknown (virtual NICs, no carrier)
    receive_bytes_total: int
    transmit_bytes_total: int
    rdma: bool = False  # an RDMA device (InfiniBand / RoCE) is bound to it


@dataclass(frozen=True)
class RdmaPort:
    """One port of an RDMA device under /sys/class/infiniband."""

    device: str
    port: int
    state: str  # "ACTIVE", "DOWN", ...
    rate_bytes_per_second: float | None
    receive_bytes_total: int | None
    transmit_bytes_total: int | None
    link_layer: str = ""  # "InfiniBand" or "Ethernet" (RoCE)


@dataclass(frozen=True)
class ContainerXid:
    """Xid errors the kernel log attributes to one container's processes on one GPU."""

    identity: ContainerIdentity
    gpu_index: int
    xid: int
    count: int


@dataclass(frozen=True)
class ContainerNetwork:
    """Bytes through the network namespace of a container that uses a GPU (all its NICs but lo)."""

    identity: ContainerIdentity
    receive_bytes_total: int
    transmit_bytes_total: int


@dataclass(frozen=True)
class NodeSignals:
    """Node facts for schedulers, built once per interval beside the usage snapshot."""

    health: tuple[GpuHealth, ...] = ()
    topology: GpuTopology | None = None
    nics: tuple[NicStats, ...] = ()
    rdma_ports: tuple[RdmaPort, ...] = ()
    container_xids: tuple[ContainerXid, ...] = ()
    container_network: tuple[ContainerNetwork, ...] = ()
    errors_total: tuple[tuple[str, int], ...] = ()  # (source, count): kmsg, network, netns, ...
    kmsg_malformed_total: int = 0


@dataclass(frozen=True)
class ContainerProgress:
    """One container's evaluation function (gpuwatch.io/progress-file), read this interval.

    Read by gpuwatch/signals/progress.py; `value` is the last good value (kept when a read
    fails), rates cover the last `window_s` seconds of good reads and are signed so that
    positive is progress in the goal's direction. None = not known (yet)."""

    identity: ContainerIdentity
    path: str  # the file, as the container sees it
    goal: str = "minimize"  # or "maximize"
    value: float | None = None
    updated_s: float | None = None  # sampler clock (monotonic) of the last good read
    rate_per_gpu_second: float | None = None  # evaluation gained per GPU-second of the container
    rate_per_second: float | None = None  # evaluation gained per wall second
    window_s: float = 0.0  # wall time the rates span
    window_kernel_seconds: float = 0.0  # the container's GPU-seconds in that span
    kernel_seconds_total: float = 0.0  # the container's kernel seconds on all its GPUs, now
    first_value: float | None = None  # the first good value read, and
    first_kernel_seconds: float | None = None  # the container's kernel seconds at that read
    reads_total: int = 0
    errors_total: int = 0
    errors_by_reason: tuple[tuple[str, int], ...] = ()  # (reason, count), signals.progress.ERROR_REASONS
    last_error: str = ""  # why the last read failed; "" when it succeeded

    @property
    def direction(self) -> float:
        """+1 when larger values are better (maximize), -1 when smaller are (minimize)."""
        return 1.0 if self.goal == "maximize" else -1.0


@dataclass(frozen=True)
class ContainerEnforcement:
    """What the enforcer does to one container now (enforce/enforcer.py builds it after each
    snapshot; the agent serves it in /snapshot.json so `gpuwatch top` shows why a job is slow).

    `state`: "running", "throttled" (to `time_share` of a GPU), "paused", "waiting-memory"
    (paused until its pending allocation fits: rescheduling) or "checkpointing"."""

    identity: ContainerIdentity
    state: str = "running"
    reason: str = ""
    rule: str = ""  # the rule or mechanism behind the state: a rule name, "elastic", "fair-share"
    memory_limit_bytes: int | None = None  # what it may hold: rule limit, or its fair-share allowance
    memory_fair_share_bytes: int | None = None  # its fair share while its GPU is oversubscribed
    pending_bytes: int = 0  # an allocation waiting for admission
    waiting_s: float | None = None  # how long it has waited for memory
    time_share: float | None = None  # throttle target (fraction of one GPU); None: not throttled
    measured_share: float | None = None  # the throttle's measured share
    elastic_share: float | None = None  # its part of the GPU in the elastic division
    elastic_role: str = ""  # gaining, yielding, plateaued, fair, measuring, fixed, alone
    growth_efficiency: float | None = None  # progress per GPU-second / its early rate


@dataclass(frozen=True)
class ProbeNvmlComparison:
    """One container's probe counter and NVML number in one interval (None: not known);
    computed once per interval by the pipeline (core/probe_nvml.py), read by the exporter
    (divergence metric) and the enforcer (the in-kernel limit's safety net)."""

    identity: ContainerIdentity
    probe_bytes: int | None
    nvml_bytes: int | None

    @property
    def judgeable(self) -> bool:
        return self.probe_bytes is not None and self.nvml_bytes is not None

    @property
    def divergence_bytes(self) -> int | None:
        """Probe minus NVML (positive: the probes count more than the driver holds)."""
        if self.probe_bytes is None or self.nvml_bytes is None:
            return None
        return self.probe_bytes - self.nvml_bytes


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
    signals: NodeSignals | None = None
    driver_version: str | None = None
    cuda_driver_version: int | None = None
    progress: tuple[ContainerProgress, ...] = ()  # per container that declared a progress file
    enforcement: tuple[ContainerEnforcement, ...] = ()  # the enforcer's view (agent with --policy)
    kernel_time_scaled: tuple[tuple[str, int], ...] = ()  # (gpu uuid, sweeps scaled to its busy time)
    probe_nvml: tuple[ProbeNvmlComparison, ...] | None = field(default=None, compare=False)
    """The probe vs NVML comparison of this interval, made once by the sampler (None: a snapshot
    built elsewhere or read back from JSON; core.probe_nvml.probe_nvml_of computes it then).
    Derived from the fields above, so it takes no part in equality."""


EMPTY_SNAPSHOT = Snapshot(timestamp_s=0.0, node="", devices=(), containers=(), gpu_up=False)
