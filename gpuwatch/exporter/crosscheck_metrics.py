"""Metric family for the probe vs NVML cross-check (core/probe_nvml.py).

`gpuwatch_container_probe_nvml_divergence_bytes` -- per container, its probe live bytes
(the larger of the decoded driver counter and the libcuda counter, all GPUs) minus its NVML
used memory (all GPUs); signed: positive means the probes count more than the driver holds,
which is what suspends in-kernel enforcement when it lasts
(`gpuwatch_container_inkernel_enforcement_suspended`, exported by the enforcer). Container
labels without the GPU (node, namespace, pod, pod_uid, container, container_id): the
comparison is over all of a container's GPUs, as the kernel limit is. A container without
either number (probes off, NVML N/A, not listed by NVML) is left out, never exported as 0.
Read from the snapshot (its probe_nvml, the comparison the enforcer judges too), so it
exists with or without a policy.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily, Metric

from gpuwatch.core.labels import PROBE_LABELS, identity_labels
from gpuwatch.core.model import Snapshot
from gpuwatch.core.probe_nvml import probe_nvml_of

DIVERGENCE_METRIC = "gpuwatch_container_probe_nvml_divergence_bytes"


def crosscheck_families(s: Snapshot) -> list[Metric]:
    divergence = GaugeMetricFamily(
        DIVERGENCE_METRIC,
        "Probe live bytes (the larger of decoded driver ioctls and libcuda uprobes, all GPUs) minus NVML used "
        "memory of the container (all GPUs); positive: the probes count more than the driver holds.",
        labels=PROBE_LABELS)
    seen: set[tuple[str, ...]] = set()
    for comparison in probe_nvml_of(s).values():
        value = comparison.divergence_bytes
        labels = (s.node, *identity_labels(comparison.identity))
        if value is None or labels in seen:
            continue
        seen.add(labels)
        divergence.add_metric(list(labels), float(value))
    return [divergence]
