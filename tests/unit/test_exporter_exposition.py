"""render_text must be exactly prometheus_client's text format (generate_latest)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, Summary, generate_latest
from prometheus_client.core import GaugeHistogramMetricFamily

from gpuwatch.core.model import ContainerUsage, GroupUsage, ProcessUsage, Snapshot
from gpuwatch.exporter.exposition import render_text
from gpuwatch.exporter.metrics_server import registry_for
from tests.unit.gpu_fakes import GIB, container, device


class _GaugeHistogram:
    def collect(self):  # type: ignore[no-untyped-def]
        g = GaugeHistogramMetricFamily("queue_depth", "A gauge histogram.", labels=["q"])
        g.add_metric(["a"], [("1.0", 3), ("+Inf", 5)], gsum_value=7)
        yield g


def test_every_family_type_and_awkward_labels_render_identically() -> None:
    reg = CollectorRegistry()
    c = Counter("jobs", "Jobs done.\nSecond line with \\ backslash.", ["kind"], registry=reg)
    c.labels('we"ird\\va\nlue').inc(3)
    c.labels("ünïcødé").inc()
    Gauge("temp_celsius", "Temperature.", registry=reg).set(1e21)
    Gauge("tiny", "Small.", registry=reg).set(1.5e-7)
    Gauge("nan_and_inf", "Special.", ["v"], registry=reg).labels("inf").set(float("inf"))
    h = Histogram("latency_seconds", "Latency.", ["path"], registry=reg)
    h.labels("/x").observe(0.3)
    s = Summary("size_bytes", "Size.", registry=reg)
    s.observe(1234567.0)
    Info("build", "Build.", registry=reg).info({"version": "1.2", "commit": "abc"})
    Enum("state", "State.", states=["a", "b"], registry=reg).state("b")
    reg.register(_GaugeHistogram())  # type: ignore[arg-type]
    assert render_text(reg) == generate_latest(reg)


def test_node_scale_snapshot_renders_identically_and_faster() -> None:
    devices = tuple(device(i, used=i * GIB, temperature_celsius=40.0 + i) for i in range(8))
    usages, pods = [], []
    for n in range(200):
        ident = container(f"{n:064x}", namespace=f"ns-{n % 7}", pod=f"pod-{n}", name=f"c{n}", pod_uid=f"u-{n}")
        procs = tuple(ProcessUsage(pid=1000 + 4 * n + k, container_pid=k + 1, comm="w", memory_bytes=64 << 20,
                                   sm_utilization_ratio=0.01 * k) for k in range(4))
        usages.append(ContainerUsage(identity=ident, gpu_index=n % 8, gpu_uuid=f"GPU-fake-{n % 8}",
                                     memory_bytes=256 << 20, sm_utilization_ratio=0.06,
                                     kernel_seconds_total=n * 1.25, processes=procs))
        pods.append(GroupUsage(namespace=f"ns-{n % 7}", pod=f"pod-{n}", pod_uid=f"u-{n}",
                               memory_bytes=256 << 20, sm_utilization_ratio=0.06, kernel_seconds_total=n * 1.25,
                               containers=1))
    now = time.monotonic()
    snap = Snapshot(timestamp_s=now, node="n1", devices=devices, containers=tuple(usages), pods=tuple(pods))
    reg = registry_for(lambda: snap)
    fixed = CollectorRegistry()  # freeze snapshot age: two renders must see the same values
    text = generate_latest(reg)
    assert text.count(b"\n") > 1500

    class Frozen:
        def __init__(self) -> None:
            self.families = list(reg.collect())

        def collect(self):  # type: ignore[no-untyped-def]
            return iter(self.families)

    fixed.register(Frozen())  # type: ignore[arg-type]
    assert render_text(fixed) == generate_latest(fixed)

    def best_of_5(render) -> float:  # type: ignore[no-untyped-def]
        times = []
        for _ in range(5):
            t0 = time.thread_time()
            render(fixed)
            times.append(time.thread_time() - t0)
        return min(times)

    assert best_of_5(render_text) < best_of_5(generate_latest), "the fast renderer is not faster"
