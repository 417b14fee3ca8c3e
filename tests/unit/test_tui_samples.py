"""Hand-built Snapshots shared by the `gpuwatch top` tests (plain values, no sampler),
plus checks that the samples say what the other tests assume they say."""

from __future__ import annotations

from gpuwatch.core.model import (
    HOST_IDENTITY,
    ContainerIdentity,
    ContainerUsage,
    DeviceInfo,
    GroupUsage,
    ProbeCounters,
    ProcessUsage,
    Snapshot,
)

GIB = 1024**3
MIB = 1024**2
T0 = 1_795_000_000.0


def device(index: int, used_bytes: int | None = 10 * GIB, total_bytes: int | None = 40 * GIB,
           **kw: object) -> DeviceInfo:
    defaults: dict[str, object] = dict(
        uuid=f"GPU-{index:08d}-sim", name=f"Simulated A100 #{index}", pci_bus_id=f"0000:0{index}:00.0",
        utilization_gpu_ratio=0.5, temperature_celsius=61.0, power_watts=120.0, power_limit_watts=300.0,
        simulated=True,
    )
    defaults.update(kw)
    free = None if used_bytes is None or total_bytes is None else total_bytes - used_bytes
    return DeviceInfo(index=index, memory_total_bytes=total_bytes, memory_used_bytes=used_bytes,
                      memory_free_bytes=free, **defaults)  # type: ignore[arg-type]


def ident(ns: str, pod: str, name: str, cid: str) -> ContainerIdentity:
    return ContainerIdentity(runtime="containerd", cgroup_path=f"/kubepods/pod-{pod}/{cid}",
                             container_id=cid, container_name=name, pod_name=pod, pod_namespace=ns,
                             pod_uid=f"uid-{pod}")


def usage(identity: ContainerIdentity, gpu: int, memory_bytes: int, sm: float, kernel_s: float,
          pids: tuple[tuple[int, int | None, str, int | None], ...] = (),
          probe: ProbeCounters | None = None) -> ContainerUsage:
    procs = tuple(ProcessUsage(pid=p, container_pid=c, comm=comm, memory_bytes=m, sm_utilization_ratio=sm)
                  for p, c, comm, m in pids)
    return ContainerUsage(identity=identity, gpu_index=gpu, gpu_uuid=f"GPU-{gpu:08d}-sim",
                          memory_bytes=memory_bytes, sm_utilization_ratio=sm, kernel_seconds_total=kernel_s,
                          processes=procs, probe=probe)


TRAINER = ident("team-a", "train-0", "trainer", "aaaa1111bbbb2222cccc")
SERVER = ident("team-a", "serve-1", "server", "dddd3333eeee4444ffff")
NOTEBOOK = ident("research", "nb-7", "jupyter", "9999888877776666aaaa")


def sample_snapshot(simulated: bool = True) -> Snapshot:
    """2 GPUs, 3 pods in 2 namespaces, one host process; distinct values per sort key."""
    containers = (
        usage(TRAINER, 0, 8 * GIB, 0.70, 50.0, ((4321, 1, "python3", 6 * GIB), (4322, 7, "worker", 2 * GIB)),
              probe=ProbeCounters(cgroup_id=11, ioctl_calls_by_op=(("alloc", 12000), ("free", 345)),
                                  allocations_total=34, launches_total=5600)),
        usage(SERVER, 0, 2 * GIB, 0.90, 10.0, ((5555, 1, "tritonserver", 2 * GIB),)),
        usage(NOTEBOOK, 1, 4 * GIB, 0.10, 900.0, ((6001, 12, "ipykernel", 4 * GIB),)),
        usage(HOST_IDENTITY, 1, 512 * MIB, 0.05, 1.0, ((777, None, "Xorg", 512 * MIB),)),
    )
    pods = (GroupUsage("team-a", "train-0", "uid-train-0", 8 * GIB, 0.7, 50.0, 1),
            GroupUsage("team-a", "serve-1", "uid-serve-1", 2 * GIB, 0.9, 10.0, 1),
            GroupUsage("research", "nb-7", "uid-nb-7", 4 * GIB, 0.1, 900.0, 1))
    namespaces = (GroupUsage("team-a", "", "", 10 * GIB, 1.6, 60.0, 2),
                  GroupUsage("research", "", "", 4 * GIB, 0.1, 900.0, 1))
    return Snapshot(timestamp_s=T0, node="sim-node-1", devices=(device(0), device(1, used_bytes=5 * GIB)),
                    containers=containers, pods=pods, namespaces=namespaces, simulated=simulated,
                    interval_s=1.0, cycle_seconds=0.004, notes=("probes off: not root",))


def test_sample_has_three_pods_in_two_namespaces_on_two_gpus() -> None:
    snap = sample_snapshot()
    pods = {c.identity.pod_name for c in snap.containers if c.identity.pod_name}
    assert pods == {"train-0", "serve-1", "nb-7"}
    assert {n.namespace for n in snap.namespaces} == {"team-a", "research"}
    assert {d.index for d in snap.devices} == {0, 1}


def test_sample_sort_keys_disagree() -> None:
    """The sort tests need memory, SM and kernel time to order the containers differently."""
    cs = [c for c in sample_snapshot().containers if c.identity.is_container]
    by_mem = [c.identity.container_name for c in sorted(cs, key=lambda c: -c.memory_bytes)]
    by_sm = [c.identity.container_name for c in sorted(cs, key=lambda c: -c.sm_utilization_ratio)]
    by_kernel = [c.identity.container_name for c in sorted(cs, key=lambda c: -c.kernel_seconds_total)]
    assert len({tuple(by_mem), tuple(by_sm), tuple(by_kernel)}) == 3
