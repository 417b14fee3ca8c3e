"""The cluster view of `gpuwatch top --prometheus`: every node's GPUs and containers as
Prometheus has them, on the same screen as the local view.

`ClusterSnapshot` is a Snapshot of the whole cluster: its ``nodes`` hold one Snapshot per
node (built from the cluster model by `node_snapshot`), and its own devices and
containers are all of theirs, so the screen loop, the counts in the title and the
`--once` table work unchanged; the row builder and the renderer group by node where a
ClusterSnapshot is given (GPU sections per node, a NODE column). What Prometheus does not
carry is absent, not made up: processes (per-process data stays on the node: `gpuwatch
top --agent`), temperature and power.

`ClusterSource` is the `SnapshotSource` over a PrometheusReader; `cluster_document` is the
`--once --json` document.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuwatch.cluster.queries import build_state, cluster_queries, simulated_nodes
from gpuwatch.cluster.values import ClusterContainer, ClusterNode, ClusterState
from gpuwatch.core.errors import GpuwatchError
from gpuwatch.core.model import ContainerIdentity, ContainerUsage, DeviceInfo, Snapshot
from gpuwatch.core.snapshot_doc import iso_time

if TYPE_CHECKING:
    from gpuwatch.cluster.prometheus import PrometheusReader

FORMAT = "gpuwatch.cluster/1"

STALE_AFTER_S = 120.0
"""A node whose newest sample is older than this gets a note (Prometheus still returns it
for up to 5 minutes after its agent went away without a staleness marker)."""

FIX_SCRAPE = ("check that Prometheus scrapes the gpuwatch agents (deploy/ has the ServiceMonitor; "
              "Status > Targets in the Prometheus UI lists them) and that they run with --node=<node name>")


@dataclass(frozen=True)
class ClusterSnapshot(Snapshot):
    """Every node's Snapshot (``nodes``, sorted by name) read from Prometheus at ``source``.

    ``timestamp_s`` is the Unix time of the read; devices/containers are all the nodes'.
    """

    nodes: tuple[Snapshot, ...] = ()
    source: str = ""


def is_cluster(snapshot: Snapshot) -> bool:
    return isinstance(snapshot, ClusterSnapshot)


def node_parts(snapshot: Snapshot) -> tuple[tuple[str, Snapshot], ...]:
    """(node name, its Snapshot) per node of a cluster snapshot; ("", snapshot) for a local one."""
    if isinstance(snapshot, ClusterSnapshot):
        return tuple((part.node, part) for part in snapshot.nodes)
    return (("", snapshot),)


# --------------------------------------------------------------------------- model -> Snapshot


def _int(value: float | None) -> int | None:
    return round(value) if value is not None and math.isfinite(value) else None


def _nan(value: float | None) -> float:
    return value if value is not None else math.nan  # N/A on screen, sorted last


def container_identity(c: ClusterContainer) -> ContainerIdentity:
    """The identity the agent's labels describe (a non-container cgroup is exported with its
    cgroup path as ``container`` and no id)."""
    if not c.container_id:
        return ContainerIdentity(runtime="host", cgroup_path=c.container or "/")
    return ContainerIdentity(runtime="", cgroup_path="",  # the runtime is not in the metrics
                             container_id=c.container_id, container_name=c.container, pod_name=c.pod,
                             pod_namespace=c.namespace, pod_uid=c.pod_uid)


def node_snapshot(node: ClusterNode, fetched_at_s: float, simulated: bool = False) -> Snapshot:
    """One node of the cluster model as the Snapshot the `top` rows are built from."""
    devices = tuple(DeviceInfo(
        index=g.index, uuid=g.uuid, name=g.model or "?", pci_bus_id=None,
        memory_total_bytes=_int(g.memory_total_bytes), memory_used_bytes=_int(g.memory_used_bytes),
        memory_free_bytes=_int(g.memory_free_bytes), utilization_gpu_ratio=g.utilization_ratio,
        healthy=g.healthy, simulated=simulated) for g in node.gpus)
    uuids = {g.index: g.uuid for g in node.gpus}
    containers = tuple(ContainerUsage(
        identity=container_identity(c), gpu_index=c.gpu, gpu_uuid=uuids.get(c.gpu, ""),
        memory_bytes=_int(c.memory_bytes) or 0, sm_utilization_ratio=_nan(c.sm_utilization_ratio),
        kernel_seconds_total=_nan(c.kernel_seconds_total)) for c in node.containers)
    return Snapshot(timestamp_s=node.last_scrape_s if node.last_scrape_s is not None else fetched_at_s,
                    node=node.name, devices=devices, containers=containers, gpu_up=node.backend_up,
                    simulated=simulated)


def node_notes(state: ClusterState, stale_after_s: float = STALE_AFTER_S) -> tuple[str, ...]:
    """What the view must say about nodes: GPU backend down, stale data, unhealthy GPUs."""
    notes: list[str] = []
    for node in state.nodes.values():
        if not node.backend_up:
            notes.append(f"node {node.name}: GPU backend (NVML) down; run `gpuwatch doctor` on the node")
        if node.last_scrape_s is None:
            notes.append(f"node {node.name}: scrape time unknown (no gpuwatch_gpu_backend_up)")
        elif state.fetched_at_s - node.last_scrape_s > stale_after_s:
            notes.append(f"node {node.name}: data is {state.fetched_at_s - node.last_scrape_s:.0f}s old "
                         "(agent or scrape down?)")
        for g in node.gpus:
            if not g.healthy:
                reason = f"Xid {g.xid}" if g.xid is not None else g.reason
                notes.append(f"node {node.name} GPU {g.index}: unhealthy ({reason})")
    return tuple(notes)


def filter_namespace(state: ClusterState, namespace: str | None) -> ClusterState:
    """Only ``namespace``'s containers, on only the GPUs and nodes they use (None: all)."""
    if namespace is None:
        return state
    nodes: dict[str, ClusterNode] = {}
    for name, node in state.nodes.items():
        kept = tuple(c for c in node.containers if c.namespace == namespace)
        if not kept:
            continue
        used = {c.gpu for c in kept}
        nodes[name] = dataclasses.replace(node, containers=kept, gpus=tuple(g for g in node.gpus if g.index in used))
    return dataclasses.replace(
        state, nodes=nodes,
        namespace_memory_bytes={k: v for k, v in state.namespace_memory_bytes.items() if k == namespace},
        namespace_quota_bytes={k: v for k, v in state.namespace_quota_bytes.items() if k == namespace})


