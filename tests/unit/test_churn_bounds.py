"""Retained state of gone containers is bounded in count and time, and compact (issue 13, item 5).

Each test drives the real class through container churn with an injected clock (or the
`now_s` the sampler passes) and checks what it keeps afterwards, and that a cycle touches
only what is live: retired state is shared, not copied or walked, from one cycle to the next.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest

from gpuwatch.containers import BundleRoots, IdentityResolver
from gpuwatch.core.model import (
    ContainerIdentity,
    ContainerUsage,
    DeviceInfo,
    GpuProcess,
    GpuSweep,
    ProcessIdentity,
    ProcessUsage,
)
from gpuwatch.pipeline.attribution import AttributionState, CounterTable, attribute
from gpuwatch.signals.kmsg import KmsgReader
from gpuwatch.signals.progress import ProgressTracker
from gpuwatch.signals.signal_collector import SignalCollector
from tests.unit.proc_status import write_status

GPU = "GPU-fake-0"


def identity(n: int, namespace: str = "ns") -> ContainerIdentity:
    return ContainerIdentity(runtime="containerd", cgroup_path=f"/kubepods/pod{n}/{n:064x}", container_id=f"{n:064x}",
                             container_name="worker", pod_name=f"pod-{n}", pod_namespace=namespace,
                             pod_uid=f"uid-{n}")


def sweep(t: float, *containers: int) -> tuple[GpuSweep, dict[int, ProcessIdentity]]:
    procs = tuple(GpuProcess(pid=100_000 + n, gpu_index=0, gpu_uuid=GPU, memory_bytes=1 << 20,
                             sm_utilization_ratio=0.5) for n in containers)
    ids = {100_000 + n: ProcessIdentity(100_000 + n, 1, "w", identity(n)) for n in containers}
    return GpuSweep(timestamp_s=t, devices=(), processes=procs), ids


# ---- attribution ----------------------------------------------------------------------------

def test_churn_keeps_at_most_max_retired_counters_and_the_live_ones() -> None:
    state = AttributionState()
    live: list[int] = []
    for step in range(400):  # 50 new containers a sweep, each living 3 sweeps
        live = [n for n in live if n > step * 50 - 150] + list(range(step * 50, step * 50 + 50))
        s, ids = sweep(float(step), *live)
        result = attribute(s, ids, state, "n", retention_s=600.0, max_retired=1024)
        state = result.state
        for table in (state.containers, state.pods):
            assert table.retired_count <= 1024
            assert table.retired_batches <= 10
        assert state.containers.live_count == len(live)
    assert len(state.containers) <= 1024 + len(live)
    assert len(state.namespaces) == 1  # one namespace throughout: nothing retired
    assert state.containers.retired_count >= 1024 * 7 // 8  # dropped a batch at a time


def test_retired_counters_are_dropped_after_the_retention_window() -> None:
    s, ids = sweep(0.0, 1)
    state = attribute(s, ids, AttributionState(), "n").state
    s, ids = sweep(1.0, 1)
    state = attribute(s, ids, state, "n").state
    last_seen = 1.0
    for t in range(2, 80):  # container 1 gone at t=2; others come and go
        s, ids = sweep(float(t), 1000 + t)
        state = attribute(s, ids, state, "n", retention_s=50.0).state
        key = (identity(1).key, GPU)
        if t - last_seen <= 50.0:
            assert key in state.containers, t  # never before retention_s
        elif t - last_seen > 50.0 * 9 / 8:
            assert key not in state.containers, t  # at most retention x 9/8
    for _, seen_s in state.containers.values():
        assert 79.0 - seen_s <= 50.0 * 9 / 8


def test_a_returning_container_continues_its_counter_and_is_taken_out_of_the_retired() -> None:
    s, ids = sweep(0.0, 7)
    state = attribute(s, ids, AttributionState(), "n").state
    s, ids = sweep(2.0, 7)
    state = attribute(s, ids, state, "n").state  # 1.0 s of kernel time
    for t in range(3, 40):  # away (process restarting) while others churn
        s, ids = sweep(float(t), 500 + t)
        state = attribute(s, ids, state, "n").state
    assert state.containers[(identity(7).key, GPU)][0] == pytest.approx(1.0)
    s, ids = sweep(40.0, 7)
    result = attribute(s, ids, state, "n")
    assert result.containers[0].kernel_seconds_total == pytest.approx(1.5)
    assert result.pods[0].kernel_seconds_total == pytest.approx(1.5)
    assert result.state.containers.retired_count == state.containers.retired_count - 1 + 1  # 7 back, 39 gone
    assert sum(1 for key in result.state.containers if key == (identity(7).key, GPU)) == 1


def test_a_sweep_shares_the_retired_batches_it_does_not_change() -> None:
    """A cycle's work does not grow with the retired counters: older batches are the same
    objects in the next state (not copied, not walked), only the newest is rebuilt."""
    state = AttributionState()
    for step in range(100):
        s, ids = sweep(float(step), *range(step * 10, step * 10 + 10))  # 10 containers a sweep, gone the next
        state = attribute(s, ids, state, "n").state
    before = state.containers._retired
    assert len(before) >= 3 and state.containers.retired_count == 990
    s, ids = sweep(100.0, 2000)
    after = attribute(s, ids, state, "n").state
    assert all(a is b for a, b in zip(before[:-1], after.containers._retired[:-1], strict=False))
    s, ids = sweep(101.0, 2000)  # nobody left: nothing retired, every batch shared
    again = attribute(s, ids, after, "n").state.containers._retired
    assert all(a is b for a, b in zip(after.containers._retired, again, strict=True))


def test_counter_table_is_an_immutable_value() -> None:
    table = CounterTable({("a", GPU): 1.0}, 5.0)
    nxt = table.advance({("b", GPU): 2.0}, 6.0)
    assert dict(table) == {("a", GPU): (1.0, 5.0)}
    assert dict(nxt) == {("b", GPU): (2.0, 6.0), ("a", GPU): (1.0, 5.0)}
    assert nxt.advance({}, 7.0) == nxt.advance({}, 7.0)
    with pytest.raises(TypeError):
        nxt[("c", GPU)] = (0.0, 0.0)  # type: ignore[index]
    assert CounterTable().advance({("a", GPU): 0.0}, 1.0).advance({}, 2.0, max_retired=0) == {}


# ---- progress tracker -----------------------------------------------------------------------

def declared(n: int) -> ContainerIdentity:
    return dataclasses.replace(identity(n), labels=(("gpuwatch.io/progress-file", "/loss"),))


def usage_of(ident: ContainerIdentity, pid: int) -> ContainerUsage:
    return ContainerUsage(identity=ident, gpu_index=0, gpu_uuid=GPU, memory_bytes=0, sm_utilization_ratio=0.0,
                          kernel_seconds_total=1.0, processes=(ProcessUsage(pid, 1, "w", 0, 0.0),))


def test_progress_history_of_gone_containers_is_compact_and_bounded(tmp_path: Path) -> None:
    tracker = ProgressTracker(str(tmp_path), retention_s=600.0, max_gone=256)
    live: list[int] = []
    for step in range(200):  # 10 new declared containers a cycle, each living 3 cycles
        live = [n for n in live if n > step * 10 - 30] + list(range(step * 10, step * 10 + 10))
        out = tracker.collect([usage_of(declared(n), 10 + n) for n in live], float(step))
        assert len(out) == len(live)
        assert tracker.sizes()["gone"] <= 256 and tracker.sizes()["live"] == len(live)
    assert tracker.sizes()["gone"] >= 256 * 7 // 8
    assert all(isinstance(away, tuple) for away in tracker._gone.values())  # packed, no identity held
    tracker.collect([], 200.0)
    tracker.collect([], 200.0 + 601.0)
    assert tracker.sizes() == {"live": 0, "gone": 0}  # all older than retention


def test_progress_history_comes_back_whole_within_retention(tmp_path: Path) -> None:
    root = tmp_path / "42" / "root"
    root.mkdir(parents=True)
    write_status(tmp_path / "42")
    (root / "loss").write_text("4\n")
    tracker = ProgressTracker(str(tmp_path), retention_s=100.0, window_s=30.0)
    a = declared(1)
    for t in range(5):
        (root / "loss").write_text(f"{4 - t * 0.5}\n")
        tracker.collect([usage_of(a, 42)], float(t))
    for t in range(5, 20):
        tracker.collect([usage_of(declared(1000 + t), 99)], float(t))  # a is away
    (p,) = tracker.collect([usage_of(a, 42)], 20.0)
    assert p.first_value == 4.0 and p.reads_total == 6 and p.window_s == 20.0
    assert p.rate_per_second == pytest.approx(2.0 / 20.0)  # (4 - 2) over [0, 20]: the samples came back
    tracker.collect([], 21.0)
    (p,) = tracker.collect([usage_of(a, 42)], 21.0 + 101.0)  # away longer than retention
    assert p.reads_total == 1


# ---- signal collector -----------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def xid_line(seq: int, pid: int) -> str:
    usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)  # logged now (older records are not charged)
    return f"3,{seq},{usec},-;NVRM: Xid (PCI:0000:1b:00): 13, pid={pid}, name=w, test\n"


def test_xid_counters_of_gone_containers_expire_in_batches_and_are_bounded(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("")
    clock = Clock()
    collector = SignalCollector(kmsg=KmsgReader(str(log)), xid_retention_s=80.0, max_xid_series=50, clock=clock)
    devices = (DeviceInfo(index=0, uuid=GPU, name="sim", pci_bus_id="00000000:1B:00.0",
                          memory_total_bytes=1 << 30, memory_used_bytes=0, memory_free_bytes=1 << 30),)
    for step in range(100):  # every cycle a new container gets an Xid and goes
        clock.now = float(step)
        with log.open("a") as f:
            f.write(xid_line(step + 1, 5000 + step))
        ids = {5000 + step: ProcessIdentity(5000 + step, 1, "w", identity(step))}
        signals = collector.collect(devices, None, [usage_of(identity(step), 5000 + step)], ids)
        assert len(signals.container_xids) <= 50
    assert {x.identity.pod_name for x in signals.container_xids} >= {"pod-99"}
    view = signals.container_xids
    clock.now = 100.0
    assert collector.collect(devices, None, [], {}).container_xids is view  # nothing changed: not rebuilt
    clock.now = 99.0 + 80.0 + 80.0 / 8 + 1.0
    assert collector.collect(devices, None, [], {}).container_xids == ()


# ---- resolver -------------------------------------------------------------------------------

def test_resolver_caches_follow_live_containers_under_churn(tmp_path: Path) -> None:
    proc, unified = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    unified.mkdir()
    (proc / "self" / "mountinfo").write_text(f"41 31 0:38 / {unified} rw,relatime - cgroup2 cgroup2 rw\n")
    tasks = tmp_path / "containerd" / "k8s.io"
    tasks.mkdir(parents=True)
    clock = Clock()
    roots = BundleRoots(containerd_tasks=(str(tmp_path / "containerd"),), crio_containers=(), runc_state=(),
                        docker_containers=())
    resolver = IdentityResolver(proc_root=str(proc), bundle_roots=roots, clock=clock)
    live: list[int] = []

    def start(n: int) -> None:
        path = f"/kubepods/besteffort/pod{n:08x}-0000-0000-0000-000000000000/{n:064x}"
        (unified / path.lstrip("/")).mkdir(parents=True)
        (tasks / f"{n:064x}").mkdir()
        (tasks / f"{n:064x}" / "config.json").write_text(json.dumps({"annotations": {
            "io.kubernetes.cri.sandbox-name": f"pod-{n}", "io.kubernetes.cri.sandbox-namespace": "ns"}}))
        pid = proc / str(10 + n)
        pid.mkdir()
        (pid / "stat").write_text(f"{10 + n} (w) S 1 " + " ".join(["0"] * 16 + ["77"] + ["0"] * 30) + "\n")
        (pid / "cgroup").write_text(f"0::{path}\n")
        (pid / "status").write_text(f"Name:\tw\nNSpid:\t{10 + n}\t1\n")

    def stop(n: int) -> None:
        shutil.rmtree(proc / str(10 + n))
        path = unified / "kubepods" / "besteffort" / f"pod{n:08x}-0000-0000-0000-000000000000"
        (path / f"{n:064x}").rmdir()
        path.rmdir()
        shutil.rmtree(tasks / f"{n:064x}")

    for step in range(60):  # 5 new containers a sweep, each living 3 sweeps
        clock.now = float(step)
        for n in [n for n in live if n <= step * 5 - 15]:
            stop(n)
            live.remove(n)
        for n in range(step * 5, step * 5 + 5):
            start(n)
            live.append(n)
        resolver.begin_sweep()
        found = resolver.resolve_pids([10 + n for n in live])
        assert len(found) == len(live)
        sizes = resolver.cache_sizes()
        assert sizes["paths"] <= len(live) + 5 and sizes["metadata"] <= len(live) + 5
        assert sizes["pids"] <= len(live) + 5
    assert len(resolver.index) <= 2 * len(live) + 10  # cgroup id index: live dirs and their parents
