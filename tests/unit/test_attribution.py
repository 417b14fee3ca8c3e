"""attribute(): per container per GPU usage, rollups, and the kernel-seconds counter."""

from __future__ import annotations

import random

import pytest

from gpuwatch.core.model import HOST_IDENTITY, GpuProcess, GpuSweep, ProcessIdentity
from gpuwatch.pipeline.attribution import AttributionState, attribute
from tests.unit.gpu_fakes import GIB, container, device

A = container("aaaa1111", namespace="team-a", pod="train-0", name="trainer", pod_uid="uid-a")
A2 = container("aaaa2222", namespace="team-a", pod="train-0", name="sidecar", pod_uid="uid-a")
B = container("bbbb1111", namespace="team-b", pod="infer-0", name="server", pod_uid="uid-b")
C = container("cccc1111")  # plain runc container: no pod, no namespace


def ident(pid: int, identity=A, cpid: int | None = None) -> ProcessIdentity:  # type: ignore[no-untyped-def]
    return ProcessIdentity(pid=pid, container_pid=cpid, comm=f"p{pid}", identity=identity)


def proc(pid: int, gpu: int = 0, mem: int | None = GIB, util: float | None = 0.5) -> GpuProcess:
    return GpuProcess(pid=pid, gpu_uuid=f"GPU-fake-{gpu}", gpu_index=gpu, memory_bytes=mem,
                      sm_utilization_ratio=util)


def sweep(t: float, *procs: GpuProcess) -> GpuSweep:
    return GpuSweep(timestamp_s=t, devices=(device(0), device(1)), processes=procs)


def test_memory_and_utilisation_per_container_per_gpu() -> None:
    ids = {1: ident(1, A, 7), 2: ident(2, A, 8), 3: ident(3, B), 4: ident(4, A)}
    s = sweep(10.0, proc(1, 0, 3 * GIB, 0.25), proc(2, 0, 5 * GIB, 0.5), proc(3, 0, GIB, 0.1),
              proc(4, 1, 2 * GIB, 0.75))
    r = attribute(s, ids, AttributionState(), "n1")
    by = {(u.identity.key, u.gpu_index): u for u in r.containers}
    assert by[(A.key, 0)].memory_bytes == 8 * GIB
    assert by[(A.key, 0)].sm_utilization_ratio == pytest.approx(0.75)
    assert [(p.pid, p.container_pid) for p in by[(A.key, 0)].processes] == [(1, 7), (2, 8)]
    assert by[(A.key, 1)].memory_bytes == 2 * GIB
    assert by[(B.key, 0)].memory_bytes == GIB
    assert len(r.containers) == 3


def test_utilisation_is_capped_at_one_and_none_counts_as_nothing() -> None:
    ids = {1: ident(1), 2: ident(2), 3: ident(3)}
    s = sweep(1.0, proc(1, util=0.8), proc(2, util=0.7), proc(3, mem=None, util=None))
    (usage,) = attribute(s, ids, AttributionState(), "n").containers
    assert usage.sm_utilization_ratio == 1.0
    assert usage.memory_bytes == 2 * GIB
    assert [p.memory_bytes for p in usage.processes] == [GIB, GIB, None]


def test_unknown_pids_go_to_the_host_bucket() -> None:
    r = attribute(sweep(1.0, proc(1), proc(99, mem=4 * GIB)), {1: ident(1)}, AttributionState(), "n")
    host = [u for u in r.containers if u.identity == HOST_IDENTITY]
    assert len(host) == 1 and host[0].memory_bytes == 4 * GIB
    assert host[0].processes[0].pid == 99 and host[0].processes[0].container_pid is None


def test_kernel_seconds_integrate_utilisation_over_time() -> None:
    ids = {1: ident(1)}
    state = AttributionState()
    total = 0.0
    for step in range(11):  # first sweep sets the baseline, then 10 intervals of 0.5 s at 0.6
        r = attribute(sweep(100.0 + 0.5 * step, proc(1, util=0.6)), ids, state, "n")
        state = r.state
        total = r.containers[0].kernel_seconds_total
    assert total == pytest.approx(0.6 * 5.0)


