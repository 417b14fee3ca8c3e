"""Probes against the simulated GPU node's workloads in runc pods (root + BCC + runc).

Two pods run the sim's native `simworker`, which goes through the sim's stub libcuda
(bind-mounted read-only: both containers map the same inode) and issues real-encoded
RM_ALLOC/RM_FREE ioctls on the sim's device nodes. The probes must attribute the bytes to
each pod's cgroup exactly as the sim's own ledger (what its fake NVML reports) has them,
resolve the pods' identity, and return everything when the pods stop.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.containers import BundleRoots
from gpuwatch.containers.resolver import IdentityResolver
from gpuwatch.core.model import ProbeCounters
from gpuwatch.probes.manager import ProbeConfig, ProbeManager
from gpuwatch.sim import node as simnode
from gpuwatch.sim.runc import ContainerLab, ContainerSpec, RunningContainer
from tests.conftest import need_bcc
from tests.system.sim_helpers import (
    CONTEXT_BYTES,
    CONTEXT_MEMORY_OBJECTS,
    context_objects,
    end_trace,
    gpuwatch_trace,
    sim_container,
)

MiB = 1 << 20


@pytest.fixture
def sim(tmp_path: Path, runc_required: str) -> Iterator[simnode.SimNode]:
    need_bcc()
    name = f"p{uuid.uuid4().hex[:10]}"
    state = Path("/dev/shm") / f"gpuwatch-sim-{name}"
    node = simnode.up(devices=2, name=name, state_path=state, root=tmp_path / "simroot")
    try:
        yield node
    finally:
        simnode.down(name, state_path=state)


def _worker(sim: simnode.SimNode, pod: str, gpu: int, mib: int, steps: int) -> ContainerSpec:
    argv = [str(sim.libraries.worker_path), "--gpu", str(gpu), "--mib-per-step", str(mib), "--steps", str(steps),
            "--lifetime-s", "0"]
    return sim_container(sim, "worker", argv, namespace="probe-test", pod=pod, runtime="k8s")


def _wait_ready(container: RunningContainer, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while "ready" not in container.logs():
        assert container.running(), container.logs()[-500:]
        assert time.monotonic() < deadline, "simworker not ready"
        time.sleep(0.05)


def _counters(pm: ProbeManager, cgroup_id: int) -> ProbeCounters:
    found = [c for c in pm.read() if c.cgroup_id == cgroup_id]
    assert found, f"no probe counters for cgroup {cgroup_id}"
    return found[0]


def test_sim_pods_are_attributed_like_the_sim_ledger(sim: simnode.SimNode, tmp_path: Path) -> None:
    config = ProbeConfig(device_prefix=str(sim.dev_dir / "nvidia"),
                         libcuda_paths=(str(sim.libraries.cuda_path),), launch_uprobes=True,
                         scan_all_processes=False)
    with ProbeManager(config) as pm, ContainerLab(tmp_path / "work", bundle_root=tmp_path / "bundles",
                                                  docker_root=tmp_path / "docker",
                                                  runc_root=tmp_path / "runc") as lab:
        a = lab.run(_worker(sim, "pod-a", gpu=0, mib=64, steps=3))
        b = lab.run(_worker(sim, "pod-b", gpu=1, mib=32, steps=5))
        _wait_ready(a)
        _wait_ready(b)
        assert len(pm.attached_libraries()) >= 1
        ledger = simnode.status(sim)
        resolver = IdentityResolver(bundle_roots=BundleRoots(
            containerd_tasks=(str(tmp_path / "bundles"),), runc_state=(str(tmp_path / "runc"),),
            docker_containers=(str(tmp_path / "docker" / "containers"),)))
        for container, pod, gpu, steps, requested in ((a, "pod-a", 0, 3, 3 * 64 * MiB),
                                                      (b, "pod-b", 1, 5, 5 * 32 * MiB)):
            cg_id = container.v2_dir.stat().st_ino
            mine = [p for p in ledger.processes if p.host_pid in container.pids()]
            sim_bytes = sum(p.memory_bytes for p in mine)
            # NVML's per-process bytes: the context's own memory (518 MiB) and the steps'
            assert sim_bytes == CONTEXT_BYTES + requested
            assert sum(p.requested_bytes for p in mine) == requested
            c = _counters(pm, cg_id)
            # the libcuda uprobes see the cuMemAlloc calls (what the workload asked for), the
            # ioctl probes RM's objects, the context's included (what NVML counts)
            assert c.cuda_allocated_bytes == requested
            # the sim allocates on nvidiactl under the device object its context allocated
            # (deviceId = RM's device instance, not the minor): the bytes belong to that GPU
            assert dict(c.allocated_bytes_by_gpu) == {gpu: sim_bytes}
            # the context's client, device, subdevice and VA space, its 17 memory objects,
            # then one per step
            assert dict(c.ioctl_calls_by_op)["rm_alloc"] == 4 + CONTEXT_MEMORY_OBJECTS + steps
            assert c.cuda_allocations_total == steps  # cuMemAlloc calls: the context's are not
            identity = resolver.identity_for_cgroup_id(cg_id)
            assert identity is not None
            assert (identity.pod_name, identity.pod_namespace) == (pod, "probe-test")
        ids = [container.v2_dir.stat().st_ino for container in (a, b)]
        a.stop()
        b.stop()
        for cg_id in ids:  # killed without freeing: process exit returned everything
            c = _counters(pm, cg_id)
            assert c.cuda_allocated_bytes == 0 and set(dict(c.allocated_bytes_by_gpu).values()) == {0}


def test_trace_filters_one_pod_of_the_sim_node(sim: simnode.SimNode, tmp_path: Path) -> None:
    import json

    namespace = f"trace-{uuid.uuid4().hex[:8]}"
    # the default containerd bundle root: where `gpuwatch trace` (no options) finds pod names
    with (
        ContainerLab(tmp_path / "work", docker_root=tmp_path / "docker", runc_root=tmp_path / "runc") as lab,
        gpuwatch_trace("--json", "--namespace", namespace, "--pod", "pod-b", "--device-prefix",
                       str(sim.dev_dir / "nvidia"), "--libcuda", str(sim.libraries.cuda_path)) as trace,
    ):
        a = lab.run(dataclasses.replace(_worker(sim, "pod-a", gpu=0, mib=16, steps=2), namespace=namespace))
        b = lab.run(dataclasses.replace(_worker(sim, "pod-b", gpu=1, mib=8, steps=3), namespace=namespace))
        _wait_ready(a)
        _wait_ready(b)
        b.stop()
        time.sleep(1.0)
        out = end_trace(trace)
    events = [json.loads(line) for line in out.splitlines()]
    assert {(e["container"]["namespace"], e["container"]["pod"]) for e in events} == {(namespace, "pod-b")}
    kinds = [e["event"] for e in events]
    assert kinds[0] == "new_gpu_process" and kinds[-1] == "process_exit"
    assert [e["size_bytes"] for e in events if e["event"] == "alloc" and e["source"] == "cuda"] == [8 * MiB] * 3
    # the driver's view: the context's own memory objects, then the steps'
    assert [e["size_bytes"] for e in events if e["event"] == "alloc" and e["source"] == "ioctl"] == [
        *context_objects(), *[8 * MiB] * 3]
