"""Sampler: publishing, surviving GPU backend failures, recovery with backoff, probes."""

from __future__ import annotations

import threading
import time

import pytest

from gpuwatch.core.errors import NvmlCallFailed
from gpuwatch.core.model import GpuSweep, ProbeCounters
from gpuwatch.pipeline.sampler import Sampler
from tests.unit.gpu_fakes import GIB, FakeBackend, FakeProbes, FakeResolver, FakeWorld, container, factory_for

A = container("aaaa", namespace="ns1", pod="p1", name="c1", cgroup_id=501)
B = container("bbbb", namespace="ns2", pod="p2", name="c2", cgroup_id=502)


def make(world: FakeWorld, **kw: object) -> tuple[Sampler, FakeResolver]:
    resolver = FakeResolver()
    resolver.add(10, A, 1)
    resolver.add(20, B, 1)
    sampler = Sampler(factory_for(world), resolver, "node-1", interval_s=1.0, clock=world.clock,
                      **kw)  # type: ignore[arg-type]
    return sampler, resolver


def test_run_once_publishes_an_attributed_snapshot() -> None:
    world = FakeWorld(procs={(10, 0): (3 * GIB, 0.5), (20, 1): (GIB, 0.25)})
    sampler, resolver = make(world)
    assert sampler.latest().gpu_up is False  # nothing sampled yet
    snap = sampler.run_once()
    assert sampler.latest() is snap
    assert snap.gpu_up and snap.gpu_error is None and snap.node == "node-1"
    assert len(snap.devices) == 2
    assert {(c.identity.key, c.gpu_index, c.memory_bytes) for c in snap.containers} == {
        ("aaaa", 0, 3 * GIB), ("bbbb", 1, GIB)}
    assert {p.pod for p in snap.pods} == {"p1", "p2"}
    assert resolver.sweeps == 1
    assert snap.cycle_seconds > 0.0 and snap.cycle_cpu_seconds >= 0.0


def test_kernel_seconds_accumulate_across_cycles() -> None:
    world = FakeWorld(procs={(10, 0): (GIB, 0.5)})
    sampler, _ = make(world)
    for _ in range(5):
        snap = sampler.run_once()
        world.now_s += 1.0
    assert snap.containers[0].kernel_seconds_total == pytest.approx(2.0)


def test_backend_failure_marks_gpu_down_and_recovers_with_backoff() -> None:
    world = FakeWorld(procs={(10, 0): (GIB, 1.0)})
    sampler, _ = make(world, max_backoff_s=4.0)
    sampler.run_once()
    world.now_s += 1.0
    before = sampler.run_once().containers[0].kernel_seconds_total
    assert before == pytest.approx(1.0)

    world.down = True
    downs = []
    for _ in range(12):
        world.now_s += 1.0
        snap = sampler.run_once()
        downs.append(snap)
    assert all(not s.gpu_up and s.devices == () and s.containers == () for s in downs)
    assert "fake" in (downs[0].gpu_error or "")
    # the factory is retried with backoff 1, 2, 4, 4... not every cycle
    attempts_while_down = world.creations
    assert attempts_while_down == 1  # only the first creation succeeded; later tries raised

    world.down = False
    recovered = None
    for _ in range(6):
        world.now_s += 1.0
        snap = sampler.run_once()
        if snap.gpu_up:
            recovered = snap
            break
    assert recovered is not None, "sampler did not recover within the max backoff"
    assert world.creations == 2
    # counters kept, and nothing integrated over the outage
    assert recovered.containers[0].kernel_seconds_total == pytest.approx(before)
    world.now_s += 1.0
    assert sampler.run_once().containers[0].kernel_seconds_total == pytest.approx(before + 1.0)


def test_backoff_limits_factory_calls() -> None:
    calls = []

    def failing_factory() -> FakeBackend:
        calls.append(1)
        raise NvmlCallFailed("no driver")

    world = FakeWorld()
    sampler = Sampler(failing_factory, FakeResolver(), "n", interval_s=1.0, clock=world.clock,
                      max_backoff_s=8.0)
    for _ in range(40):
        snap = sampler.run_once()
        world.now_s += 1.0
    assert not snap.gpu_up and "no driver" in (snap.gpu_error or "")
    # tries at t=0,1,3,7,15,23,31,39 -> 8 (every cycle would be 40)
    assert len(calls) == 8


def test_sweep_failure_closes_the_old_backend() -> None:
    world = FakeWorld()
    backends: list[FakeBackend] = []

    def factory() -> FakeBackend:
        backends.append(FakeBackend(world))
        return backends[-1]

    sampler = Sampler(factory, FakeResolver(), "n", clock=world.clock)
    sampler.run_once()
    world.down = True
    sampler.run_once()
    assert backends[0].closed


def test_field_errors_are_counted_into_the_snapshot() -> None:
    world = FakeWorld(field_errors=("GPU 0 power: Not Supported",))
    sampler, _ = make(world)
    sampler.run_once()
    snap = sampler.run_once()
    assert snap.gpu_errors_total == 2 and "GPU 0 power: Not Supported" in snap.notes


