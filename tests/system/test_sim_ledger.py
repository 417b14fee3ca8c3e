"""The shared memory ledger: capacity, reclaim of dead processes, many writers."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpuwatch.sim import status
from tests.system.sim_helpers import CONTEXT_BYTES, EXACT_DRIVER, GIB, MIB, private_node, run_nvml, workers


def test_allocation_at_capacity_fails_with_oom(tmp_path: Path) -> None:
    # EXACT_DRIVER: the capacity arithmetic is in the bytes the workers ask for (no context)
    with private_node(tmp_path, devices=1, memory_bytes=GIB) as node, workers(node, EXACT_DRIVER) as w:
        _, held = w.start_ready("--mib-per-step", "256", "--steps", "3")  # 768 MiB
        assert held == 768 * MIB
        over = w.start("--mib-per-step", "512")
        assert over.wait(timeout=10) == 2
        assert over.stdout is not None
        assert over.stdout.readline().split()[0] == "oom"
        # exactly the remaining 256 MiB still fits: the failed attempt charged nothing
        _, fits = w.start_ready("--mib-per-step", "256")
        assert fits == 256 * MIB
        one_more = w.start("--mib-per-step", "1")
        assert one_more.wait(timeout=10) == 2
        used = run_nvml(node, "print(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)")
    assert used == GIB


def test_killed_workload_memory_is_reclaimed_within_one_second(tmp_path: Path) -> None:
    # EXACT_DRIVER: NVML is compared with the bytes each worker reports asking for
    with private_node(tmp_path, devices=1, memory_bytes=4 * GIB) as node, workers(node, EXACT_DRIVER) as w:
        keep, kept = w.start_ready("--mib-per-step", "100")
        victim, _ = w.start_ready("--mib-per-step", "1000", "--duty", "0.3")
        out = run_nvml(
            node,
            f"""
h = pynvml.nvmlDeviceGetHandleByIndex(0)
before = {{p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}}
t0 = time.monotonic()
os.kill({victim.pid}, 9)
while True:
    procs = {{p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}}
    used = pynvml.nvmlDeviceGetMemoryInfo(h).used
    if {victim.pid} not in procs and used == {kept}:
        break
    if time.monotonic() - t0 > 5:
        break
print(json.dumps(dict(before=before, after=procs, used=used, elapsed_s=time.monotonic() - t0)))
""",
        )
        assert victim.wait(timeout=5) == -signal.SIGKILL
    assert out["before"] == {str(keep.pid): kept, str(victim.pid): 1000 * MIB}
    assert out["after"] == {str(keep.pid): kept}
    assert out["used"] == kept
    assert out["elapsed_s"] < 1.0


def rm_bytes(mib: int, steps: int) -> int:
    """What NVML counts for `steps` allocations of `mib` MiB by the stub's default (README
    "Driver traffic", the real shape): 2 MiB pages from 2 MiB on; 1 MiB allocations carved
    two to a 2 MiB object; plus the context's memory."""
    if mib < 2:
        return CONTEXT_BYTES + -(-steps // 2) * 2 * MIB
    return CONTEXT_BYTES + (mib + mib % 2) * MIB * steps


def test_fifty_concurrent_workloads_keep_the_ledger_consistent(tmp_path: Path) -> None:
    rng = random.Random(7)
    with private_node(tmp_path, devices=2, memory_bytes=64 * GIB) as node, workers(node) as w:
        specs = [(i % 2, rng.randint(1, 64), rng.randint(1, 4)) for i in range(50)]
        procs = [
            w.start("--gpu", str(gpu), "--mib-per-step", str(mib), "--steps", str(steps), "--interval-s", "0.01")
            for gpu, mib, steps in specs
        ]
        expected: dict[int, tuple[int, int]] = {}
        for proc, (gpu, mib, steps) in zip(procs, specs, strict=True):
            words = w.wait_line(proc, "ready")
            assert int(words[2]) == mib * MIB * steps
            # NVML counts the driver's memory objects at their rounded sizes
            expected[proc.pid] = (gpu, rm_bytes(mib, steps))
        code = """
res = []
for i in range(2):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    res.append(dict(procs={p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)},
                    used=pynvml.nvmlDeviceGetMemoryInfo(h).used))
print(json.dumps(res))
"""
        full = run_nvml(node, code)
        # kill half of them at once, then check again
        victims = procs[::2]
        for proc in victims:
            proc.kill()
        for proc in victims:
            proc.wait(timeout=10)
        time.sleep(0.1)
        half = run_nvml(node, code)
        ledger = status(node)
    for gpu in (0, 1):
        want = {str(pid): nbytes for pid, (g, nbytes) in expected.items() if g == gpu}
        assert full[gpu]["procs"] == want
        assert full[gpu]["used"] == sum(want.values())
        dead = {str(p.pid) for p in victims}
        want_half = {pid: nbytes for pid, nbytes in want.items() if pid not in dead}
        assert half[gpu]["procs"] == want_half
        assert half[gpu]["used"] == sum(want_half.values())
        assert ledger.devices[gpu].memory_used_bytes == sum(want_half.values())
    assert len(ledger.processes) == 25


FORKER = """
import os, sys, time
from gpuwatch.sim.workload import StubCuda
cuda = StubCuda(os.environ["GPUWATCH_SIM_LIBCUDA"])
cuda.open_device(0)
cuda.alloc(100 * 1024 * 1024)
r, w = os.pipe()
child = os.fork()
if child == 0:
    cuda.open_device(0)  # a forked child needs its own context, as with real CUDA
    cuda.alloc(50 * 1024 * 1024)
    os.write(w, b"x")
    time.sleep(30)
    os._exit(0)
os.read(r, 1)
print(child, flush=True)
time.sleep(30)
"""


def test_forked_child_is_its_own_gpu_process(tmp_path: Path) -> None:
    # 2 GiB: room for two 518 MiB contexts
    with private_node(tmp_path, devices=1, memory_bytes=2 * GIB) as node, workers(node) as w:
        parent = w.start(argv=[sys.executable, "-c", FORKER])
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        both = {p.host_pid: p.memory_bytes for p in status(node).processes}
        os.kill(child_pid, signal.SIGKILL)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and len(status(node).processes) != 1:
            time.sleep(0.02)
        after = {p.host_pid: p.memory_bytes for p in status(node).processes}
    assert both == {parent.pid: CONTEXT_BYTES + 100 * MIB, child_pid: CONTEXT_BYTES + 50 * MIB}
    assert after == {parent.pid: CONTEXT_BYTES + 100 * MIB}


def test_cuda_visible_devices_selects_and_reorders(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=3, memory_bytes=GIB) as node, workers(node) as w:
        env = w.env()
        env["CUDA_VISIBLE_DEVICES"] = "2,0"
        proc = subprocess.Popen(
            [str(node.libraries.worker_path), "--gpu", "0", "--mib-per-step", "8"],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        w.procs.append(proc)
        w.wait_line(proc, "ready")
        hidden = subprocess.run(
            [str(node.libraries.worker_path), "--gpu", "2", "--mib-per-step", "1"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
        placed = {p.device: p.memory_bytes for p in status(node).processes}
    assert placed == {2: CONTEXT_BYTES + 8 * MIB}  # CUDA ordinal 0 is physical GPU 2
    assert hidden.returncode == 3  # only two devices are visible
