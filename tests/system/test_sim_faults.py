"""Faults injected with `gpuwatch sim fault` as NVML clients and kernel-log readers see them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpuwatch.sim import inject_fault, sim_env, status
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


def test_row_remap_failure_fault_and_uncorrectable_ecc_remaps(tmp_path: Path) -> None:
    code = """
h = pynvml.nvmlDeviceGetHandleByIndex(0)
print(json.dumps(list(pynvml.nvmlDeviceGetRemappedRows(h))))
"""
    with private_node(tmp_path, devices=1, memory_bytes=GIB) as node:
        env = sim_env(node, dict(os.environ))
        fresh = run_nvml(node, code)
        assert _cli(node.name, "fault", "row-remap-failure", "--gpu", "0", env=env).returncode == 0
        failed = run_nvml(node, code)
        assert status(node).devices[0].row_remap_failure
        inject_fault(node, "ecc", 0, count=2, uncorrected=True)
        pending = run_nvml(node, code)
        assert _cli(node.name, "fault", "clear", "--gpu", "0", env=env).returncode == 0
        reset = run_nvml(node, code)
        assert not status(node).devices[0].row_remap_failure
    # (corrRows, uncRows, isPending, failureOccurred)
    assert fresh == [0, 0, 0, 0]
    assert failed == [0, 0, 0, 1]
    assert pending == [0, 2, 1, 1]
    assert reset == [0, 2, 0, 0]  # a reset applies the pending remaps; remapped rows stay remapped


KMSG_RECORD = re.compile(
    r"4,(?P<seq>\d+),(?P<usec>\d+),-;NVRM: Xid \(PCI:(?P<pci>[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2})\): "
    r"(?P<code>\d+), pid=(?P<pid>\d+|'<unknown>'), name=(?P<name>[^,]+), (?P<text>[^\n]+)\n"
)


def _records(path: Path) -> list[dict[str, str]]:
    text = path.read_text()
    records = [KMSG_RECORD.fullmatch(line) for line in text.splitlines(keepends=True)]
    assert all(records), text
    return [m.groupdict() for m in records if m]


def _kmsg_pci(nvml_bus_id: str) -> str:
    """NVML's "00000000:1B:00.0" as the driver's Xid line writes it: "0000:1b:00"."""
    domain, bus, rest = nvml_bus_id.split(":")
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(rest.split('.')[0], 16):02x}"


def test_xid_kmsg_records_name_the_process(tmp_path: Path) -> None:
    victim_exe = tmp_path / "gw-xid-victim"
    shutil.copy("/bin/sleep", victim_exe)
    victim = subprocess.Popen([str(victim_exe), "60"])
    try:
        with private_node(tmp_path, devices=2, memory_bytes=GIB) as node:
            env = sim_env(node, dict(os.environ))
            assert node.kmsg_path == node.root / "kmsg" and node.kmsg_path.read_text() == ""
            buses = run_nvml(node, "print(json.dumps([pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(i))"
                                   ".busId for i in range(2)]))")
            before_us = time.monotonic() * 1e6
            with_pid = _cli(node.name, "fault", "xid", "--gpu", "1", "--code", "13", "--pid", str(victim.pid), env=env)
            assert with_pid.returncode == 0, with_pid.stderr
            assert _cli(node.name, "fault", "xid", "--gpu", "0", "--xid", "31", env=env).returncode == 0
            inject_fault(node, "xid", 0, xid=94, pid=os.getpid())
            inject_fault(node, "xid", 1, xid=4242)
            assert _cli(node.name, "fault", "lost", "--gpu", "1", env=env).returncode == 0
            after_us = time.monotonic() * 1e6
            records = _records(node.kmsg_path)
            bad_pid = _cli(node.name, "fault", "xid", "--gpu", "0", "--pid", "0", env=env)
    finally:
        victim.kill()
        victim.wait()
    own_comm = Path("/proc/self/comm").read_text().strip()
    pci = [_kmsg_pci(bus) for bus in buses]
    assert pci[1] == _kmsg_pci("00000000:28:00.0") == "0000:28:00"
    got = [(r["pci"], r["code"], r["pid"], r["name"], r["text"]) for r in records]
    assert got == [
        (pci[1], "13", str(victim.pid), "gw-xid-victim", "Graphics Engine Exception"),
        (pci[0], "31", "'<unknown>'", "<unknown>", "GPU memory page fault"),
        (pci[0], "94", str(os.getpid()), own_comm, "Contained ECC error"),
        (pci[1], "4242", "'<unknown>'", "<unknown>", "Error"),
        (pci[1], "79", "'<unknown>'", "<unknown>", "GPU has fallen off the bus."),
    ]
    assert [int(r["seq"]) for r in records] == [0, 1, 2, 3, 4]
    stamps = [int(r["usec"]) for r in records]
    assert stamps == sorted(stamps) and before_us - 1e6 <= stamps[0] and stamps[-1] <= after_us + 1e6
    assert bad_pid.returncode != 0


INJECTOR = """
import sys
from pathlib import Path
from gpuwatch.sim import get_node, inject_fault
node = get_node(sys.argv[1], state_path=Path(sys.argv[2]))
for i in range(int(sys.argv[3])):
    inject_fault(node, "xid", i % node.device_count, xid=13 + i % 3, pid=1)
"""


def test_kmsg_records_are_written_whole_and_in_sequence_under_concurrency(tmp_path: Path) -> None:
    writers, each = 4, 60
    seen: list[str] = []
    with private_node(tmp_path, devices=2, memory_bytes=GIB) as node:
        procs = [
            subprocess.Popen([sys.executable, "-c", INJECTOR, node.name, str(node.state_path), str(each)])
            for _ in range(writers)
        ]
        # a follower, as a log shipper reads: complete lines only, from where it left off
        offset, pending = 0, b""
        with open(node.kmsg_path, "rb") as follower:
            while True:
                running = any(p.poll() is None for p in procs)
                follower.seek(offset)
                chunk = follower.read()
                offset += len(chunk)
                *lines, pending = (pending + chunk).split(b"\n")
                seen += [line.decode() + "\n" for line in lines]
                if not running:
                    break
                time.sleep(0.002)
        assert all(p.wait(timeout=60) == 0 for p in procs)
        final = _records(node.kmsg_path)
    assert pending == b""
    assert len(final) == writers * each
    assert [int(r["seq"]) for r in final] == list(range(writers * each))  # file order == sequence order
    assert all(r["pid"] == "1" and r["name"] == Path("/proc/1/comm").read_text().strip() for r in final)
    assert len(seen) == len(final) and all(KMSG_RECORD.fullmatch(line) for line in seen)
