"""The cluster as Prometheus knows it: immutable values built from one batch of queries.

Everything here is what the node agents export (gpuwatch_* metrics), regrouped per node.
A value Prometheus did not have is ``None``, never a made-up zero. Times are Unix seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class OutsidePod:
    """A process on a GPU outside any pod (gpuwatch_gpu_process_outside_pod_memory_bytes)."""

    pid: int
    comm: str
    cgroup: str
    memory_bytes: float

    def describe(self) -> str:
        from gpuwatch.core.units import format_bytes

        return f"pid {self.pid} {self.comm} outside any pod ({self.cgroup or '/'}, {format_bytes(self.memory_bytes)})"


@dataclass(frozen=True)
class ClusterGpu:
    """One physical GPU of one node."""

    node: str
    index: int
    uuid: str = ""
    model: str = ""
    memory_total_bytes: float | None = None
    memory_used_bytes: float | None = None
    memory_free_bytes: float | None = None
    utilization_ratio: float | None = None
    healthy: bool = True
    reason: str = "ok"  # gpuwatch_gpu_healthy's reason label
    xid: int | None = None  # the Xid that made it unhealthy (reason "xid")
    tenants: int = 0  # tenants holding memory or running on it: containers and non-pod cgroups
    exclusive: bool = False  # a running container holds it with gpuwatch.io/sharing: exclusive
    outside_pod: tuple[OutsidePod, ...] = ()  # processes on it that belong to no pod, largest first


@dataclass(frozen=True)
class ClusterContainer:
    """One container's use of one GPU on one node (gpuwatch_container_* series)."""

    node: str
    gpu: int
    namespace: str
    pod: str
    pod_uid: str
    container: str
    container_id: str
    memory_bytes: float
    sm_utilization_ratio: float | None = None
    kernel_seconds_total: float | None = None


@dataclass(frozen=True)
class ClusterNode:
    """One node: its GPUs, their topology, its network, and how fresh its data is."""

    name: str
    gpus: tuple[ClusterGpu, ...] = ()
    # (gpu, peer) -> NVIDIA allocator pair score (gpuwatch_gpu_pair_score), both orders
    pair_scores: tuple[tuple[int, int, float], ...] = ()
    backend_up: bool = True  # gpuwatch_gpu_backend_up
    last_scrape_s: float | None = None  # Unix time of the newest sample of this node
    network_speed_bytes: float | None = None  # fastest NIC that is up, bytes/s
    network_throughput_bytes: float | None = None  # rx + tx of the node's NICs, recent rate, bytes/s
    rdma: bool = False  # an RDMA port is ACTIVE or a NIC is bound to an RDMA device
    containers: tuple[ClusterContainer, ...] = ()

    def pair_score(self, gpu: int, peer: int) -> float:
        for a, b, score in self.pair_scores:
            if a == gpu and b == peer:
                return score
        return 0.0


@dataclass(frozen=True)
class ClusterState:
    """Every node Prometheus has gpuwatch data for, plus namespace totals and quotas."""

    nodes: dict[str, ClusterNode] = field(default_factory=dict)
    namespace_memory_bytes: dict[str, float] = field(default_factory=dict)  # summed over nodes
    namespace_quota_bytes: dict[str, float] = field(default_factory=dict)  # policy quotas the agents export
    fetched_at_s: float = 0.0  # Unix time the batch was read
