"""nvidia-ml-py (the real package) against the fake NVML of a simulated node."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpuwatch.sim import status
from tests.system.sim_helpers import (
    CONTEXT_BYTES,
    GIB,
    MIB,
    in_cgroups,
    private_node,
    run_nvml,
    scratch_cgroup,
    sim_run_argv,
    workers,
)


def test_devices_identity_and_static_queries(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=4, memory_bytes=8 * GIB) as node:
        out = run_nvml(
            node,
            """
n = pynvml.nvmlDeviceGetCount()
devs = []
for i in range(n):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    uuid = pynvml.nvmlDeviceGetUUID(h)
    pci = pynvml.nvmlDeviceGetPciInfo(h)
    bus_id = pci.busId.decode() if isinstance(pci.busId, bytes) else pci.busId
    try:
        pynvml.nvmlDeviceGetMigMode(h)
        mig = "supported"
    except pynvml.NVMLError_NotSupported:
        mig = "not supported"
    m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    devs.append(dict(
        name=pynvml.nvmlDeviceGetName(h), uuid=uuid, index=pynvml.nvmlDeviceGetIndex(h),
        minor=pynvml.nvmlDeviceGetMinorNumber(h), serial=pynvml.nvmlDeviceGetSerial(h),
        by_uuid=pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid)),
        by_bus=pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)),
        mig=mig, compute_mode=pynvml.nvmlDeviceGetComputeMode(h),
        total=m1.total, used=m1.used, total2=m2.total, used2=m2.used, free2=m2.free,
        temp=pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
        power=pynvml.nvmlDeviceGetPowerUsage(h), limit=pynvml.nvmlDeviceGetPowerManagementLimit(h),
        ecc=pynvml.nvmlDeviceGetTotalEccErrors(h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                               pynvml.NVML_VOLATILE_ECC),
        cc=list(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
        events=pynvml.nvmlDeviceGetSupportedEventTypes(h),
    ))
hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
topo = [[pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b) for b in hs] for a in hs]
try:
    pynvml.nvmlDeviceGetVgpuMetadata(hs[0])
    missing = "found"
except pynvml.NVMLError_FunctionNotFound:
    missing = "function not found"
fields = pynvml.nvmlDeviceGetFieldValues(hs[0], [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, pynvml.NVML_FI_DEV_ECC_CURRENT])
fields = [(f.nvmlReturn, f.value.uiVal) for f in fields]
print(json.dumps(dict(devs=devs, topo=topo, missing=missing, fields=fields,
                      driver=pynvml.nvmlSystemGetDriverVersion(),
                      cuda=pynvml.nvmlSystemGetCudaDriverVersion())))
""",
        )
    devs = out["devs"]
    assert len(devs) == 4
    assert len({d["uuid"] for d in devs}) == 4
    for i, d in enumerate(devs):
        assert d["name"] == "gpuwatch-sim H100 80GB HBM3"
        assert d["uuid"].startswith("GPU-")
        assert d["index"] == d["minor"] == d["by_uuid"] == d["by_bus"] == i
        assert d["mig"] == "not supported"
        assert d["compute_mode"] == 0
        assert d["total"] == d["total2"] == 8 * GIB
        assert d["used"] == d["used2"] == 0 and d["free2"] == 8 * GIB
        assert 20 <= d["temp"] <= 90
        assert 0 < d["power"] <= d["limit"]
        assert d["ecc"] == 0
        assert d["cc"] == [9, 0]
        assert d["events"] & 0x8  # XID critical errors
    topo = out["topo"]
    assert [topo[i][i] for i in range(4)] == [0, 0, 0, 0]
    assert topo[0][1] == topo[1][0] < topo[0][2]  # a PCIe-switch pair is closer than the rest
    assert out["missing"] == "function not found"
    assert out["fields"] == [[0, 0], [3, 0]]  # no NVLink links; other fields NOT_SUPPORTED
    assert out["cuda"] == 12040
    assert out["driver"]


def test_per_pid_memory_is_exactly_what_each_workload_holds_with_its_context(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=2, memory_bytes=16 * GIB) as node, workers(node) as w:
        held = {}
        for gpu, mib, steps in ((0, 300, 2), (0, 128, 3), (1, 1000, 1)):
            proc, nbytes = w.start_ready("--gpu", str(gpu), "--mib-per-step", str(mib), "--steps", str(steps))
            assert nbytes == mib * MIB * steps
            held[proc.pid] = (gpu, nbytes + CONTEXT_BYTES)  # NVML counts the context, as on the H100
        out = run_nvml(
            node,
            """