def cluster_snapshot(state: ClusterState, simulated: frozenset[str] = frozenset(), source: str = "",
                     stale_after_s: float = STALE_AFTER_S) -> ClusterSnapshot:
    """The whole cluster as one ClusterSnapshot (nodes sorted by name)."""
    parts = tuple(node_snapshot(node, state.fetched_at_s, node.name in simulated)
                  for _, node in sorted(state.nodes.items()))
    notes = node_notes(state, stale_after_s)
    sim = sorted(simulated & set(state.nodes))
    if sim:
        notes = (f"simulated GPU nodes (gpuwatch sim): {', '.join(sim)}", *notes)
    up = [p for p in parts if p.gpu_up]
    return ClusterSnapshot(
        timestamp_s=state.fetched_at_s, node="", source=source, nodes=parts,
        devices=tuple(d for p in parts for d in p.devices),
        containers=tuple(c for p in parts for c in p.containers),
        gpu_up=bool(up) or not parts,
        gpu_error=None if up or not parts else "the GPU backend is down on every node (fix: run `gpuwatch "
                                               "doctor` on a node)",
        simulated=bool(sim), notes=notes)


# --------------------------------------------------------------------------- JSON


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def container_matches(node: str, c: ClusterContainer, text: str) -> bool:
    """`--filter`: case-insensitive substring of node, namespace, pod, container or id."""
    needle = text.strip().casefold()
    return not needle or any(needle in f.casefold() for f in (node, c.namespace, c.pod, c.container,
                                                              c.container_id))


