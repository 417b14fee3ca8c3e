"""Per-process join of probe counters (gpuwatch/pipeline/probe_join.py), on hybrid-host shapes."""

from __future__ import annotations

from gpuwatch.core.model import ContainerIdentity, ProbeCounters, ProcessIdentity, ProcessProbe
from gpuwatch.pipeline.probe_join import join_process_probes, needs_process_join

MIB = 1 << 20
A = "a1" * 32
B = "b2" * 32
ROOT = ContainerIdentity(runtime="host", cgroup_path="/", cgroup_id=1)
DOCKERD = ContainerIdentity(runtime="systemd", cgroup_path="/system.slice/docker.service", cgroup_id=50,
                            container_name="docker")
CA = ContainerIdentity(runtime="docker", cgroup_path=f"/docker/{A}", container_id=A)
CB = ContainerIdentity(runtime="docker", cgroup_path=f"/docker/{B}", container_id=B)


def proc(pid: int, identity: ContainerIdentity, unified: str | None) -> ProcessIdentity:
    return ProcessIdentity(pid=pid, container_pid=None, comm="w", identity=identity, unified_path=unified)


def counter(cgroup_id: int, gpu0: int, cuda: int, allocs: int) -> ProbeCounters:
    return ProbeCounters(cgroup_id=cgroup_id, ioctl_calls_by_op=(("rm_alloc", allocs + 4),),
                         allocated_bytes_by_gpu=((0, gpu0),), allocations_total=allocs,
                         cuda_allocated_bytes=cuda, cuda_allocations_total=allocs)


def test_join_is_needed_only_where_a_v2_cgroup_does_not_name_the_process() -> None:
    assert not needs_process_join([proc(1, CA, CA.cgroup_path)])
    assert needs_process_join([proc(1, CA, "/")])
    assert needs_process_join([proc(1, CA, None)])  # a v1-only host: the probes see one cgroup


def test_a_v1_named_workload_alone_in_the_v2_root_gets_the_whole_counter() -> None:
    counters = (counter(1, 300 * MIB, 256 * MIB, 3),)
    processes = (ProcessProbe(tgid=10, cgroup_id=1, allocated_bytes_by_gpu=((0, 300 * MIB),),
                              cuda_allocated_bytes=256 * MIB),)
    out, ids = join_process_probes(counters, ((1, ROOT),), processes, {10: proc(10, CA, "/")})
    assert dict(ids) == {-1: CA}
    (joined,) = out
    assert joined.allocated_bytes_by_gpu == ((0, 300 * MIB),) and joined.allocations_total == 3
    assert joined.ioctl_calls_by_op == (("rm_alloc", 7),)


def test_two_containers_sharing_one_v2_cgroup_get_their_own_bytes() -> None:
    counters = (counter(50, 500 * MIB, 400 * MIB, 5),)
    processes = (
        ProcessProbe(tgid=10, cgroup_id=50, allocated_bytes_by_gpu=((0, 200 * MIB),), cuda_allocated_bytes=150 * MIB),
        ProcessProbe(tgid=11, cgroup_id=50, allocated_bytes_by_gpu=((0, 100 * MIB),), cuda_allocated_bytes=100 * MIB),
        ProcessProbe(tgid=20, cgroup_id=50, allocated_bytes_by_gpu=((0, 200 * MIB),), cuda_allocated_bytes=150 * MIB),
    )
    named = {10: proc(10, CA, DOCKERD.cgroup_path), 11: proc(11, CA, DOCKERD.cgroup_path),
             20: proc(20, CB, DOCKERD.cgroup_path)}
    out, ids = join_process_probes(counters, ((50, DOCKERD),), processes, named)
    by_key = {identity.key: c for cg, identity in ids for c in out if c.cgroup_id == cg}
    assert dict(by_key[A].allocated_bytes_by_gpu) == {0: 300 * MIB} and by_key[A].cuda_allocated_bytes == 250 * MIB
    assert dict(by_key[B].allocated_bytes_by_gpu) == {0: 200 * MIB} and by_key[B].cuda_allocated_bytes == 150 * MIB
    shared = by_key[DOCKERD.key]
    assert dict(shared.allocated_bytes_by_gpu) == {0: 0} and shared.cuda_allocated_bytes == 0
    assert shared.allocations_total == 5  # counts are per cgroup: they stay with it
    assert by_key[A].allocations_total == 0 and by_key[A].cgroup_id < 0


def test_a_container_in_its_own_cgroup_is_left_alone() -> None:
    counters = (counter(77, 64 * MIB, 64 * MIB, 1),)
    own = ContainerIdentity(runtime="docker", cgroup_path=f"/docker/{A}", container_id=A, cgroup_id=77)
    processes = (ProcessProbe(tgid=10, cgroup_id=77, allocated_bytes_by_gpu=((0, 64 * MIB),)),)
    out, ids = join_process_probes(counters, ((77, own),), processes, {10: proc(10, own, own.cgroup_path)})
    assert out == counters and ids == ((77, own),)


def test_an_exited_process_stays_with_its_cgroup() -> None:
    counters = (counter(50, 300 * MIB, 0, 2),)
    processes = (ProcessProbe(tgid=10, cgroup_id=50, allocated_bytes_by_gpu=((0, 200 * MIB),)),
                 ProcessProbe(tgid=99, cgroup_id=50, allocated_bytes_by_gpu=((0, 100 * MIB),)))
    out, ids = join_process_probes(counters, ((50, DOCKERD),), processes, {10: proc(10, CA, DOCKERD.cgroup_path)})
    by_key = {identity.key: c for cg, identity in ids for c in out if c.cgroup_id == cg}
    assert dict(by_key[A].allocated_bytes_by_gpu) == {0: 200 * MIB}
    assert dict(by_key[DOCKERD.key].allocated_bytes_by_gpu) == {0: 100 * MIB}


def test_counters_of_one_container_from_several_cgroups_are_one() -> None:
    counters = (counter(1, 100 * MIB, 0, 1), counter(50, 200 * MIB, 0, 2))
    processes = (ProcessProbe(tgid=10, cgroup_id=1, allocated_bytes_by_gpu=((0, 100 * MIB),)),
                 ProcessProbe(tgid=11, cgroup_id=50, allocated_bytes_by_gpu=((0, 200 * MIB),)))
    named = {10: proc(10, CA, "/"), 11: proc(11, CA, DOCKERD.cgroup_path)}
    out, ids = join_process_probes(counters, ((1, ROOT), (50, DOCKERD)), processes, named)
    assert [identity.key for _, identity in ids] == [A]
    assert dict(out[0].allocated_bytes_by_gpu) == {0: 300 * MIB} and out[0].allocations_total == 3