res = {}
for i in range(2):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    res[i] = dict(
        v3={p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h)},
        v2={p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h)},
        graphics=len(pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)),
        used=pynvml.nvmlDeviceGetMemoryInfo(h).used,
    )
print(json.dumps(res))
""",
        )
    for gpu in (0, 1):
        want = {str(pid): nbytes for pid, (g, nbytes) in held.items() if g == gpu}
        got = out[str(gpu)]
        assert {str(k): v for k, v in got["v3"].items()} == want
        assert {str(k): v for k, v in got["v2"].items()} == want
        assert got["used"] == sum(want.values())
        assert got["graphics"] == 0


def test_running_processes_null_then_insufficient_size_protocol(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=1, memory_bytes=4 * GIB) as node, workers(node) as w:
        pids = [w.start_ready("--mib-per-step", "64")[0].pid for _ in range(3)]
        out = run_nvml(
            node,
            """
h = pynvml.nvmlDeviceGetHandleByIndex(0)
lib = pynvml.nvmlLib
res = {}
for name in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"):
    fn = getattr(lib, name)
    count = ctypes.c_uint(0)
    rc_null = fn(h, ctypes.byref(count), None)
    n_null = count.value
    small = (pynvml.c_nvmlProcessInfo_v3_t * 1)()
    count = ctypes.c_uint(1)
    rc_small = fn(h, ctypes.byref(count), small)
    n_small = count.value
    exact = (pynvml.c_nvmlProcessInfo_v3_t * n_null)()
    count = ctypes.c_uint(n_null)
    rc_exact = fn(h, ctypes.byref(count), exact)
    res[name] = [rc_null, n_null, rc_small, n_small, rc_exact, sorted(exact[i].pid for i in range(count.value))]
print(json.dumps(res))
""",
        )
    for rc_null, n_null, rc_small, n_small, rc_exact, got_pids in out.values():
        assert (rc_null, n_null) == (7, 3)  # NVML_ERROR_INSUFFICIENT_SIZE + needed count
        assert (rc_small, n_small) == (7, 3)
        assert rc_exact == 0
        assert got_pids == sorted(pids)


def _measure_utilisation(node_devices: int, duties: list[float], tmp_path: Path, python: bool = False) -> Any:
    with private_node(tmp_path, devices=node_devices, memory_bytes=4 * GIB) as node, workers(node) as w:
        pids = []
        for gpu, duty in enumerate(duties):
            if python:
                proc = w.start(argv=sim_run_argv(name=node.name, gpu=gpu, mib_per_step=64, duty=duty))
                w.wait_line(proc, "ready")
            else:
                proc, _ = w.start_ready("--gpu", str(gpu), "--mib-per-step", "64", "--duty", str(duty))
            pids.append(proc.pid)
        warmup_start_us = int(time.time() * 1e6)
        time.sleep(1.5)
        out = run_nvml(
            node,
            f"""
