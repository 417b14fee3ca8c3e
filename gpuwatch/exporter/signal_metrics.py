"""Metric families for the node signals schedulers read (health, topology, network, node rollups).

Who reads what:
* `gpuwatch_gpu_healthy{reason}`, `gpuwatch_node_gpus_healthy` -- alert rules, the
  extender's filter, NFD labels/taints (through the feature file, not Prometheus);
* `gpuwatch_gpu_pair_score{gpu,peer}` (NVIDIA allocator's pair table),
  `gpuwatch_gpu_topology_level`, `gpuwatch_gpu_nvlink_links` -- topology-aware placement;
* `gpuwatch_node_gpu_memory_used_ratio`, `gpuwatch_node_gpu_utilization_ratio` (0..1) --
  the recording rules the descheduler and crane-scheduler query (dashboards/gpuwatch-rules.yml);
* `gpuwatch_node_network_*`, `gpuwatch_node_rdma_port_*`, `gpuwatch_container_network_*` --
  network-aware placement of remote-GPU pods, and who uses the network;
* `gpuwatch_container_xid_errors_total{xid}` -- which pod's process caused which Xid.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuwatch.core.labels import CONTAINER_LABELS, GPU_LABELS, PROBE_LABELS, gpu_label, identity_labels
from gpuwatch.core.model import Snapshot
from gpuwatch.exporter.families import FieldFamily, as_metrics, fill, new_families
from gpuwatch.signals.topology import pair_score

PAIR_LABELS = ["node", "gpu", "peer"]


def signal_families(s: Snapshot) -> list[Metric]:
    """Every signal family for one snapshot (empty families are fine: they export nothing)."""
    return [*_node_rollups(s), *_health(s), *_topology(s), *_network(s), *_container_xids(s), *_errors(s)]


def _node_rollups(s: Snapshot) -> list[Metric]:
    labels = [s.node]
    physical = [d for d in s.devices if not d.is_mig]
    memory_ratio = GaugeMetricFamily("gpuwatch_node_gpu_memory_used_ratio",
                                     "GPU memory in use over GPU memory size, all GPUs of the node (0-1).",
                                     labels=["node"])
    totals = [(d.memory_used_bytes, d.memory_total_bytes) for d in physical
              if d.memory_used_bytes is not None and d.memory_total_bytes]
    if totals:
        memory_ratio.add_metric(labels, min(1.0, sum(u for u, _ in totals) / sum(t for _, t in totals if t)))
    util_ratio = GaugeMetricFamily("gpuwatch_node_gpu_utilization_ratio",
                                   "Mean GPU utilisation over the node's GPUs (0-1).", labels=["node"])
    utils = [d.utilization_gpu_ratio for d in physical if d.utilization_gpu_ratio is not None]
    if utils:
        util_ratio.add_metric(labels, min(1.0, sum(utils) / len(utils)))
    health = s.signals.health if s.signals is not None else ()
    count = GaugeMetricFamily("gpuwatch_node_gpus", "Physical GPUs of the node (last known while NVML is down).",
                              labels=["node"])
    healthy = GaugeMetricFamily("gpuwatch_node_gpus_healthy", "Physical GPUs of the node that are healthy.",
                                labels=["node"])
    if health:
        count.add_metric(labels, len(health))
        healthy.add_metric(labels, sum(1 for h in health if h.healthy))
    elif physical:
        count.add_metric(labels, len(physical))
        healthy.add_metric(labels, sum(1 for d in physical if d.healthy))
    return [memory_ratio, util_ratio, count, healthy]


def _health(s: Snapshot) -> list[Metric]:
    transitions = CounterMetricFamily("gpuwatch_gpu_health_transitions",
                                      "Changes of the GPU's healthy flag since the agent started.",
                                      labels=GPU_LABELS)
    if s.signals is None:
        return [transitions]
    by_index = {h.index: h for h in s.signals.health}
    for d in s.devices:
        verdict = by_index.get(d.index)
        if verdict is not None and not d.is_mig:
            transitions.add_metric([s.node, gpu_label(d), d.uuid, d.name], verdict.transitions_total)
    return [transitions]


def health_reason(s: Snapshot, index: int, healthy: bool) -> tuple[str, str]:
    """The `reason` and `xid` labels of gpuwatch_gpu_healthy ("ok", "" when healthy)."""
    if s.signals is not None:
        for verdict in s.signals.health:
            if verdict.index == index:
                return verdict.reason, str(verdict.xid) if verdict.xid is not None else ""
    return ("ok" if healthy else "unhealthy"), ""


def _topology(s: Snapshot) -> list[Metric]:
    level = GaugeMetricFamily("gpuwatch_gpu_topology_level",
                              "PCIe common ancestor of two GPUs, NVML's level (0 board, 10 one switch, 20 several "
                              "switches, 30 host bridge, 40 NUMA node, 50 across CPUs).", labels=PAIR_LABELS)
    nvlinks = GaugeMetricFamily("gpuwatch_gpu_nvlink_links", "Active NVLinks between two GPUs.", labels=PAIR_LABELS)
    score = GaugeMetricFamily("gpuwatch_gpu_pair_score",
                              "NVIDIA allocator's pair score (10 cross-CPU .. 60 same board, +100 per NVLink).",
                              labels=PAIR_LABELS)
    topology = s.signals.topology if s.signals is not None else None
    if topology is None:
        return [level, nvlinks, score]
    for link in topology.links:
        labels = [s.node, str(link.gpu_index), str(link.peer_index)]
        if link.level is not None:
            level.add_metric(labels, int(link.level))
        if topology.nvlink_supported:
            nvlinks.add_metric(labels, link.nvlinks)
        score.add_metric(labels, pair_score(link))
    return [level, nvlinks, score]


_NIC_LABELS = ["node", "device"]
_PORT_LABELS = ["node", "device", "port", "link_layer"]
_NIC_FAMILIES = (
    FieldFamily("gpuwatch_node_network_receive_bytes", "Bytes received by the node's NIC.", "receive_bytes_total",
                counter=True),
    FieldFamily("gpuwatch_node_network_transmit_bytes", "Bytes sent by the node's NIC.", "transmit_bytes_total",
                counter=True),
    FieldFamily("gpuwatch_node_network_speed_bytes", "Link speed of the NIC in bytes per second.",
                "speed_bytes_per_second", optional=True),
)
_PORT_FAMILIES = (
    FieldFamily("gpuwatch_node_rdma_port_rate_bytes", "RDMA port rate in bytes per second.", "rate_bytes_per_second",
                optional=True),
    FieldFamily("gpuwatch_node_rdma_port_receive_bytes", "Bytes received on the RDMA port.", "receive_bytes_total",
                counter=True, optional=True),
    FieldFamily("gpuwatch_node_rdma_port_transmit_bytes", "Bytes sent on the RDMA port.", "transmit_bytes_total",
                counter=True, optional=True),
)
_CONTAINER_NETWORK_FAMILIES = (
    FieldFamily("gpuwatch_container_network_receive_bytes",
                "Bytes received in the network namespace of a container that uses a GPU.", "receive_bytes_total",
                counter=True),
    FieldFamily("gpuwatch_container_network_transmit_bytes",
                "Bytes sent from the network namespace of a container that uses a GPU.", "transmit_bytes_total",
                counter=True),
)


def _network(s: Snapshot) -> list[Metric]:
    nics = new_families(_NIC_FAMILIES, _NIC_LABELS)
    up = GaugeMetricFamily("gpuwatch_node_network_up", "1 if the NIC's operstate is up.",
                           labels=[*_NIC_LABELS, "operstate", "rdma"])
    ports = new_families(_PORT_FAMILIES, _PORT_LABELS)
    port_up = GaugeMetricFamily("gpuwatch_node_rdma_port_up", "1 if the RDMA port is ACTIVE.",
                                labels=[*_PORT_LABELS, "state"])
    containers = new_families(_CONTAINER_NETWORK_FAMILIES, PROBE_LABELS)
    families: list[Metric] = [*as_metrics(nics), up, port_up, *as_metrics(ports), *as_metrics(containers)]
    if s.signals is None:
        return families
    for nic in s.signals.nics:
        labels = [s.node, nic.device]
        fill(nics, labels, nic)
        up.add_metric([*labels, nic.operstate, str(nic.rdma).lower()], 1.0 if nic.operstate == "up" else 0.0)
    for port in s.signals.rdma_ports:
        labels = [s.node, port.device, str(port.port), port.link_layer]
        port_up.add_metric([*labels, port.state], 1.0 if port.state == "ACTIVE" else 0.0)
        fill(ports, labels, port)
    for net in s.signals.container_network:
        fill(containers, [s.node, *identity_labels(net.identity)], net)
    return families


def _container_xids(s: Snapshot) -> list[Metric]:
    xids = CounterMetricFamily("gpuwatch_container_xid_errors",
                               "Xid errors the kernel log attributes to the container's processes, by Xid.",
                               labels=[*CONTAINER_LABELS, "xid"])
    if s.signals is None:
        return [xids]
    devices = {d.index: d for d in s.devices if not d.is_mig}
    for entry in s.signals.container_xids:
        device = devices.get(entry.gpu_index)
        labels = [s.node, str(entry.gpu_index), device.uuid if device else "", device.name if device else "",
                  *identity_labels(entry.identity), str(entry.xid)]
        xids.add_metric(labels, entry.count)
    return [xids]


def _errors(s: Snapshot) -> list[Metric]:
    errors = CounterMetricFamily("gpuwatch_signal_errors",
                                 "Errors of the node-signal sources (kernel log, network, Xid attribution).",
                                 labels=["node", "source"])
    malformed = CounterMetricFamily("gpuwatch_kmsg_malformed_lines",
                                    "Kernel-log lines that mention an Xid but could not be parsed.", labels=["node"])
    if s.signals is not None:
        for source, count in s.signals.errors_total:
            errors.add_metric([s.node, source], count)
        malformed.add_metric([s.node], s.signals.kmsg_malformed_total)
    return [errors, malformed]
