"""Faults injected with `gpuwatch sim fault` as NVML clients see them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpuwatch.sim import sim_env
from tests.system.sim_helpers import GIB, private_node, run_nvml, workers

WAITER = """
import json, pynvml, sys
pynvml.nvmlInit()
es = pynvml.nvmlEventSetCreate()
for i in range(pynvml.nvmlDeviceGetCount()):
    pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(i), pynvml.nvmlEventTypeXidCriticalError, es)
try:
    pynvml.nvmlEventSetWait_v2(es, 200)
    quiet = "event"
except pynvml.NVMLError_Timeout:
    quiet = "timeout"
print("registered", quiet, flush=True)
data = pynvml.nvmlEventSetWait_v2(es, 10000)
print(json.dumps(dict(type=data.eventType, xid=data.eventData, gpu=pynvml.nvmlDeviceGetIndex(data.device))), flush=True)
pynvml.nvmlEventSetFree(es)
"""


def _cli(node_name: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatch", "sim", *args, "--name", node_name],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )


def test_xid_injected_with_cli_arrives_through_event_wait(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=2, memory_bytes=GIB) as node:
        env = sim_env(node, dict(os.environ))
        waiter = subprocess.Popen([sys.executable, "-c", WAITER], env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert waiter.stdout is not None
            assert waiter.stdout.readline().split() == ["registered", "timeout"]
            fault = _cli(node.name, "fault", "xid", "--gpu", "1", "--xid", "48", env=env)
            assert fault.returncode == 0, fault.stderr
            event = json.loads(waiter.stdout.readline())
            assert waiter.wait(timeout=10) == 0
        finally:
            if waiter.poll() is None:
                waiter.kill()
                waiter.wait()
    assert event == {"type": 0x8, "xid": 48, "gpu": 1}


def test_lost_gpu_fails_nvml_and_cuda_until_cleared(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=2, memory_bytes=GIB) as node, workers(node) as w:
        env = sim_env(node, dict(os.environ))
        assert _cli(node.name, "fault", "lost", "--gpu", "0", env=env).returncode == 0
        code = """
res = {}
for i in range(2):
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        res[i] = pynvml.nvmlDeviceGetName(h)
    except pynvml.NVMLError_GpuIsLost:
        res[i] = "lost"
print(json.dumps(res))
"""
        lost = run_nvml(node, code)
        failed = w.start("--gpu", "0", "--mib-per-step", "1")
        assert failed.wait(timeout=10) == 3
        assert _cli(node.name, "fault", "clear", "--gpu", "0", env=env).returncode == 0
        cleared = run_nvml(node, code)
        _, held = w.start_ready("--gpu", "0", "--mib-per-step", "1")
    assert lost == {"0": "lost", "1": "gpuwatch-sim H100 80GB HBM3"}
    assert cleared["0"] == "gpuwatch-sim H100 80GB HBM3"
    assert held == 1024 * 1024


def test_ecc_fault_counts(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=1, memory_bytes=GIB) as node:
        env = sim_env(node, dict(os.environ))
        assert _cli(node.name, "fault", "ecc", "--gpu", "0", "--count", "3", env=env).returncode == 0
        assert _cli(node.name, "fault", "ecc", "--gpu", "0", "--uncorrected", env=env).returncode == 0
        out = run_nvml(
            node,
            """
h = pynvml.nvmlDeviceGetHandleByIndex(0)
print(json.dumps([pynvml.nvmlDeviceGetTotalEccErrors(h, t, c) for t in (0, 1) for c in (0, 1)]))
""",
        )
    assert out == [3, 3, 1, 1]


def test_fault_on_missing_gpu_or_node_is_a_clear_error(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=1, memory_bytes=GIB) as node:
        env = sim_env(node, dict(os.environ))
        bad_gpu = _cli(node.name, "fault", "xid", "--gpu", "3", env=env)
    assert bad_gpu.returncode != 0
    assert "no GPU 3" in bad_gpu.stderr
    not_up = _cli(node.name, "status", env=env)
    assert not_up.returncode != 0
    assert "sim is not up" in not_up.stderr and "gpuwatch sim up" in not_up.stderr
