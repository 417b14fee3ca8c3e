"""gpuwatch_container_probe_nvml_divergence_bytes from a snapshot through the real collector:
signed, per container over all its GPUs, left out (not 0) where a number is missing."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gpuwatch.core.model import ContainerIdentity, ContainerUsage, ProbeCounters, ProcessUsage, Snapshot
from gpuwatch.exporter.collector import SnapshotCollector
from gpuwatch.exporter.crosscheck_metrics import DIVERGENCE_METRIC

MIB = 2**20


def ident(name: str, cgroup_id: int) -> ContainerIdentity:
    return ContainerIdentity(runtime="k8s", cgroup_path=f"/kubepods/{name}", container_id=f"id-{name}",
                             container_name=name, pod_name="p", pod_namespace="ml", pod_uid="u", cgroup_id=cgroup_id)


def labels(name: str) -> dict[str, str]:
    return {"node": "n", "namespace": "ml", "pod": "p", "pod_uid": "u", "container": name,
            "container_id": f"id-{name}"}


def usage(identity: ContainerIdentity, gpu: int, mib: int | None) -> ContainerUsage:
    return ContainerUsage(identity, gpu, f"GPU-{gpu}", (mib or 0) * MIB, 0.0, 0.0,
                          processes=(ProcessUsage(1, None, "job", None if mib is None else mib * MIB, 0.0),))


def test_divergence_is_signed_summed_over_gpus_and_missing_numbers_are_left_out() -> None:
    over, under, na, nvml_only = ident("over", 1), ident("under", 2), ident("na", 3), ident("nvml-only", 4)
    snapshot = Snapshot(
        timestamp_s=1.0, node="n", devices=(), probes_up=True,
        containers=(usage(over, 0, 100), usage(over, 1, 50), usage(under, 0, 400), usage(na, 0, None),
                    usage(nvml_only, 0, 10)),
        probe_counters=(ProbeCounters(cgroup_id=1, allocated_bytes_by_gpu=((0, 300 * MIB), (1, 50 * MIB))),
                        ProbeCounters(cgroup_id=2, allocated_bytes_by_gpu=((0, 100 * MIB),),
                                      cuda_allocated_bytes=150 * MIB),
                        ProbeCounters(cgroup_id=3, allocated_bytes_by_gpu=((0, 100 * MIB),))),
        probe_identities=((1, over), (2, under), (3, na)))
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: snapshot, clock=lambda: 1.0))
    assert registry.get_sample_value(DIVERGENCE_METRIC, labels("over")) == 200 * MIB
    assert registry.get_sample_value(DIVERGENCE_METRIC, labels("under")) == -250 * MIB  # libcuda 150 > driver 100
    assert registry.get_sample_value(DIVERGENCE_METRIC, labels("na")) is None
    assert registry.get_sample_value(DIVERGENCE_METRIC, labels("nvml-only")) is None
    assert registry.get_sample_value("gpuwatch_scrape_errors_total") == 0