def test_kernel_seconds_survive_process_churn_inside_the_container() -> None:
    state = AttributionState()
    seen = []
    for step in range(20):
        pid = 1000 + step // 3  # a new process every 3 sweeps, same container
        r = attribute(sweep(float(step), proc(pid, util=1.0)), {pid: ident(pid)}, state, "n")
        state = r.state
        seen.append(r.containers[0].kernel_seconds_total)
    assert seen == sorted(seen)
    assert seen[-1] == pytest.approx(19.0)


def test_kernel_seconds_resume_after_the_container_was_briefly_absent() -> None:
    ids = {1: ident(1)}
    r1 = attribute(sweep(0.0, proc(1, util=1.0)), ids, AttributionState(), "n")
    r2 = attribute(sweep(1.0, proc(1, util=1.0)), ids, r1.state, "n")
    r3 = attribute(sweep(2.0), ids, r2.state, "n")  # no processes listed this time
    assert r3.containers == ()
    r4 = attribute(sweep(3.0, proc(1, util=1.0)), ids, r3.state, "n")
    assert r4.containers[0].kernel_seconds_total == pytest.approx(2.0)


def test_time_jumps_are_clamped_and_backwards_time_adds_nothing() -> None:
    ids = {1: ident(1)}
    r1 = attribute(sweep(0.0, proc(1, util=1.0)), ids, AttributionState(), "n")
    r2 = attribute(sweep(3600.0, proc(1, util=1.0)), ids, r1.state, "n", max_dt_s=5.0)
    assert r2.containers[0].kernel_seconds_total == pytest.approx(5.0)
    r3 = attribute(sweep(3000.0, proc(1, util=1.0)), ids, r2.state, "n", max_dt_s=5.0)
    assert r3.containers[0].kernel_seconds_total == pytest.approx(5.0)


def test_state_is_an_immutable_value_and_attribute_is_pure() -> None:
    ids = {1: ident(1)}
    r1 = attribute(sweep(0.0, proc(1, util=1.0)), ids, AttributionState(), "n")
    r2a = attribute(sweep(2.0, proc(1, util=0.5)), ids, r1.state, "n")
    r2b = attribute(sweep(2.0, proc(1, util=0.5)), ids, r1.state, "n")
    assert r2a == r2b
    assert r1.state.containers[(A.key, "GPU-fake-0")][0] == 0.0
    with pytest.raises(TypeError):
        r1.state.containers[(A.key, "GPU-fake-0")] = (5.0, 0.0)  # type: ignore[index]


def test_pod_and_namespace_rollups() -> None:
    ids = {1: ident(1, A), 2: ident(2, A2), 3: ident(3, B), 4: ident(4, A), 5: ident(5, C)}
    procs = (proc(1, 0, GIB, 0.5), proc(2, 0, 2 * GIB, 0.25), proc(3, 0, 4 * GIB, 0.1),
             proc(4, 1, 8 * GIB, 1.0), proc(5, 1, 16 * GIB, 0.3))
    r1 = attribute(sweep(0.0, *procs), ids, AttributionState(), "n")
    r = attribute(sweep(2.0, *procs), ids, r1.state, "n")
    pods = {(p.namespace, p.pod): p for p in r.pods}
    assert set(pods) == {("team-a", "train-0"), ("team-b", "infer-0")}
    train = pods[("team-a", "train-0")]
    assert train.memory_bytes == 11 * GIB and train.containers == 2 and train.pod_uid == "uid-a"
    assert train.sm_utilization_ratio == pytest.approx(1.75)
    assert train.kernel_seconds_total == pytest.approx(3.5)
    nss = {n.namespace: n for n in r.namespaces}
    assert set(nss) == {"team-a", "team-b"}  # the plain runc container is in neither
    assert nss["team-b"].memory_bytes == 4 * GIB and nss["team-b"].kernel_seconds_total == pytest.approx(0.2)
    for group in (*r.pods, *r.namespaces):
        members = [u for u in r.containers if u.identity.pod_namespace == group.namespace
                   and (not group.pod or u.identity.pod_name == group.pod)]
        assert group.memory_bytes == sum(u.memory_bytes for u in members)
        assert group.kernel_seconds_total == pytest.approx(sum(u.kernel_seconds_total for u in members))


