"""NvmlBackend against the simulated node's fake libnvidia-ml.so.1 (the real NVML ABI).

Workloads are the sim's native `simworker` processes allocating through the stub
libcuda; the backend must report exactly the bytes each pid holds (its allocations and,
as on a real GPU, its CUDA context's own memory), their SM share, the devices, and turn
lost GPUs into unhealthy devices / a failed sweep -- never a crash.

The backend runs in a fresh interpreter per step: pynvml (and the fake library) keep
the first NVML library and state file they opened for the life of a process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.sim import SimNode, down, inject_fault, sim_env, up
from gpuwatch.sim.node import driver_env
from tests.system.sim_helpers import CONTEXT_BYTES

MIB = 1 << 20

SWEEP_SCRIPT = textwrap.dedent("""
    import dataclasses, json, os, sys, time
    from pathlib import Path
    from gpuwatch.core.errors import NvmlCallFailed
    from gpuwatch.gpu.nvml import NvmlBackend
    from gpuwatch.sim import get_node, inject_fault
    backend = NvmlBackend(library_path=sys.argv[1])
    faults = json.loads(sys.argv[4])  # per sweep: [[kind, gpu], ...] injected just before it
    out = []
    for i in range(int(sys.argv[2])):
        if i:
            time.sleep(float(sys.argv[3]))
        for kind, gpu, *xid in faults[i] if i < len(faults) else []:
            node = get_node(sys.argv[5], state_path=Path(os.environ["GPUWATCH_SIM_STATE"]))
            inject_fault(node, kind, gpu, **({"xid": xid[0]} if xid else {}))
        try:
            out.append(dataclasses.asdict(backend.sweep()))
        except NvmlCallFailed as err:
            out.append({"failed": str(err)})
    out.append({"errors_total": backend.errors_total, "simulated": backend.simulated})
    backend.close()
    print(json.dumps(out))
""")


@pytest.fixture
def node(root_required: None, tmp_path: Path) -> Iterator[SimNode]:
    name = f"nvmltest{os.getpid()}"
    sim = up(devices=2, name=name, memory_bytes=16 << 30, state_path=tmp_path / "state",
             root=tmp_path / "simroot")
    try:
        yield sim
    finally:
        down(name, state_path=tmp_path / "state")


def sweeps(node: SimNode, count: int = 2, gap_s: float = 1.0,
           faults: list[list[tuple[str, int] | tuple[str, int, int]]] | None = None) -> list[dict]:  # type: ignore[type-arg]
    env = sim_env(node, dict(os.environ))
    env.pop("LD_LIBRARY_PATH")  # the backend must get there by preloading, not by the loader path
    env.pop("GPUWATCH_NVML_LIBRARY", None)
    result = subprocess.run([sys.executable, "-c", SWEEP_SCRIPT, str(node.libraries.nvml_path), str(count),
                             str(gap_s), json.dumps(faults or []), node.name],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def start_worker(node: SimNode, gpu: int, mib: float, steps: int = 1, duty: float = 0.0,
                 driver: dict[str, str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen([str(node.libraries.worker_path), "--gpu", str(gpu), "--mib-per-step", str(mib),
                             "--steps", str(steps), "--duty", str(duty), "--kernel-ms", "5"],
                            stdout=subprocess.PIPE, text=True, env=sim_env(node, {**os.environ, **(driver or {})}))
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[:2] == ["ready", str(proc.pid)], line
    return proc


def test_backend_reads_exact_per_pid_memory_devices_and_sm_share(node: SimNode) -> None:
    workers = [start_worker(node, 0, 64, steps=3, duty=0.5), start_worker(node, 0, 100),
               start_worker(node, 1, 256, duty=1.0)]
    # each process: its steps and its context's 518 MiB
    expected = {(workers[0].pid, 0): CONTEXT_BYTES + 192 * MIB, (workers[1].pid, 0): CONTEXT_BYTES + 100 * MIB,
                (workers[2].pid, 1): CONTEXT_BYTES + 256 * MIB}
    try:
        time.sleep(1.0)
        first, second, meta = sweeps(node, 2, 1.0)
    finally:
        for w in workers:
            w.kill()
            w.wait()
    assert meta["simulated"] is True and meta["errors_total"] == 0
    devices = second["devices"]
    assert [d["index"] for d in devices] == [0, 1]
    for d in devices:
        assert d["name"].startswith("gpuwatch-sim") and d["simulated"] and d["healthy"]
        assert d["uuid"].startswith("GPU-") and d["pci_bus_id"] and d["minor_number"] == d["index"]
        assert d["memory_total_bytes"] == 16 << 30
        assert d["memory_used_bytes"] + d["memory_free_bytes"] <= d["memory_total_bytes"]
        assert d["temperature_celsius"] is not None and d["power_watts"] is not None
    got = {(p["pid"], p["gpu_index"]): p for p in second["processes"]}
    assert {k: p["memory_bytes"] for k, p in got.items()} == expected
    # NVML's used includes driver reserve, if any
    assert devices[0]["memory_used_bytes"] >= 2 * CONTEXT_BYTES + 292 * MIB
    util = {k: p["sm_utilization_ratio"] for k, p in got.items()}
    # The busy share is what the stub recorded (CPU-burning "kernels" on a shared 2-core VM),
    # so only its order is asserted here; kernel seconds are checked against the sim's own
    # busy-time ledger in test_pipeline_containers.
    assert util[(workers[1].pid, 0)] == 0.0
    assert 0.5 <= util[(workers[2].pid, 1)] <= 1.0
    assert 0.1 <= util[(workers[0].pid, 0)] <= 0.75
    assert {(p["pid"], p["gpu_index"]) for p in first["processes"]} == set(expected)


def test_backend_per_pid_memory_is_the_drivers_objects_not_the_requests(node: SimNode) -> None:
    """RM's rule (sim README "Driver traffic"): objects at their rounded sizes, the
    context's own memory and whole suballocation chunks count, not what cuMemAlloc asked."""
    workers = [
        # 3 x 1 MiB carved from one 8 MiB chunk, plus the context's 2 + 1 MiB
        start_worker(node, 0, 1, steps=3, driver=driver_env(suballoc_mib=8, context_mib=3)),
        # 5 MiB through VID_HEAP_CONTROL, rounded to 2 MiB pages, beside the default 518 MiB context
        start_worker(node, 0, 5, driver=driver_env(alloc_path="vid-heap")),
        # 100 KiB rounded to 64 KiB pages (128 KiB), one object per allocation (no carving:
        # the default would carve both from one 2 MiB chunk), beside the default context
        start_worker(node, 1, 100 / 1024, steps=2, driver=driver_env(suballoc_mib=0)),
    ]
    expected = {(workers[0].pid, 0): 11 * MIB, (workers[1].pid, 0): CONTEXT_BYTES + 6 * MIB,
                (workers[2].pid, 1): CONTEXT_BYTES + 256 * 1024}
    try:
        (sweep, _meta) = sweeps(node, 1)
    finally:
        for w in workers:
            w.kill()
            w.wait()
    assert {(p["pid"], p["gpu_index"]): p["memory_bytes"] for p in sweep["processes"]} == expected
    assert [d["memory_used_bytes"] for d in sweep["devices"]] == [CONTEXT_BYTES + 17 * MIB, CONTEXT_BYTES + 256 * 1024]


