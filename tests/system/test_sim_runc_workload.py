"""End to end: a simulated GPU workload (`gpuwatch sim run`) inside a runc container.

The workload allocates through the stub libcuda from the bind-mounted sim build cache;
the node's ledger (what the fake NVML reports) must show it under its *host* PID, and a
stopped container's memory must be reclaimed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.sim import node as simnode
from gpuwatch.sim.runc import ContainerLab
from tests.system.sim_helpers import CONTEXT_BYTES, sim_container, sim_run_argv

MIB = 1024**2


@pytest.fixture
def sim(tmp_path: Path, runc_required: str) -> Iterator[simnode.SimNode]:
    state_dir = tmp_path / "shm"
    state_dir.mkdir()
    name = f"runc{os.getpid()}"
    node = simnode.up(devices=1, memory_bytes=4096 * MIB, name=name, state_path=state_dir / "state",
                      root=tmp_path / "simroot")
    try:
        yield node
    finally:
        simnode.down(name, state_path=node.state_path)


def _wait_for(predicate: object, timeout_s: float) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_contained_workload_is_seen_with_its_host_pid(sim: simnode.SimNode, tmp_path: Path) -> None:
    lab = ContainerLab(tmp_path / "work", bundle_root=tmp_path / "bundles", runc_root=tmp_path / "runc")
    with lab:
        spec = sim_container(sim, "trainer", sim_run_argv(mib_per_step=256, steps=1), namespace="ml", pod="job-0")
        container = lab.run(spec)
        _wait_for(lambda: "ready" in container.logs() or not container.running(), timeout_s=8)
        assert container.running(), container.logs()

        ours = [p for p in simnode.status(sim).processes if p.host_pid == container.host_pid]
        assert len(ours) == 1, (container.host_pid, simnode.status(sim).processes)
        assert ours[0].requested_bytes == 256 * MIB  # what the workload asked for
        assert ours[0].memory_bytes == CONTEXT_BYTES + 256 * MIB  # NVML's: with its context's 518 MiB
        assert ours[0].ns_pid == 1
        assert ours[0].pidns_inode == os.stat(f"/proc/{container.host_pid}/ns/pid").st_ino

        container.stop()
        _wait_for(lambda: not simnode.status(sim).processes, timeout_s=1.0)
        assert simnode.status(sim).devices[0].memory_used_bytes == 0