def test_pod_counter_does_not_drop_when_one_of_its_containers_exits() -> None:
    ids = {1: ident(1, A), 2: ident(2, A2)}
    r1 = attribute(sweep(0.0, proc(1, util=1.0), proc(2, util=1.0)), ids, AttributionState(), "n")
    r2 = attribute(sweep(1.0, proc(1, util=1.0), proc(2, util=1.0)), ids, r1.state, "n")
    r3 = attribute(sweep(2.0, proc(1, util=1.0)), ids, r2.state, "n")  # sidecar exited
    assert r2.pods[0].kernel_seconds_total == pytest.approx(2.0)
    assert r3.pods[0].kernel_seconds_total == pytest.approx(3.0)


def test_counters_are_forgotten_after_retention() -> None:
    ids = {1: ident(1)}
    r1 = attribute(sweep(0.0, proc(1, util=1.0)), ids, AttributionState(), "n")
    r2 = attribute(sweep(1.0, proc(1, util=1.0)), ids, r1.state, "n")
    r3 = attribute(sweep(50.0), ids, r2.state, "n", retention_s=100.0)
    assert (A.key, "GPU-fake-0") in r3.state.containers
    r4 = attribute(sweep(200.0), ids, r3.state, "n", retention_s=100.0)
    assert r4.state.containers == {} and r4.state.pods == {} and r4.state.namespaces == {}


@pytest.mark.parametrize("seed", range(25))
def test_property_counters_never_go_backwards_and_match_the_integral(seed: int) -> None:
    """Random churn, random utilisation, random (sometimes backwards or huge) time steps."""
    rng = random.Random(seed)
    identities = [A, A2, B, C, HOST_IDENTITY]
    max_dt = 5.0
    state = AttributionState()
    t = 0.0
    last: dict[tuple[str, str], float] = {}
    last_group: dict[tuple[str, ...], float] = {}
    expected: dict[tuple[str, str], float] = {}
    prev_t: float | None = None
    next_pid = 1
    live: dict[int, tuple[int, object]] = {}  # pid -> (gpu, identity)
    for _ in range(60):
        for pid in [p for p in live if rng.random() < 0.2]:
            del live[pid]
        for _ in range(rng.randint(0, 3)):
            live[next_pid] = (rng.randint(0, 1), rng.choice(identities))
            next_pid += 1
        t += rng.choice([0.1, 0.5, 1.0, 1.0, 2.0, 30.0, -3.0])
        procs = [proc(pid, gpu, rng.randint(0, 4) * GIB, rng.choice([None, 0.0, 0.3, 0.9]))
                 for pid, (gpu, _) in live.items()]
        ids = {pid: ident(pid, who) for pid, (_, who) in live.items() if who is not HOST_IDENTITY}
        r = attribute(sweep(t, *procs), ids, state, "n", max_dt_s=max_dt, retention_s=1e9)
        dt = 0.0 if prev_t is None else min(max(t - prev_t, 0.0), max_dt)
        prev_t = t
        state = r.state
        for u in r.containers:
            key = (u.identity.key, u.gpu_uuid)
            assert 0.0 <= u.sm_utilization_ratio <= 1.0
            assert u.kernel_seconds_total >= last.get(key, 0.0) - 1e-9
            expected[key] = expected.get(key, 0.0) + u.sm_utilization_ratio * dt
            assert u.kernel_seconds_total == pytest.approx(expected[key])
            last[key] = u.kernel_seconds_total
            assert u.memory_bytes == sum(p.memory_bytes or 0 for p in u.processes)
        for g in (*r.pods, *r.namespaces):
            gkey = (g.namespace, g.pod, g.pod_uid)
            assert g.kernel_seconds_total >= last_group.get(gkey, 0.0) - 1e-9
            last_group[gkey] = g.kernel_seconds_total
        assert sum(u.memory_bytes for u in r.containers) == sum(p.memory_bytes or 0 for p in procs)
        assert sum(len(u.processes) for u in r.containers) == len(procs)