since = {warmup_start_us} + 200_000
dev, proc = [], []
for rnd in range(3):
    row, prow = [], []
    for i in range({len(duties)}):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        row.append(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
        prow.append({{s.pid: s.smUtil for s in pynvml.nvmlDeviceGetProcessUtilization(h, since)}})
    dev.append(row)
    proc.append(prow)
    time.sleep(0.7)
print(json.dumps(dict(dev=dev, proc=proc)))
""",
        )
        out["status"] = [d.utilization_percent for d in status(node).devices]
        return pids, out


def test_utilisation_follows_commanded_duty_within_5_points(tmp_path: Path) -> None:
    duties = [0.25, 0.5, 0.75]
    pids, out = _measure_utilisation(3, duties, tmp_path)
    for i, duty in enumerate(duties):
        dev_mean = sum(row[i] for row in out["dev"]) / len(out["dev"])
        assert abs(dev_mean - duty * 100) <= 5, (duty, out["dev"])
        proc_mean = sum(r[i][str(pids[i])] for r in out["proc"]) / len(out["proc"])
        assert abs(proc_mean - duty * 100) <= 5, (duty, out["proc"])
        assert abs(out["status"][i] - duty * 100) <= 6, (duty, out["status"])  # `gpuwatch sim status`


def test_python_workload_duty_is_reported(tmp_path: Path) -> None:
    _pids, out = _measure_utilisation(1, [0.5], tmp_path, python=True)
    dev_mean = sum(row[0] for row in out["dev"]) / len(out["dev"])
    assert abs(dev_mean - 50) <= 5, out


def test_process_utilization_only_returns_samples_newer_than_timestamp(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=1, memory_bytes=GIB) as node, workers(node) as w:
        proc, _ = w.start_ready("--mib-per-step", "16", "--duty", "0.5")
        time.sleep(0.5)
        out = run_nvml(
            node,
            """
h = pynvml.nvmlDeviceGetHandleByIndex(0)
before = int(time.time() * 1e6)
samples = pynvml.nvmlDeviceGetProcessUtilization(h, before - 400_000)
try:
    pynvml.nvmlDeviceGetProcessUtilization(h, int(time.time() * 1e6) + 60_000_000)
    future = "samples"
except pynvml.NVMLError_NotFound:
    future = "not found"
print(json.dumps(dict(ts=[s.timeStamp for s in samples], pids=[s.pid for s in samples], before=before,
                      future=future)))
""",
        )
    # the real driver's shape: one sample per 1/6 s period the process ran in (about 2 of the
    # last 0.4 s at duty 0.5), each with its own timestamp, none older than asked for
    assert set(out["pids"]) == {proc.pid} and len(out["pids"]) >= 1
    assert len(set(out["ts"])) == len(out["ts"])
    assert all(ts > out["before"] - 400_000 for ts in out["ts"])
    assert out["future"] == "not found"


def test_stopped_process_accrues_no_busy_time(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=1, memory_bytes=GIB) as node, workers(node) as w:
        proc, _ = w.start_ready("--mib-per-step", "16", "--duty", "1.0", "--kernel-ms", "20")
        time.sleep(1.2)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(1.3)  # the 1 s utilisation window now lies entirely in the stopped period
        code = """
h = pynvml.nvmlDeviceGetHandleByIndex(0)
print(json.dumps(pynvml.nvmlDeviceGetUtilizationRates(h).gpu))
"""
        stopped = run_nvml(node, code)
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(1.3)
        resumed = run_nvml(node, code)
    assert stopped == 0
    assert resumed >= 90


def test_preload_fake_nvml_in_process(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=1, memory_bytes=GIB) as node:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "GPUWATCH_SIM_STATE")}
        code = f"""
from gpuwatch.sim import preload_fake_nvml
import pynvml
preload_fake_nvml({str(node.libraries.nvml_path)!r}, {str(node.state_path)!r})
pynvml.nvmlInit()
print(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)))
"""
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "gpuwatch-sim H100 80GB HBM3"


def test_cgroup_frozen_process_accrues_no_busy_time(tmp_path: Path, root_required: None) -> None:
    with (
        scratch_cgroup("gpuwatch-test-freeze") as cgroup,
        private_node(tmp_path, devices=1, memory_bytes=GIB) as node,
        workers(node) as w,
    ):
        # join the cgroup before exec, as runtimes do
        proc = w.start(argv=in_cgroups([cgroup / "cgroup.procs"], [
            str(node.libraries.worker_path), "--mib-per-step", "8", "--duty", "1.0"]))
        w.wait_line(proc, "ready")
        code = "print(json.dumps(pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(0)).gpu))"
        time.sleep(1.2)
        running = run_nvml(node, code)
        (cgroup / "cgroup.freeze").write_text("1")
        try:
            time.sleep(1.3)
            frozen = run_nvml(node, code)
        finally:
            (cgroup / "cgroup.freeze").write_text("0")
        w.close()
    assert running >= 90
    assert frozen == 0


def test_work_of_a_process_that_just_died_still_counts_in_utilisation(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=1, memory_bytes=GIB) as node, workers(node) as w:
        proc, _ = w.start_ready("--mib-per-step", "8", "--duty", "1.0")
        time.sleep(1.2)
        out = run_nvml(
            node,
            f"""
h = pynvml.nvmlDeviceGetHandleByIndex(0)
os.kill({proc.pid}, 9)
while pynvml.nvmlDeviceGetComputeRunningProcesses(h):  # also frees the dead process's slot
    pass
just_died = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
time.sleep(1.2)
print(json.dumps([just_died, pynvml.nvmlDeviceGetUtilizationRates(h).gpu]))
""",
        )
    assert out[0] >= 60  # the last second was mostly its kernels, as a GPU counter would say
    assert out[1] == 0
