"""SnapshotCollector + server: names, labels, values, vanishing series, promtool, JSON."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpuwatch.core import snapshot_doc
from gpuwatch.core.model import DeviceInfo, ProbeCounters, Snapshot
from gpuwatch.exporter.collector import SnapshotCollector
from gpuwatch.exporter.metrics_server import registry_for, serve
from gpuwatch.pipeline.sampler import Sampler
from tests.conftest import need_binary
from tests.unit.gpu_fakes import GIB, FakeProbes, FakeResolver, FakeWorld, container, device, factory_for

A = container("aaaa1111aaaa", namespace="ns1", pod="p1", name="c1", pod_uid="u1", cgroup_id=501)
B = container("bbbb2222bbbb", namespace="ns2", pod="p2", name="c2", pod_uid="u2", cgroup_id=502)
R = container("rrrr3333rrrr")  # plain runc: no pod


def pipeline(probes: FakeProbes | None = None) -> tuple[FakeWorld, Sampler, CollectorRegistry]:
    world = FakeWorld(devices=[device(0, used=6 * GIB, temperature_celsius=41.0, power_watts=123.5),
                               device(1, used=GIB)],
                      procs={(10, 0): (4 * GIB, 0.5), (11, 0): (GIB, 0.25), (20, 0): (GIB, 0.1),
                             (30, 1): (GIB, 1.0), (99, 1): (512, None)})
    resolver = FakeResolver()
    resolver.add(10, A, 1)
    resolver.add(11, A, 2)
    resolver.add(20, B, 1)
    resolver.add(30, R, 1)
    sampler = Sampler(factory_for(world), resolver, "node-1", clock=world.clock, probe_source=probes)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SnapshotCollector(sampler.latest, clock=world.clock))
    return world, sampler, registry


def clabels(identity, gpu: str = "0", namespace: str | None = None) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {"node": "node-1", "gpu": gpu, "uuid": f"GPU-fake-{gpu}", "model": "Fake H100",
            "namespace": identity.pod_namespace, "pod": identity.pod_name, "pod_uid": identity.pod_uid,
            "container": identity.container_name, "container_id": identity.container_id}


def test_gpu_metrics() -> None:
    _, sampler, reg = pipeline()
    sampler.run_once()
    g0 = {"node": "node-1", "gpu": "0", "uuid": "GPU-fake-0", "model": "Fake H100"}
    assert reg.get_sample_value("gpuwatch_gpu_memory_total_bytes", g0) == 80 * GIB
    assert reg.get_sample_value("gpuwatch_gpu_memory_used_bytes", g0) == 6 * GIB
    assert reg.get_sample_value("gpuwatch_gpu_memory_free_bytes", g0) == 74 * GIB
    assert reg.get_sample_value("gpuwatch_gpu_temperature_celsius", g0) == 41.0
    assert reg.get_sample_value("gpuwatch_gpu_power_watts", g0) == 123.5
    assert reg.get_sample_value("gpuwatch_gpu_healthy", {**g0, "reason": "ok", "xid": ""}) == 1.0
    # N/A is absent, not zero
    g1 = {**g0, "gpu": "1", "uuid": "GPU-fake-1"}
    assert reg.get_sample_value("gpuwatch_gpu_temperature_celsius", g1) is None
    assert reg.get_sample_value("gpuwatch_gpu_backend_up", {"node": "node-1", "simulated": "false"}) == 1.0
    assert reg.get_sample_value("gpuwatch_build_info", {"version": "0.1.0"}) == 1.0


def test_container_pod_namespace_metrics() -> None:
    world, sampler, reg = pipeline()
    sampler.run_once()
    world.now_s += 2.0
    sampler.run_once()
    a = clabels(A)
    assert reg.get_sample_value("gpuwatch_container_memory_bytes", a) == 5 * GIB
    assert reg.get_sample_value("gpuwatch_container_sm_utilization_ratio", a) == pytest.approx(0.75)
    assert reg.get_sample_value("gpuwatch_container_kernel_seconds_total", a) == pytest.approx(1.5)
    assert reg.get_sample_value("gpuwatch_container_processes", a) == 2
    r = clabels(R, gpu="1")
    assert reg.get_sample_value("gpuwatch_container_memory_bytes", r) == GIB
    host = {**clabels(A, gpu="1"), "namespace": "", "pod": "", "pod_uid": "", "container": "/",
            "container_id": ""}
    assert reg.get_sample_value("gpuwatch_container_memory_bytes", host) == 512
    pod = {"node": "node-1", "namespace": "ns1", "pod": "p1", "pod_uid": "u1"}
    assert reg.get_sample_value("gpuwatch_pod_memory_bytes", pod) == 5 * GIB
    assert reg.get_sample_value("gpuwatch_pod_kernel_seconds_total", pod) == pytest.approx(1.5)
    assert reg.get_sample_value("gpuwatch_pod_containers", pod) == 1
    ns = {"node": "node-1", "namespace": "ns2"}
    assert reg.get_sample_value("gpuwatch_namespace_memory_bytes", ns) == GIB
    assert reg.get_sample_value("gpuwatch_namespace_kernel_seconds_total", ns) == pytest.approx(0.2)


def test_exited_container_series_vanish_on_the_next_snapshot() -> None:
    world, sampler, reg = pipeline()
    sampler.run_once()
    assert reg.get_sample_value("gpuwatch_container_memory_bytes", clabels(B)) == GIB
    del world.procs[(20, 0)]
    world.now_s += 1
    sampler.run_once()
    assert reg.get_sample_value("gpuwatch_container_memory_bytes", clabels(B)) is None
    assert reg.get_sample_value("gpuwatch_pod_memory_bytes",
                                {"node": "node-1", "namespace": "ns2", "pod": "p2", "pod_uid": "u2"}) is None


def test_backend_down_is_visible() -> None:
    world, sampler, reg = pipeline()
    sampler.run_once()
    world.down = True
    world.now_s += 1
    sampler.run_once()
    assert reg.get_sample_value("gpuwatch_gpu_backend_up", {"node": "node-1", "simulated": "false"}) == 0.0
    assert reg.get_sample_value("gpuwatch_container_memory_bytes", clabels(A)) is None
    assert reg.get_sample_value("gpuwatch_snapshot_age_seconds", {"node": "node-1"}) == 0.0
    world.now_s += 3
    assert reg.get_sample_value("gpuwatch_snapshot_age_seconds", {"node": "node-1"}) == 3.0


def test_probe_metrics() -> None:
    counters = (ProbeCounters(cgroup_id=501, ioctl_calls_by_op=(("RM_ALLOC", 7), ("RM_FREE", 2)),
                              allocated_bytes_by_gpu=((0, 3 * GIB),), allocations_total=3,
                              allocation_failures_total=1, launches_total=None),
                ProbeCounters(cgroup_id=777, allocation_failures_total=4))
    _, sampler, reg = pipeline(FakeProbes(counters))
    sampler.run_once()
    a = {k: v for k, v in clabels(A).items() if k not in ("gpu", "uuid", "model")}
    assert reg.get_sample_value("gpuwatch_container_ioctl_calls_total", {**a, "op": "RM_ALLOC"}) == 7
    assert reg.get_sample_value("gpuwatch_container_allocation_failures_total", a) == 1
    assert reg.get_sample_value("gpuwatch_container_allocated_bytes", {**a, "gpu": "0"}) == 3 * GIB
    assert reg.get_sample_value("gpuwatch_container_kernel_launches_total", a) is None
    assert reg.get_sample_value("gpuwatch_container_cuda_allocated_bytes", a) is None  # uprobes off
    unknown = {"node": "node-1", "namespace": "", "pod": "", "pod_uid": "", "container": "cgroup-id:777",
               "container_id": ""}
    assert reg.get_sample_value("gpuwatch_container_allocation_failures_total", unknown) == 4


def test_malformed_snapshot_counts_a_scrape_error_but_serves_the_rest() -> None:
    bad_device = DeviceInfo(index=0, uuid="GPU-x", name="x", pci_bus_id=None, memory_total_bytes="lots",  # type: ignore[arg-type]
                            memory_used_bytes=None, memory_free_bytes=None)
    snap = Snapshot(timestamp_s=1.0, node="n", devices=(bad_device,), containers=())
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(lambda: snap, clock=lambda: 1.0))
    assert reg.get_sample_value("gpuwatch_scrape_errors_total", {}) == 1
    assert reg.get_sample_value("gpuwatch_gpu_backend_up", {"node": "n", "simulated": "false"}) == 1.0


def test_server_metrics_pass_promtool_and_snapshot_json_round_trips() -> None:
    promtool = need_binary("promtool", "prometheus")
    counters = (ProbeCounters(cgroup_id=501, ioctl_calls_by_op=(("RM_ALLOC", 7),),
                              allocated_bytes_by_gpu=((0, GIB), (-1, 4096)), launches_total=5,
                              cuda_allocated_bytes=GIB, cuda_allocations_total=2, cuda_oom_total=1,
                              ioctl_failures_by_op=(("RM_ALLOC", 1),), graph_launches_total=3),)
    world, sampler, _ = pipeline(FakeProbes(counters))
    sampler.run_once()
    world.now_s += 1
    sampler.run_once()
    server = serve(registry_for(sampler.latest), "127.0.0.1", 0, get_snapshot=sampler.latest)
    try:
        body = urllib.request.urlopen(f"{server.url}/metrics", timeout=5).read()
        assert b"gpuwatch_container_kernel_seconds_total{" in body
        check = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=30)
        assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
        assert check.stdout.strip() == b"" and check.stderr.strip() == b"", check.stderr.decode()
        doc = urllib.request.urlopen(f"{server.url}/snapshot.json", timeout=5).read().decode()
        assert json.loads(doc)["node"] == "node-1"
        assert snapshot_doc.loads(doc) == sampler.latest()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"{server.url}/nope", timeout=5)
    finally:
        server.stop()


def test_json_round_trip_is_exact() -> None:
    world, sampler, _ = pipeline(FakeProbes((ProbeCounters(cgroup_id=502, ioctl_calls_by_op=(("x", 1),),
                                                           ioctl_failures_by_op=(("x", 1),)),)))
    sampler.run_once()
    world.now_s += 1
    snap = sampler.run_once()
    snap = dataclasses.replace(snap, devices=(*snap.devices, dataclasses.replace(
        snap.devices[0], uuid="MIG-1", is_mig=True, mig_index=3, parent_uuid="GPU-fake-0")))
    assert snapshot_doc.loads(snapshot_doc.dumps(snap)) == snap


def test_mig_devices_get_their_own_gpu_label() -> None:
    mig = dataclasses.replace(device(0), uuid="MIG-abc", is_mig=True, mig_index=2, parent_uuid="GPU-fake-0")
    snap = Snapshot(timestamp_s=1.0, node="n", devices=(device(0), mig), containers=())
    text = generate_latest(registry_for(lambda: snap)).decode()
    assert 'gpu="0/mig2"' in text and 'mig="true"' in text and 'parent_uuid="GPU-fake-0"' in text


def test_server_speaks_text_to_prometheus_and_openmetrics_when_asked_only_for_that() -> None:
    _, sampler, _ = pipeline()
    sampler.run_once()
    server = serve(registry_for(sampler.latest), "127.0.0.1", 0)
    prometheus_accept = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                         "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
    try:
        for accept, expected_type, ending in (
                (prometheus_accept, "text/plain; version=0.0.4", b"\n"),
                ("application/openmetrics-text; version=1.0.0", "application/openmetrics-text", b"# EOF\n")):
            request = urllib.request.Request(f"{server.url}/metrics", headers={"Accept": accept})
            with urllib.request.urlopen(request, timeout=5) as resp:
                body = resp.read()
                assert resp.headers["Content-Type"].startswith(expected_type)
            assert body.endswith(ending) and b"gpuwatch_container_memory_bytes{" in body
        with pytest.raises(urllib.error.HTTPError):  # no snapshot source given: no JSON endpoint
            urllib.request.urlopen(f"{server.url}/snapshot.json", timeout=5)
    finally:
        server.stop()
        server.stop()  # idempotent


def _http(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_only_get_and_head_are_answered_others_get_405_with_allow() -> None:
    """Issue 13: POST/PUT/DELETE on /metrics answered 200."""
    _, sampler, _ = pipeline()
    sampler.run_once()
    server = serve(registry_for(sampler.latest), "127.0.0.1", 0, get_snapshot=sampler.latest)
    try:
        for path in ("/metrics", "/", "/snapshot.json"):
            for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
                code, headers, _ = _http(server.url + path, method, b"{}" if method in ("POST", "PUT") else None)
                assert (code, headers.get("Allow")) == (405, "GET, HEAD"), (path, method)
            code, headers, body = _http(server.url + path, "HEAD")
            assert code == 200 and body == b"" and int(headers["Content-Length"]) > 0
        assert _http(server.url + "/nope", "POST", b"x")[0] == 404
    finally:
        server.stop()


def test_snapshot_json_only_on_loopback_listeners_unless_snapshot_remote() -> None:
    """Issue 13: /snapshot.json (host pids, process names, cgroup paths, pod UIDs) was served on
    whatever address the metrics port listened on, 0.0.0.0 in the DaemonSet."""
    _, sampler, _ = pipeline()
    sampler.run_once()
    exposed = serve(registry_for(sampler.latest), "0.0.0.0", 0, get_snapshot=sampler.latest)
    opted_in = serve(registry_for(sampler.latest), "0.0.0.0", 0, get_snapshot=sampler.latest,
                     snapshot_remote=True)
    local = serve(registry_for(sampler.latest), "127.0.0.1", 0, get_snapshot=sampler.latest)
    try:
        assert not exposed.serves_snapshot and opted_in.serves_snapshot and local.serves_snapshot
        base = f"http://127.0.0.1:{exposed.port}"
        code, _, body = _http(base + "/snapshot.json")
        assert code == 403 and b"--snapshot-remote" in body
        assert _http(base + "/metrics")[0] == 200  # metrics only
        for server in (opted_in, local):
            code, _, body = _http(f"http://127.0.0.1:{server.port}/snapshot.json")
            assert code == 200 and json.loads(body)["node"] == "node-1"
    finally:
        for server in (exposed, opted_in, local):
            server.stop()