def test_probe_counters_are_merged_by_cgroup_id() -> None:
    world = FakeWorld(procs={(10, 0): (GIB, 0.5), (20, 1): (GIB, 0.5)})
    counters = (ProbeCounters(cgroup_id=501, ioctl_calls_by_op=(("alloc", 7),), allocations_total=3),
                ProbeCounters(cgroup_id=999, allocations_total=1))
    sampler, _ = make(world, probe_source=FakeProbes(counters))
    snap = sampler.run_once()
    by = {c.identity.key: c for c in snap.containers}
    assert by["aaaa"].probe is not None and by["aaaa"].probe.allocations_total == 3
    assert by["bbbb"].probe is None
    assert snap.probes_up and snap.probe_counters == counters
    assert dict(snap.probe_identities) == {501: A}


def test_probe_read_failure_is_reported_not_fatal() -> None:
    world = FakeWorld(procs={(10, 0): (GIB, 0.5)})
    sampler, _ = make(world, probe_source=FakeProbes(fail=True))
    snap = sampler.run_once()
    assert snap.gpu_up and not snap.probes_up
    assert any("probe counters unavailable" in n for n in snap.notes)


class ExplodingBackend:
    def sweep(self) -> GpuSweep:
        raise RuntimeError("bug in a backend")

    def close(self) -> None:
        pass


def test_thread_loop_publishes_and_survives_unexpected_errors() -> None:
    world = FakeWorld(procs={(10, 0): (GIB, 0.5)})
    resolver = FakeResolver()
    sampler = Sampler(factory_for(world), resolver, "n", interval_s=0.02)
    sampler.start()
    try:
        deadline = time.monotonic() + 5
        while world.sweeps < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert world.sweeps >= 3 and sampler.latest().gpu_up
    finally:
        sampler.stop()
    assert not sampler.running

    broken = Sampler(ExplodingBackend, resolver, "n", interval_s=0.02)
    broken.start()
    try:
        deadline = time.monotonic() + 5
        while "bug in a backend" not in (broken.latest().gpu_error or "") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert broken.running, "the loop died on an unexpected error"
        assert "bug in a backend" in (broken.latest().gpu_error or "")
    finally:
        broken.stop()


def test_a_pid_gone_from_proc_but_still_listed_keeps_its_container() -> None:
    world = FakeWorld(procs={(10, 0): (GIB, 0.5)})
    sampler, resolver = make(world)
    sampler.run_once()
    del resolver.table[10]  # exited: /proc no longer knows it, NVML still lists it
    world.now_s += 1
    snap = sampler.run_once()
    assert [c.identity.key for c in snap.containers] == ["aaaa"]
    del world.procs[(10, 0)]
    world.now_s += 1
    assert sampler.run_once().containers == ()
    world.procs[(10, 0)] = (GIB, 0.5)  # the pid number comes back, unknown to /proc: host
    world.now_s += 1
    assert [c.identity.runtime for c in sampler.run_once().containers] == ["host"]


def test_wake_takes_a_cycle_now_and_a_storm_of_wakes_is_rate_limited() -> None:
    world = FakeWorld(procs={(10, 0): (GIB, 0.5)})
    sampler = Sampler(factory_for(world), FakeResolver(), "n", interval_s=5.0)  # wake gap: 0.5 s
    assert sampler.wake_gap_s == 0.5
    sampler.start()
    try:
        first = sampler.wait_newer(sampler.latest().timestamp_s, timeout_s=5)
        time.sleep(sampler.wake_gap_s)
        world.now_s += 1  # the fake GPU's clock: the next sweep's timestamp
        woken_at = time.monotonic()
        sampler.wake()
        second = sampler.wait_newer(first.timestamp_s, timeout_s=4)
        assert second.timestamp_s != first.timestamp_s, "wake() did not take a cycle before the next tick"
        assert time.monotonic() - woken_at < 2.5  # the tick was 5 s away
        before = world.sweeps
        storm_end = time.monotonic() + 1.5
        while time.monotonic() < storm_end:  # 150 wakes in 1.5 s: at most one cycle per 0.5 s gap
            sampler.wake()
            time.sleep(0.01)
        assert 1 <= world.sweeps - before <= 4
    finally:
        sampler.stop()
    assert not sampler.running


def test_wait_newer_returns_the_same_snapshot_when_nothing_is_published() -> None:
    world = FakeWorld(procs={(10, 0): (GIB, 0.5)})
    sampler = Sampler(factory_for(world), FakeResolver(), "n", interval_s=1.0)
    published = sampler.run_once()
    t0 = time.monotonic()
    assert sampler.wait_newer(published.timestamp_s, timeout_s=0.2) is published
    assert time.monotonic() - t0 >= 0.19
    assert sampler.wait_newer(published.timestamp_s - 1, timeout_s=5) is published  # already newer: at once


def test_follow_yields_each_published_snapshot_once_and_ends_on_stop() -> None:
    world = FakeWorld(procs={(10, 0): (GIB, 0.5)})
    sampler = Sampler(factory_for(world), FakeResolver(), "n", interval_s=1.0)
    stop = threading.Event()
    seen: list[float] = []

    def consume() -> None:
        for snapshot in sampler.follow(stop, poll_s=0.05):
            seen.append(snapshot.timestamp_s)

    consumer = threading.Thread(target=consume)
    consumer.start()
    try:
        for _ in range(3):
            world.now_s += 1
            sampler.run_once()
            deadline = time.monotonic() + 5
            while (not seen or seen[-1] != world.now_s) and time.monotonic() < deadline:
                time.sleep(0.01)
        time.sleep(0.2)  # nothing new published: nothing yielded again
    finally:
        stop.set()
        consumer.join(5)
    assert not consumer.is_alive(), "follow() did not end when stop was set"
    assert len(seen) == 3 and len(set(seen)) == 3 and seen == sorted(seen), seen
