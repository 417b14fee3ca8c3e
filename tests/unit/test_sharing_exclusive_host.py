"""Exclusive placement counts every process on a GPU, in a pod or not: a host process
holding 4 GiB and 49 % of the SMs makes the GPU taken, the agent exports it as a tenant with
the process named, and the extender's filter refuses the node naming that process.

The path is the production one minus the network: the agent's collector renders the
snapshot, the samples go into the extender's own queries' result shape (what Prometheus
would answer for `placement_queries()`), `build_state` parses them, the Extender filters."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from gpuwatch.cluster.queries import build_state, placement_queries
from gpuwatch.core.model import ContainerIdentity, ContainerUsage, DeviceInfo, ProcessUsage, Snapshot
from gpuwatch.exporter.collector import SnapshotCollector
from gpuwatch.policy.sharing import gpu_tenants, gpu_users, outside_pod_processes
from tests.unit.test_extender_placement import NOW, extender, pod, run_filter

GIB = 2**30
HOST = ContainerIdentity("host", "/user.slice/user-1000.slice/session-3.scope")
POD = ContainerIdentity("k8s", "/kubepods/podabc/id-web", "id-web", "web", "web-0", "prod", pod_uid="abc")


def _snapshot(now_s: float) -> Snapshot:
    devices = tuple(DeviceInfo(i, f"GPU-{i}", "H100", None, 80 * GIB, used, 80 * GIB - used)
                    for i, used in ((0, 4 * GIB), (1, 2 * GIB), (2, 0)))
    rows = (
        ContainerUsage(HOST, 0, "GPU-0", 4 * GIB, 0.49, 10.0,
                       processes=(ProcessUsage(4242, None, "python3", 4 * GIB, 0.49),)),
        ContainerUsage(POD, 1, "GPU-1", 2 * GIB, 0.1, 1.0, processes=(ProcessUsage(77, 1, "server", 2 * GIB, 0.1),)),
    )
    return Snapshot(timestamp_s=now_s, node="gpu-1", devices=devices, containers=rows, gpu_up=True)


def test_a_host_process_is_a_tenant_and_named() -> None:
    snapshot = _snapshot(time.time())
    assert 0 not in gpu_users(snapshot), "the enforcer's container users are unchanged"
    assert set(gpu_tenants(snapshot)) == {0, 1}
    (proc,) = outside_pod_processes(snapshot)
    assert (proc.gpu_index, proc.pid, proc.comm, proc.memory_bytes) == (0, 4242, "python3", 4 * GIB)


def _results(snapshot: Snapshot) -> dict[str, list[tuple[dict[str, str], float, float]]]:
    """What Prometheus answers for the extender's placement batch, from the agent's samples."""
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: snapshot, clock=lambda: snapshot.timestamp_s))
    by_metric: dict[str, list[tuple[dict[str, str], float, float]]] = {}
    for family in registry.collect():
        for sample in family.samples:
            by_metric.setdefault(sample.name, []).append((dict(sample.labels), sample.value, snapshot.timestamp_s))
    wanted = placement_queries()
    results: dict[str, list[tuple[dict[str, str], float, float]]] = {}
    for query, metric in (("gpu_memory_free", "gpuwatch_gpu_memory_free_bytes"),
                          ("gpu_tenants", "gpuwatch_gpu_tenants"),
                          ("gpu_outside_pod", "gpuwatch_gpu_process_outside_pod_memory_bytes"),
                          ("backend_up", "gpuwatch_gpu_backend_up"), ("last_scrape", "gpuwatch_gpu_backend_up")):
        assert metric in wanted[query], (query, wanted[query])
        rows = by_metric.get(metric, [])
        if query == "gpu_tenants":
            rows = [r for r in rows if r[1] > 0]  # the query's `> 0`
        if query == "last_scrape":
            rows = [(r[0], snapshot.timestamp_s, snapshot.timestamp_s) for r in rows]
        results[query] = rows
    return results


def test_exclusive_pod_is_refused_with_the_host_process_named() -> None:
    now = NOW  # the placement tests' clock
    results = _results(_snapshot(now - 2))
    state = build_state(results, now, health_complete=False)
    gpus = {g.index: g for g in state.nodes["gpu-1"].gpus}
    assert (gpus[0].tenants, gpus[1].tenants, gpus[2].tenants) == (1, 1, 0)
    assert [p.pid for p in gpus[0].outside_pod] == [4242]
    ext = extender(state)
    # two whole GPUs, exclusive by default: only GPU 2 is idle
    result = run_filter(ext, pod(gpus=2), ["gpu-1"])
    assert result["NodeNames"] == []
    reason = result["FailedNodes"]["gpu-1"]
    assert "GPU 0 has 1 tenant: pid 4242 python3 outside any pod (/user.slice/user-1000.slice/session-3.scope, " \
           "4GiB)" in reason, reason
    assert "GPU 1 has 1 tenant" in reason
    # one exclusive GPU still fits on GPU 2; a shared pod may join the host process's GPU
    assert run_filter(ext, pod(gpus=1), ["gpu-1"])["NodeNames"] == ["gpu-1"]
    assert run_filter(ext, pod({"gpuwatch.io/gpu-memory": "8Gi"}), ["gpu-1"])["NodeNames"] == ["gpu-1"]
