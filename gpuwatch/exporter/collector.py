"""Prometheus collector over the latest Snapshot (prometheus client_python custom Collector).

Every scrape builds fresh metric families from the one published Snapshot, so series of
exited containers disappear by themselves -- there is no `.remove()` bookkeeping and no
state shared with the sampler beyond the snapshot reference.

Naming follows Prometheus conventions: `gpuwatch_` prefix, base units in the name
(`_bytes`, `_seconds`, `_celsius`, `_watts`, `_ratio`), counters end in `_total`.
Labels:
  per GPU:        node, gpu, uuid, model
  per container:  node, gpu, uuid, model, namespace, pod, pod_uid, container, container_id
  per pod:        node, namespace, pod, pod_uid
  per namespace:  node, namespace
Sharing (`_sharing`): gpuwatch_gpu_tenants and gpuwatch_gpu_exclusive per GPU (GPU labels).
Progress (exporter/progress_metrics.py): gpuwatch_container_progress and _rate per container that
declared an evaluation function (container labels without the GPU).
Cross-check (exporter/crosscheck_metrics.py): gpuwatch_container_probe_nvml_divergence_bytes per
container (probe live bytes minus NVML memory, container labels without the GPU).
A cgroup that is not a container (host processes, systemd services) is exported with
``container`` = its cgroup path and an empty ``container_id``, so its series stay
distinct. A field the GPU backend could not read (N/A) is left out, never exported as 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwatch import __version__
from gpuwatch.core.labels import (
    CONTAINER_LABELS,
    GPU_LABELS,
    NAMESPACE_LABELS,
    POD_LABELS,
    PROBE_LABELS,
    gpu_label,
    identity_labels,
)
from gpuwatch.core.model import Snapshot
from gpuwatch.exporter.crosscheck_metrics import crosscheck_families
from gpuwatch.exporter.families import FieldFamily, as_metrics, fill, new_families
from gpuwatch.exporter.progress_metrics import progress_families
from gpuwatch.exporter.signal_metrics import health_reason, signal_families
from gpuwatch.policy.sharing import exclusive_holders, gpu_tenants, gpu_users, outside_pod_processes

log = logging.getLogger(__name__)

# Per container and GPU (ContainerUsage fields; gpuwatch_container_processes is counted by hand).
_CONTAINER_FAMILIES = (
    FieldFamily("gpuwatch_container_memory_bytes", "GPU memory held by the container's processes on this GPU.",
                "memory_bytes"),
    FieldFamily("gpuwatch_container_sm_utilization_ratio",
                "The container's kernel seconds on this GPU over the last interval (0-1).", "sm_utilization_ratio"),
    FieldFamily("gpuwatch_container_kernel_seconds",
                "GPU seconds the container's processes ran on this GPU (NVML's samples by "
                "the time each covers, at most the GPU's busy time).", "kernel_seconds_total", counter=True),
)


def _group_families(level: str) -> tuple[FieldFamily, ...]:
    """Per pod or per namespace (GroupUsage fields), all GPUs."""
    return (
        FieldFamily(f"gpuwatch_{level}_memory_bytes", f"GPU memory held by the {level}'s containers, all GPUs.",
                    "memory_bytes"),
        FieldFamily(f"gpuwatch_{level}_sm_utilization_ratio",
                    f"Sum of the {level}'s SM utilisation over its GPUs (2 = two full GPUs).", "sm_utilization_ratio"),
        FieldFamily(f"gpuwatch_{level}_kernel_seconds", f"Kernel (SM) seconds of the {level}, all GPUs.",
                    "kernel_seconds_total", counter=True),
        FieldFamily(f"gpuwatch_{level}_containers", f"Containers of the {level} using a GPU.", "containers"),
    )


# The per-cgroup probe families, in exposition order (ProbeCounters fields; the cuda_* group is
# left out where the libcuda uprobes are off, i.e. cuda_allocated_bytes is None).
_PROBE_FAMILIES = (
    FieldFamily("gpuwatch_container_ioctl_calls", "NVIDIA driver ioctls by the container, by operation.",
                "ioctl_calls_by_op", counter=True, by="op"),
    FieldFamily("gpuwatch_container_uvm_ioctl_calls", "nvidia-uvm ioctls by the container, by bare command number "
                "(managed memory; not RM allocations).", "uvm_ioctl_calls_by_cmd", counter=True, by="cmd"),
    FieldFamily("gpuwatch_container_ioctl_failures", "NVIDIA driver ioctls that returned an error.",
                "ioctl_failures_total", counter=True),
    FieldFamily("gpuwatch_container_ioctl_op_failures", "NVIDIA driver ioctls that returned an error, by operation.",
                "ioctl_failures_by_op", counter=True, by="op"),
    FieldFamily("gpuwatch_container_allocations", "GPU memory allocations seen by the probes.", "allocations_total",
                counter=True),
    FieldFamily("gpuwatch_container_frees", "GPU memory frees seen by the probes.", "frees_total", counter=True),
    FieldFamily("gpuwatch_container_allocation_failures", "GPU memory allocations that failed.",
                "allocation_failures_total", counter=True),
    FieldFamily("gpuwatch_container_kernel_launches", "Kernel launches seen by the probes.", "launches_total",
                counter=True, optional=True),
    FieldFamily("gpuwatch_container_graph_launches", "CUDA graph launches seen by the libcuda probes.",
                "graph_launches_total", counter=True, optional=True),
    FieldFamily("gpuwatch_container_allocated_bytes",
                "Live GPU memory allocated per decoded driver ioctls (gpu -1: unknown).", "allocated_bytes_by_gpu",
                by="gpu"),
    FieldFamily("gpuwatch_container_cuda_allocated_bytes",
                "Live GPU memory allocated through libcuda, per the uprobes.", "cuda_allocated_bytes",
                gate="cuda_allocated_bytes"),
    FieldFamily("gpuwatch_container_cuda_allocations", "libcuda allocation calls.", "cuda_allocations_total",
                counter=True, gate="cuda_allocated_bytes"),
    FieldFamily("gpuwatch_container_cuda_frees", "libcuda free calls.", "cuda_frees_total", counter=True,
                gate="cuda_allocated_bytes"),
    FieldFamily("gpuwatch_container_cuda_out_of_memory", "libcuda allocations that failed with out-of-memory.",
                "cuda_oom_total", counter=True, gate="cuda_allocated_bytes"),
)


class SnapshotCollector(Collector):
    """Yields gpuwatch_* metric families built from `get_snapshot()` on each scrape."""

    def __init__(self, get_snapshot: Callable[[], Snapshot], clock: Callable[[], float] = time.monotonic,
                 version: str = __version__) -> None:
        self._get_snapshot = get_snapshot
        self._clock = clock  # must be the sampler's clock: snapshot age = clock() - timestamp_s
        self._version = version
        self.scrape_errors_total = 0

    def describe(self) -> Iterable[Metric]:
        return []  # unchecked collector: families depend on the snapshot

    def collect(self) -> Iterator[Metric]:
        snapshot = self._get_snapshot()
        families: list[Metric] = []
        for build in (self._meta, self._gpus, self._gpu_fields, self._containers, self._groups, self._probes,
                      self._sharing, signal_families, progress_families, crosscheck_families):
            try:
                families.extend(build(snapshot))
            except (ArithmeticError, AttributeError, KeyError, TypeError, ValueError):
                # a malformed snapshot must not fail the whole scrape: count, log, go on
                self.scrape_errors_total += 1
                log.exception("building %s metrics failed", build.__name__)
        families.append(CounterMetricFamily(
            "gpuwatch_scrape_errors", "Errors while building metrics from the snapshot.",
            value=self.scrape_errors_total))
        yield from families

    # ---- sections -----------------------------------------------------------------------

    def _meta(self, s: Snapshot) -> list[Metric]:
        build = InfoMetricFamily("gpuwatch_build", "gpuwatch build information.",
                                 labels=["version"])
        build.add_metric([], {"version": self._version})
        up = GaugeMetricFamily("gpuwatch_gpu_backend_up", "1 if the last GPU sweep (NVML) succeeded.",
                               labels=["node", "simulated"])
        up.add_metric([s.node, "true" if s.simulated else "false"], 1.0 if s.gpu_up else 0.0)
        probes = GaugeMetricFamily("gpuwatch_probes_up", "1 if kernel probe counters were read.",
                                   labels=["node"])
        probes.add_metric([s.node], 1.0 if s.probes_up else 0.0)
        cycle = GaugeMetricFamily("gpuwatch_sampler_cycle_duration_seconds",
                                  "Wall time of the last sampler cycle.", labels=["node"])
        cycle.add_metric([s.node], s.cycle_seconds)
        cycle_cpu = GaugeMetricFamily("gpuwatch_sampler_cycle_cpu_seconds",
                                      "Thread CPU time of the last sampler cycle.", labels=["node"])
        cycle_cpu.add_metric([s.node], s.cycle_cpu_seconds)
        interval = GaugeMetricFamily("gpuwatch_sampler_interval_seconds", "Configured sample interval.",
                                     labels=["node"])
        interval.add_metric([s.node], s.interval_s)
        age = GaugeMetricFamily("gpuwatch_snapshot_age_seconds", "Age of the snapshot served.",
                                labels=["node"])
        age.add_metric([s.node], max(0.0, self._clock() - s.timestamp_s))
        nvml_errors = CounterMetricFamily("gpuwatch_gpu_backend_errors",
                                          "GPU backend field read errors (fields reported N/A).",
                                          labels=["node"])
        nvml_errors.add_metric([s.node], s.gpu_errors_total)
        return [build, up, probes, cycle, cycle_cpu, interval, age, nvml_errors]

    def _gpus(self, s: Snapshot) -> list[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=GPU_LABELS)

        total = gauge("gpuwatch_gpu_memory_total_bytes", "GPU memory size.")
        used = gauge("gpuwatch_gpu_memory_used_bytes", "GPU memory in use.")
        free = gauge("gpuwatch_gpu_memory_free_bytes", "GPU memory free.")
        util = gauge("gpuwatch_gpu_utilization_ratio", "Fraction of time a kernel was running (0-1).")
        mem_util = gauge("gpuwatch_gpu_memory_utilization_ratio",
                         "Fraction of time device memory was read or written (0-1).")
        temp = gauge("gpuwatch_gpu_temperature_celsius", "GPU core temperature.")
        power = gauge("gpuwatch_gpu_power_watts", "GPU power draw.")
        power_limit = gauge("gpuwatch_gpu_power_limit_watts", "Enforced GPU power limit.")
        healthy = GaugeMetricFamily("gpuwatch_gpu_healthy",
                                    "1 if the GPU is usable; reason says why not (lost, xid, row-remap-failure, "
                                    "ecc-uncorrectable, nvml-errors); xid is the Xid when reason is xid.",
                                    labels=[*GPU_LABELS, "reason", "xid"])
        xid = CounterMetricFamily("gpuwatch_gpu_xid_errors", "Xid errors seen since the agent started.",
                                  labels=GPU_LABELS)
        scaled = CounterMetricFamily("gpuwatch_gpu_kernel_time_scaled",
                                     "Sweeps in which the containers' kernel seconds on this GPU exceeded its busy "
                                     "time (utilisation x interval) and were scaled down to it.", labels=GPU_LABELS)
        scaled_by_gpu = dict(s.kernel_time_scaled)
        info = InfoMetricFamily("gpuwatch_gpu", "Static GPU facts.",
                                labels=[*GPU_LABELS, "pci_bus_id", "mig", "parent_uuid", "simulated"])
        for d in s.devices:
            labels = [s.node, gpu_label(d), d.uuid, d.name]
            for family, value in ((total, d.memory_total_bytes), (used, d.memory_used_bytes),
                                  (free, d.memory_free_bytes), (util, d.utilization_gpu_ratio),
                                  (mem_util, d.utilization_memory_ratio), (temp, d.temperature_celsius),
                                  (power, d.power_watts), (power_limit, d.power_limit_watts)):
                if value is not None:
                    family.add_metric(labels, float(value))
            healthy.add_metric([*labels, *health_reason(s, d.index, d.healthy)], 1.0 if d.healthy else 0.0)
            xid.add_metric(labels, d.xid_errors_total)
            scaled.add_metric(labels, scaled_by_gpu.get(d.uuid, 0))
            info.add_metric(labels, {"pci_bus_id": d.pci_bus_id or "", "mig": str(d.is_mig).lower(),
                                     "parent_uuid": d.parent_uuid or "",
                                     "simulated": str(d.simulated).lower()})
        return [total, used, free, util, mem_util, temp, power, power_limit, healthy, xid, scaled, info]

    def _gpu_fields(self, s: Snapshot) -> list[Metric]:
        """DCGM's default fields besides the basics (model.DeviceFields, issue 19): per physical GPU,
        each only where the GPU answered it. dashboards/gpuwatch-dcgm-compat.yml republishes them
        under dcgm-exporter's names."""
        gauges = {name: GaugeMetricFamily(f"gpuwatch_gpu_{name}", doc, labels=GPU_LABELS) for name, doc in (
            ("sm_clock_hertz", "SM clock."),
            ("memory_clock_hertz", "Memory clock."),
            ("memory_temperature_celsius", "GPU memory (HBM) temperature."),
            ("encoder_utilization_ratio", "Fraction of time the video encoder was busy (0-1)."),
            ("decoder_utilization_ratio", "Fraction of time the video decoder was busy (0-1)."),
            ("remapped_rows_correctable", "Memory rows remapped after correctable errors (since manufacture)."),
            ("remapped_rows_uncorrectable", "Memory rows remapped after uncorrectable errors (since manufacture)."),
            ("row_remap_pending", "1 while a row remap waits for the next GPU reset."),
        )}
        counters = {name: CounterMetricFamily(f"gpuwatch_gpu_{name.removesuffix('_total')}", doc, labels=GPU_LABELS)
                    for name, doc in (
            ("energy_joules_total", "Energy the GPU used since the driver was loaded."),
            ("pcie_transmitted_bytes_total", "Bytes the GPU sent over PCIe since the driver was loaded."),
            ("pcie_received_bytes_total", "Bytes the GPU received over PCIe since the driver was loaded."),
            ("pcie_replays_total", "PCIe link retries (replays) since the driver was loaded."),
            ("nvlink_transmitted_bytes_total", "NVLink data bytes sent, all links, since the driver was loaded."),
            ("nvlink_received_bytes_total", "NVLink data bytes received, all links, since the driver was loaded."),
        )}
        remap_failure = GaugeMetricFamily("gpuwatch_gpu_row_remap_failure",
                                          "1 if a memory row remap failed (the GPU needs service).",
                                          labels=GPU_LABELS)
        last_xid = GaugeMetricFamily("gpuwatch_gpu_last_xid",
                                     "Code of the last Xid error seen since the agent started (0: none).",
                                     labels=GPU_LABELS)
        for d in s.devices:
            if d.is_mig:
                continue
            labels = [s.node, gpu_label(d), d.uuid, d.name]
            last_xid.add_metric(labels, float(d.last_xid))
            if d.row_remap_failure is not None:
                remap_failure.add_metric(labels, 1.0 if d.row_remap_failure else 0.0)
            if d.fields is None:
                continue
            for families in (gauges, counters):
                for name, family in families.items():
                    value = getattr(d.fields, name)
                    if value is not None:
                        family.add_metric(labels, float(value))
        return [*gauges.values(), *counters.values(), remap_failure, last_xid]

    def _containers(self, s: Snapshot) -> list[Metric]:
        built = new_families(_CONTAINER_FAMILIES, CONTAINER_LABELS)
        procs = GaugeMetricFamily("gpuwatch_container_processes",
                                  "Processes of the container on this GPU.", labels=CONTAINER_LABELS)
        models = {d.uuid: d for d in s.devices}
        for c in s.containers:
            device = models.get(c.gpu_uuid)
            gpu = gpu_label(device) if device is not None else str(c.gpu_index)
            labels = [s.node, gpu, c.gpu_uuid, device.name if device is not None else "",
                      *identity_labels(c.identity)]
            fill(built, labels, c)
            procs.add_metric(labels, len(c.processes))
        return [*as_metrics(built), procs]

    def _groups(self, s: Snapshot) -> list[Metric]:
        families: list[Metric] = []
        for level, groups, label_names in (("pod", s.pods, POD_LABELS),
                                           ("namespace", s.namespaces, NAMESPACE_LABELS)):
            built = new_families(_group_families(level), label_names)
            for g in groups:
                labels = [s.node, g.namespace, g.pod, g.pod_uid] if level == "pod" else [s.node, g.namespace]
                fill(built, labels, g)
            families += as_metrics(built)
        return families

    def _sharing(self, s: Snapshot) -> list[Metric]:
        """Tenants per GPU and exclusive holds (gpuwatch.io/sharing, policy/sharing.py): from the
        snapshot alone, so they exist without a policy. MIG instances are counted on their row's
        GPU index and not exported separately."""
        tenants = GaugeMetricFamily("gpuwatch_gpu_tenants",
                                    "Tenants on the GPU holding memory or running on it: containers, and "
                                    "processes outside any container by cgroup.", labels=GPU_LABELS)
        exclusive = GaugeMetricFamily("gpuwatch_gpu_exclusive",
                                      "1 while a container annotated gpuwatch.io/sharing=exclusive holds the GPU.",
                                      labels=GPU_LABELS)
        outside = GaugeMetricFamily("gpuwatch_gpu_process_outside_pod_memory_bytes",
                                    "GPU memory of each process on the GPU that belongs to no pod (host "
                                    "processes, services, containers outside Kubernetes).",
                                    labels=[*GPU_LABELS, "pid", "comm", "cgroup"])
        all_tenants = gpu_tenants(s)
        held = exclusive_holders(gpu_users(s))
        devices = {d.index: d for d in s.devices if d.mig_index is None}
        for d in devices.values():
            labels = [s.node, gpu_label(d), d.uuid, d.name]
            tenants.add_metric(labels, len(all_tenants.get(d.index, {})))
            exclusive.add_metric(labels, 1.0 if held.get(d.index) else 0.0)
        for proc in outside_pod_processes(s):
            device = devices.get(proc.gpu_index)
            if device is not None:
                outside.add_metric([s.node, gpu_label(device), device.uuid, device.name, str(proc.pid), proc.comm,
                                    proc.cgroup_path], float(proc.memory_bytes))
        return [tenants, exclusive, outside]

    def _probes(self, s: Snapshot) -> list[Metric]:
        if not s.probe_counters:
            return []
        built = new_families(_PROBE_FAMILIES, PROBE_LABELS)
        identities = dict(s.probe_identities)
        seen: set[tuple[str, ...]] = set()
        for counter in s.probe_counters:
            identity = identities.get(counter.cgroup_id)
            if identity is None:
                ident_labels = ["", "", "", f"cgroup-id:{counter.cgroup_id}", ""]
            else:
                ident_labels = identity_labels(identity)
            labels = [s.node, *ident_labels]
            if tuple(labels) in seen:  # two cgroup ids of one container: keep the first
                continue
            seen.add(tuple(labels))
            fill(built, labels, counter)
        return as_metrics(built)
