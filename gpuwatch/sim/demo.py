"""A small simulated cluster node: pods in namespaces running GPU workloads in runc.

Used by `gpuwatch quickstart` on hosts without GPUs, by the dashboard/alert system tests
and by benchmarks. Everything here is real (runc containers, cgroups, processes, the
ioctls they issue) except the GPU, which is the labelled simulation in gpuwatch/sim.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.core.errors import SimError
from gpuwatch.sim import node as simnode
from gpuwatch.sim.runc import ContainerLab, ContainerSpec, RunningContainer


@dataclass(frozen=True)
class DemoWorkload:
    """One pod with one container holding `memory_mib` on `gpu`, busy `duty` of the time."""

    namespace: str
    pod: str
    container: str
    gpu: int
    memory_mib: int
    duty: float
    qos: str = "burstable"


DEFAULT_WORKLOADS = (
    DemoWorkload("ml-team", "trainer-0", "trainer", gpu=0, memory_mib=20480, duty=0.6),
    DemoWorkload("ml-team", "notebook-1", "jupyter", gpu=1, memory_mib=8192, duty=0.2,
                 qos="besteffort"),
    DemoWorkload("inference", "server-0", "triton", gpu=1, memory_mib=12288, duty=0.4,
                 qos="guaranteed"),
)


def workload_argv(w: DemoWorkload, node_name: str, lifetime_s: float = 0.0,
                  extra: tuple[str, ...] = ()) -> list[str]:
    """The `gpuwatch sim run` command line for one workload."""
    return [sys.executable, "-m", "gpuwatch", "sim", "run", "--name", node_name,
            "--gpu", str(w.gpu), "--mib-per-step", str(w.memory_mib), "--steps", "1", "--hold",
            "--duty", str(w.duty), "--kernel-ms", "10", "--lifetime-s", str(lifetime_s), *extra]


def container_spec(w: DemoWorkload, sim: simnode.SimNode, lifetime_s: float = 0.0,
                   extra_argv: tuple[str, ...] = (), runtime: str = "k8s") -> ContainerSpec:
    """A runc container spec that can reach the simulated node (state file, root, libraries)."""
    return ContainerSpec(
        name=w.container, namespace=w.namespace, pod=w.pod, qos=w.qos, runtime=runtime,
        argv=workload_argv(w, sim.name, lifetime_s, extra_argv),
        env=simnode.sim_env(sim),
        extra_binds=[str(sim.state_path.parent), str(sim.root)],
        ro_binds=[str(sim.libraries.lib_dir)],
        new_network=runtime == "k8s",  # a pod has its own network namespace
    )


def start_workloads(lab: ContainerLab, sim: simnode.SimNode,
                    workloads: tuple[DemoWorkload, ...] = DEFAULT_WORKLOADS,
                    ready_timeout_s: float = 20.0) -> list[RunningContainer]:
    """Start every workload and wait until each has allocated its memory."""
    started = [lab.run(container_spec(w, sim)) for w in workloads]
    deadline = time.monotonic() + ready_timeout_s
    for container in started:
        while "ready" not in container.logs():
            if not container.running():
                raise SimError(f"demo workload {container.name} exited early: {container.logs()[-500:]}",
                               fix="run `gpuwatch sim status` and check the node has free memory")
            if time.monotonic() > deadline:
                raise SimError(f"demo workload {container.name} not ready after {ready_timeout_s}s",
                               fix="the machine may be overloaded; try again")
            time.sleep(0.1)
    return started


DEMO_POLICY_RELPATH = "deploy/policies/demo.yaml"
"""The quick start's policy: the ml-team trainer may use 30% GPU time, over it it is throttled."""

DEMO_THROTTLED_POD = ("ml-team", "trainer-0")
"""The pod the demo policy throttles (namespace, pod)."""


def demo_policy_path(source_root: Path | None = None) -> Path | None:
    """deploy/policies/demo.yaml of the source tree gpuwatch runs from, or None when gpuwatch
    was installed without it (the quick start then runs without enforcement and says so)."""
    root = source_root if source_root is not None else Path(__file__).resolve().parents[2]
    path = root / DEMO_POLICY_RELPATH
    return path if path.is_file() else None


def default_lab_dirs(base: Path) -> dict[str, Path]:
    """Work, bundle and runc state dirs of a demo lab under `base`."""
    return {"work_dir": base / "work", "bundle_root": base / "containerd",
            "docker_root": base / "docker", "runc_root": base / "runc"}