def test_lost_gpu_is_unhealthy_and_all_lost_fails_the_sweep(node: SimNode) -> None:
    """One backend through: healthy -> GPU 1 lost -> all lost -> cleared."""
    worker = start_worker(node, 1, 32)
    try:
        healthy, one_lost, all_lost, cleared, meta = sweeps(
            node, 4, 0.1, faults=[[], [("lost", 1)], [("lost", 0)], [("clear", 0), ("clear", 1)]])
    finally:
        worker.kill()
        worker.wait()
    assert [d["healthy"] for d in healthy["devices"]] == [True, True]
    assert [d["healthy"] for d in one_lost["devices"]] == [True, False]
    assert one_lost["devices"][1]["memory_used_bytes"] is None  # N/A, not a made-up zero
    assert one_lost["devices"][1]["uuid"] == healthy["devices"][1]["uuid"]
    assert one_lost["processes"] == []  # GPU 1's process cannot be read while it is lost
    assert any("lost" in e.lower() for e in one_lost["errors"])
    assert "all 2 GPUs are lost" in all_lost["failed"]
    assert all(d["healthy"] for d in cleared["devices"])
    assert [p["memory_bytes"] for p in cleared["processes"]] == [CONTEXT_BYTES + 32 * MIB]  # its step and context
    assert meta["errors_total"] >= 1


def test_fresh_backend_on_a_node_with_a_lost_gpu(node: SimNode) -> None:
    inject_fault(node, "lost", 0)
    sweep, meta = sweeps(node, 1)
    assert [d["healthy"] for d in sweep["devices"]] == [False, True]
    assert sweep["devices"][1]["memory_total_bytes"] == 16 << 30
    assert meta["errors_total"] >= 1


def test_xid_errors_are_counted_and_fatal_ones_make_the_gpu_unhealthy(node: SimNode) -> None:
    before, benign, fatal, _meta = sweeps(node, 3, 0.1, faults=[[], [("xid", 0, 13)], [("xid", 1, 48)]])
    assert [d["xid_errors_total"] for d in before["devices"]] == [0, 0]
    assert [d["xid_errors_total"] for d in benign["devices"]] == [1, 0]
    assert [d["healthy"] for d in benign["devices"]] == [True, True]  # Xid 13: an application fault
    assert [d["xid_errors_total"] for d in fatal["devices"]] == [1, 1]
    assert [d["healthy"] for d in fatal["devices"]] == [True, False]  # Xid 48: double-bit ECC
