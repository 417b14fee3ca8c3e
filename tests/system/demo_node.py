"""A running demo node for system tests: simulated GPUs, 3 runc pods, sampler + exporter.

Everything is torn down when the context exits: exporter, sampler, containers, sim node.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.containers import BundleRoots
from gpuwatch.exporter.metrics_server import ExporterServer, registry_for, serve
from gpuwatch.pipeline.sampler import Sampler, build_sampler
from gpuwatch.sim import demo
from gpuwatch.sim import node as simnode
from gpuwatch.sim.runc import ContainerLab, RunningContainer


@dataclass
class DemoNode:
    sim: simnode.SimNode
    lab: ContainerLab
    containers: list[RunningContainer]
    sampler: Sampler
    exporter: ExporterServer
    bundle_roots: BundleRoots

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.exporter.port}"


@contextmanager
def demo_node(base: Path, workloads: tuple[demo.DemoWorkload, ...] = demo.DEFAULT_WORKLOADS,
              interval_s: float = 0.5, devices: int = 2) -> Iterator[DemoNode]:
    name = f"t{uuid.uuid4().hex[:10]}"
    state = Path("/dev/shm") / f"gpuwatch-sim-{name}"
    with ExitStack() as stack:
        sim = simnode.up(devices=devices, name=name, state_path=state, root=base / "simroot")
        stack.callback(simnode.down, name, state_path=state)
        os.environ["GPUWATCH_SIM_STATE"] = str(state)
        dirs = demo.default_lab_dirs(base)
        lab = stack.enter_context(ContainerLab(**dirs))
        containers = demo.start_workloads(lab, sim, workloads)
        roots = BundleRoots(containerd_tasks=(str(dirs["bundle_root"]),), runc_state=(str(dirs["runc_root"]),),
                            docker_containers=(str(dirs["docker_root"] / "containers"),))
        sampler = build_sampler(nvml_library=str(sim.libraries.nvml_path), interval_s=interval_s,
                                node="demo-node", bundle_roots=roots)
        sampler.start()
        stack.callback(sampler.stop)
        exporter = serve(registry_for(sampler.latest), "127.0.0.1", 0, get_snapshot=sampler.latest)
        stack.callback(exporter.stop)
        yield DemoNode(sim, lab, containers, sampler, exporter, roots)
