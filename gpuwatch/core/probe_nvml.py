"""Probe vs NVML per container, once per interval: what the kernel probes count for a
container beside what NVML says it holds.

The sampler computes it into `Snapshot.probe_nvml`; the exporter
(gpuwatch_container_probe_nvml_divergence_bytes) and the enforcer's in-kernel guard
(policy/probe_trust.py judges it) both read it from there through `probe_nvml_of`, so the
two never disagree about an interval and the scrape does not redo the work.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuwatch.core.model import ContainerIdentity, ProbeNvmlComparison, Snapshot


def probe_container_bytes(snapshot: Snapshot) -> dict[str, tuple[ContainerIdentity, int]]:
    """Container key -> (identity, probe live bytes): per cgroup id the larger of the decoded
    driver counter (every GPU, the unknown one included) and the libcuda counter, summed over
    the container's cgroup ids. Counters of cgroups the snapshot cannot name are left out."""
    identities = dict(snapshot.probe_identities)
    found: dict[str, tuple[ContainerIdentity, int]] = {}
    for counter in snapshot.probe_counters:
        identity = identities.get(counter.cgroup_id)
        if identity is None:
            continue
        driver_bytes = sum(size for _gpu, size in counter.allocated_bytes_by_gpu)
        live = max(driver_bytes, counter.cuda_allocated_bytes or 0)
        before = found.get(identity.key)
        found[identity.key] = (before[0] if before else identity, (before[1] if before else 0) + live)
    return found


def nvml_container_bytes(snapshot: Snapshot) -> dict[str, tuple[ContainerIdentity, int]]:
    """Container key -> (identity, NVML used bytes over all its GPUs). A container whose
    processes all read N/A has no number and is left out."""
    found: dict[str, tuple[ContainerIdentity, int]] = {}
    for row in snapshot.containers:
        if not any(p.memory_bytes is not None for p in row.processes):
            continue
        before = found.get(row.identity.key)
        found[row.identity.key] = (before[0] if before else row.identity,
                                   (before[1] if before else 0) + row.memory_bytes)
    return found


def compare_probe_nvml(snapshot: Snapshot) -> dict[str, ProbeNvmlComparison]:
    """Every container with a probe counter or an NVML number, by container key. Without
    probes (probes_up false) or NVML (gpu_up false) that side is None for everyone."""
    probes = probe_container_bytes(snapshot) if snapshot.probes_up else {}
    nvml = nvml_container_bytes(snapshot) if snapshot.gpu_up else {}
    out: dict[str, ProbeNvmlComparison] = {}
    for key in sorted(set(probes) | set(nvml)):
        identity = (nvml.get(key) or probes[key])[0]
        probe = probes.get(key)
        used = nvml.get(key)
        out[key] = ProbeNvmlComparison(identity, probe[1] if probe else None, used[1] if used else None)
    return out


def probe_nvml_of(snapshot: Snapshot) -> Mapping[str, ProbeNvmlComparison]:
    """The snapshot's comparison by container key: the one the sampler made, else computed."""
    if snapshot.probe_nvml is None:
        return compare_probe_nvml(snapshot)
    return {c.identity.key: c for c in snapshot.probe_nvml}
