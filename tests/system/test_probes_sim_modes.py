"""The RM-model decoder against the simulated driver in each of its modes (root + BCC).

A CUDA program on the sim's stub libcuda (the driven program of test_sim_driver_traffic.py)
runs in a cgroup of its own while the real probes watch the sim's device nodes. After each
step the probes' live bytes per GPU (the agent's reader) must equal NVML's per-process
number (RM's live memory objects: managed memory is in neither, as on the H100): context
objects, chunks of suballocation, vid-heap objects, frees by parent, client free and close
of nvidiactl included, in the stub's real-CUDA defaults as in the other modes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.probes.manager import ProbeConfig, ProbeManager
from gpuwatch.sim import SimNode, sim_env, status
from gpuwatch.sim.node import DEFAULT_CONTEXT_MIB, DEFAULT_SUBALLOC_MIB, driver_env
from tests.conftest import need_bcc
from tests.system.sim_helpers import GIB, MIB, cgroup2_root, private_node, run_nvml
from tests.system.test_sim_driver_traffic import DRIVEN


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimNode]:
    need_bcc()
    with private_node(tmp_path_factory.mktemp("modes"), devices=2, memory_bytes=4 * GIB) as n:
        yield n


@pytest.fixture(scope="module")
def manager(node: SimNode) -> Iterator[ProbeManager]:
    with ProbeManager(ProbeConfig(device_prefix=str(node.dev_dir / "nvidia"), alloc_uprobes=False,
                                  scan_all_processes=False)) as pm:
        yield pm


class Program:
    """The driven CUDA program, started inside `cgroup`."""

    def __init__(self, node: SimNode, cgroup: Path, env: dict[str, str]) -> None:
        procs = str(cgroup / "cgroup.procs")

        def enter() -> None:
            with open(procs, "w") as f:
                f.write("0")

        full_env = sim_env(node, dict(os.environ))
        full_env.update(env)
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVEN, str(node.libraries.cuda_path)], env=full_env,
                                     preexec_fn=enter, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = self.do()
        assert first[:2] == ["init", "0"], first
        self.pid = int(first[2])

    def do(self, *cmd: object) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if cmd:
            self.proc.stdin.write(" ".join(str(c) for c in cmd) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"driven program ended (rc={self.proc.poll()})"
        return line.split()

    def ok(self, *cmd: object) -> list[str]:
        reply = self.do(*cmd)
        assert reply[0] == "0", (cmd, reply)
        return reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def _rm_bytes_by_nvml(node: SimNode, pid: int) -> dict[int, int]:
    """NVML's per-process used memory per GPU (RM's memory objects; no managed memory)."""
    used = run_nvml(node, "out = {}\nfor i in range(pynvml.nvmlDeviceGetCount()):\n"
                          "    h = pynvml.nvmlDeviceGetHandleByIndex(i)\n"
                          "    out[i] = {str(p.pid): p.usedGpuMemory for p in "
                          "pynvml.nvmlDeviceGetComputeRunningProcesses(h)}\nprint(json.dumps(out))")
    return {int(gpu): procs.get(str(pid), 0) for gpu, procs in used.items()}


def _probe_bytes(pm: ProbeManager, cgroup_id: int) -> dict[int, int]:
    found = [c for c in pm.read() if c.cgroup_id == cgroup_id]
    return dict(found[0].allocated_bytes_by_gpu) if found else {}


def _agree(pm: ProbeManager, node: SimNode, prog: Program, cgroup_id: int, step: str) -> None:
    expected = _rm_bytes_by_nvml(node, prog.pid)
    probes = _probe_bytes(pm, cgroup_id)
    assert {gpu: probes.get(gpu, 0) for gpu in expected} == expected, step
    assert probes.get(-1, 0) == 0, step


@pytest.mark.parametrize(("alloc_path", "suballoc_mib", "context_mib", "teardown"), [
    ("rm-alloc", 0, 0, "free-device"),
    ("vid-heap", 0, 5, "free-client"),
    ("rm-alloc", 16, 5, "close-fd"),
    ("vid-heap", 16, 2, "free-device"),
    ("rm-alloc", DEFAULT_SUBALLOC_MIB, DEFAULT_CONTEXT_MIB, None),  # the stub's defaults: real CUDA's shape
])
def test_probe_bytes_follow_nvml_in_every_sim_mode(node: SimNode, manager: ProbeManager, alloc_path: str,
                                                   suballoc_mib: int, context_mib: int, teardown: str | None
                                                   ) -> None:
    cgroup = cgroup2_root() / f"gpuwatch-test-modes-{os.getpid()}-{alloc_path}-{suballoc_mib}-{teardown}"
    cgroup.mkdir()
    prog = Program(node, cgroup, driver_env(alloc_path=alloc_path, suballoc_mib=suballoc_mib,
                                            context_mib=context_mib, ctx_teardown=teardown))
    cg_id = cgroup.stat().st_ino
    try:
        prog.ok("ctx", 0)
        ptrs = [int(prog.ok("alloc", size)[1]) for size in (1024, 100 * 1024, 3 * MIB, 40 * MIB)]
        prog.ok("managed", 3 * MIB)
        # the managed range is in the sim's ledger (UVM's 2 MiB chunks) but not an RM object
        assert {p.device: p.managed_bytes for p in status(node).processes if p.host_pid == prog.pid} == {0: 4 * MIB}
        _agree(manager, node, prog, cg_id, "gpu 0 allocated")
        prog.ok("ctx", 1)
        prog.ok("alloc", 5 * MIB)
        _agree(manager, node, prog, cg_id, "both gpus")
        prog.ok("free", ptrs[2])
        prog.ok("free", ptrs[0])
        _agree(manager, node, prog, cg_id, "frees")
        prog.ok("destroy", 1)       # its device goes with everything under it
        _agree(manager, node, prog, cg_id, "context 1 destroyed")
        prog.ok("destroy", 0)       # the last context: device, client or nvidiactl closed
        _agree(manager, node, prog, cg_id, "last context destroyed")
        prog.ok("ctx", 0)
        prog.ok("alloc", 2 * MIB)
        _agree(manager, node, prog, cg_id, "new context")
        prog.kill()
        deadline = time.monotonic() + 10
        while any(_probe_bytes(manager, cg_id).values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(_probe_bytes(manager, cg_id).values()) <= {0}
    finally:
        prog.kill()
        for _ in range(50):
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.1)
