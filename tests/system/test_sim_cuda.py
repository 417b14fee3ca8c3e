"""The stub CUDA driver API, called through ctypes as a CUDA program would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpuwatch.sim import sim_env, status
from gpuwatch.sim.node import DEFAULT_CONTEXT_MIB
from tests.system.sim_helpers import GIB, MIB, private_node, run_nvml

DRIVER_SCRIPT = r"""
import ctypes, json, os, time
cu = ctypes.CDLL(os.environ["GPUWATCH_SIM_LIBCUDA"])
res = {}
def call(name, *args):
    return getattr(cu, name)(*args)
res["init"] = call("cuInit", 0)
v = ctypes.c_int(); call("cuDriverGetVersion", ctypes.byref(v)); res["version"] = v.value
n = ctypes.c_int(); call("cuDeviceGetCount", ctypes.byref(n)); res["count"] = n.value
dev = ctypes.c_int(); call("cuDeviceGet", ctypes.byref(dev), 1)
name = ctypes.create_string_buffer(128); call("cuDeviceGetName", name, 128, dev); res["name"] = name.value.decode()
total = ctypes.c_size_t(); call("cuDeviceTotalMem_v2", ctypes.byref(total), dev); res["total"] = total.value
uuid = (ctypes.c_ubyte * 16)(); call("cuDeviceGetUuid_v2", uuid, dev); res["uuid"] = bytes(uuid).hex()
ptr = ctypes.c_ulonglong()
res["alloc_without_context"] = call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(1))
ctx = ctypes.c_void_p(); res["ctx"] = call("cuCtxCreate_v2", ctypes.byref(ctx), 0, dev)
ptrs = []
for fn, extra in (("cuMemAlloc_v2", ()), ("cuMemAllocManaged", (ctypes.c_uint(1),)),
                  ("cuMemAllocAsync", (ctypes.c_void_p(0),))):
    p = ctypes.c_ulonglong()
    assert call(fn, ctypes.byref(p), ctypes.c_size_t(10 * 1024 * 1024), *extra) == 0, fn
    ptrs.append(p.value)
res["distinct_ptrs"] = len(set(ptrs))
free = ctypes.c_size_t(); tot = ctypes.c_size_t()
call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(tot)); res["meminfo"] = [free.value, tot.value]
res["free_unknown"] = call("cuMemFree_v2", ctypes.c_ulonglong(12345))
res["free_async"] = call("cuMemFreeAsync", ctypes.c_ulonglong(ptrs[2]), ctypes.c_void_p(0))
us = ctypes.c_uint64(50_000)
params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(us), ctypes.c_void_p))
t0 = time.monotonic()
res["launch"] = call("cuLaunchKernel", ctypes.c_void_p(1), 1, 1, 1, 1, 1, 1, 0, None, params, None)
res["launch_ex"] = call("cuLaunchKernelEx", None, ctypes.c_void_p(1), params, None)
res["graph"] = call("cuGraphLaunch", ctypes.c_void_p(50_000), None)
res["kernel_wall_s"] = time.monotonic() - t0
res["sync"] = call("cuStreamSynchronize", None) + call("cuCtxSynchronize")
fp = ctypes.c_void_p(); st = ctypes.c_int(-1)
cu.cuGetProcAddress_v2.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                   ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_int)]
res["proc_addr"] = [cu.cuGetProcAddress_v2(b"cuMemAlloc", ctypes.byref(fp), 12000, 0, ctypes.byref(st)), st.value,
                    fp.value == ctypes.cast(cu.cuMemAlloc_v2, ctypes.c_void_p).value]
res["proc_addr_missing"] = cu.cuGetProcAddress_v2(b"cuNoSuchThing", ctypes.byref(fp), 12000, 0, ctypes.byref(st))
print(json.dumps(res), flush=True)
input()
"""


def test_driver_api_through_ctypes(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=2, memory_bytes=GIB) as node:
        proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER_SCRIPT],
            env=sim_env(node, dict(os.environ)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdin is not None
            res = json.loads(proc.stdout.readline())
            ledger = status(node)
            uuid = run_nvml(node, "print(json.dumps(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(1))))")
            proc.stdin.write("\n")
            proc.stdin.close()
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert res["init"] == 0 and res["ctx"] == 0 and res["sync"] == 0
    assert res["version"] == 12040
    assert res["count"] == 2
    assert res["name"] == "gpuwatch-sim H100 80GB HBM3"
    assert res["total"] == GIB
    assert res["uuid"] == uuid.removeprefix("GPU-").replace("-", "")
    assert res["alloc_without_context"] == 201  # CUDA_ERROR_INVALID_CONTEXT
    assert res["distinct_ptrs"] == 3
    # the real shape (gpuwatch/sim/README.md "Driver traffic"): the 518 MiB context, 10 MiB of
    # cuMemAlloc, the default pool's 32 MiB object for cuMemAllocAsync; managed memory not counted
    assert res["meminfo"] == [GIB - (DEFAULT_CONTEXT_MIB + 10 + 32) * MIB, GIB]
    assert res["free_unknown"] == 1  # CUDA_ERROR_INVALID_VALUE
    assert res["free_async"] == 0
    assert res["launch"] == res["launch_ex"] == res["graph"] == 0
    assert res["kernel_wall_s"] >= 0.15  # three kernels of 50 ms each
    assert res["proc_addr"] == [0, 0, True]
    assert res["proc_addr_missing"] == 500  # CUDA_ERROR_NOT_FOUND
    (entry,) = ledger.processes
    assert entry.device == 1
    # cuMemFreeAsync + the synchronize trimmed the pool
    assert entry.memory_bytes == (DEFAULT_CONTEXT_MIB + 10) * MIB and entry.allocations == 3
    assert entry.kernel_launches == 3
    assert 0.15 <= entry.busy_seconds_total < 0.3