def cluster_document(state: ClusterState, simulated: frozenset[str] = frozenset(), source: str = "",
                     filter_text: str = "") -> dict[str, Any]:
    """The `gpuwatch top --prometheus --once --json` document (one for the whole cluster)::

        {"format": "gpuwatch.cluster/1", "prometheus": URL, "time": ISO, "fetched_at_s": ...,
         "nodes": [{"name", "simulated", "backend_up", "last_scrape_s", "last_scrape", "age_s",
                    "network_speed_bytes", "network_throughput_bytes", "rdma",
                    "gpus": [{"index", "uuid", "model", "memory_total_bytes", "memory_used_bytes",
                              "memory_free_bytes", "utilization_ratio", "healthy", "reason", "xid",
                              "tenants", "exclusive",
                              "outside_pod": [{"pid", "comm", "cgroup", "memory_bytes"}]}],
                    "pair_scores": [{"gpu", "peer", "score"}],
                    "containers": [{"gpu", "namespace", "pod", "pod_uid", "container",
                                    "container_id", "memory_bytes", "sm_utilization_ratio",
                                    "kernel_seconds_total"}]}],
         "namespaces": [{"namespace", "memory_bytes", "quota_bytes"}]}

    Values Prometheus did not have are null. ``filter_text`` keeps matching containers only.
    """
    nodes = []
    for name, node in sorted(state.nodes.items()):
        gpus = [{k: v for k, v in dataclasses.asdict(g).items() if k != "node"} for g in node.gpus]
        containers = [{k: _finite(v) if isinstance(v, float) else v for k, v in dataclasses.asdict(c).items()
                       if k != "node"}
                      for c in node.containers if container_matches(name, c, filter_text)]
        for g in gpus:
            for key in ("memory_total_bytes", "memory_used_bytes", "memory_free_bytes", "utilization_ratio"):
                g[key] = _finite(g[key])
            g["outside_pod"] = list(g["outside_pod"])
        nodes.append({
            "name": name, "simulated": name in simulated, "backend_up": node.backend_up,
            "last_scrape_s": node.last_scrape_s,
            "last_scrape": iso_time(node.last_scrape_s) if node.last_scrape_s is not None else None,
            "age_s": (state.fetched_at_s - node.last_scrape_s) if node.last_scrape_s is not None else None,
            "network_speed_bytes": _finite(node.network_speed_bytes),
            "network_throughput_bytes": _finite(node.network_throughput_bytes), "rdma": node.rdma,
            "gpus": gpus,
            "pair_scores": [{"gpu": a, "peer": b, "score": s} for a, b, s in node.pair_scores],
            "containers": containers,
        })
    namespaces = sorted(set(state.namespace_memory_bytes) | set(state.namespace_quota_bytes))
    return {
        "format": FORMAT, "prometheus": source, "time": iso_time(state.fetched_at_s),
        "fetched_at_s": state.fetched_at_s, "nodes": nodes,
        "namespaces": [{"namespace": ns, "memory_bytes": _finite(state.namespace_memory_bytes.get(ns)),
                        "quota_bytes": _finite(state.namespace_quota_bytes.get(ns))} for ns in namespaces],
    }


# --------------------------------------------------------------------------- source


class NoClusterData(GpuwatchError):
    """Prometheus answered, but has no gpuwatch series (for the node asked for)."""


class ClusterSource:
    """`SnapshotSource` over Prometheus: one batch of cluster queries per refresh.

    ``node`` scopes the queries to one node; ``namespace`` keeps that namespace's
    containers (and the GPUs and nodes they use). `read()` gives the model itself (for
    `--json`); `next_snapshot()` the screen's ClusterSnapshot. Raises `PrometheusError`
    when Prometheus fails and `NoClusterData` when it has nothing from gpuwatch.
    """

    def __init__(self, reader: PrometheusReader, node: str | None = None, namespace: str | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.reader = reader
        self.node = node
        self.namespace = namespace
        self.queries = cluster_queries(node)
        self._wall_clock = wall_clock

    def read(self) -> tuple[ClusterState, frozenset[str]]:
        """(the cluster, the names of simulated nodes), filtered by namespace."""
        results = self.reader.query_batch(self.queries)
        state = build_state(results, self._wall_clock())
        if not state.nodes:
            where = f" for node {self.node!r}" if self.node else ""
            fix = (f"check the node name (without --node the view lists every node Prometheus has); {FIX_SCRAPE}"
                   if self.node else FIX_SCRAPE)
            raise NoClusterData(f"Prometheus at {self.reader.url} has no gpuwatch data{where} "
                                "(no gpuwatch_* series)", fix=fix)
        return filter_namespace(state, self.namespace), simulated_nodes(results)

    def next_snapshot(self) -> Snapshot:
        state, simulated = self.read()
        return cluster_snapshot(state, simulated, source=self.reader.url)

    def close(self) -> None:
        self.reader.close()
