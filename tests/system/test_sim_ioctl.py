"""The stub's driver ioctls, checked from outside the process: the encoding with
strace, the argument layout with a syscall tracepoint reading the caller's memory."""

from __future__ import annotations

import ctypes
import os
import re
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.sim import SimNode, sim_env
from tests.conftest import need_binary
from tests.system.sim_helpers import CONTEXT_MEMORY_OBJECTS, GIB, MIB, context_objects, private_node

RM_ALLOC_NVOS64 = 0xC030462B  # _IOWR('F', 0x2B, 48 bytes)
RM_ALLOC_NVOS21 = 0xC020462B  # _IOWR('F', 0x2B, 32 bytes)
RM_FREE_NVOS00 = 0xC0104629  # _IOWR('F', 0x29, 16 bytes)
RM_CONTROL_NVOS54 = 0xC020462A  # _IOWR('F', 0x2A, 32 bytes)
CARD_INFO_32 = 0xC90046C8  # _IOWR('F', 200, 32 x 72 bytes)
CONTEXT_OBJECTS = 4  # client, device, subdevice, VA space: RM_ALLOCs of every context creation


def _strace(node: SimNode, tmp_path: Path, *worker_args: str) -> list[str]:
    strace = need_binary("strace", "strace")
    log = tmp_path / "strace.txt"
    cmd = [
        strace,
        "-f",
        "-y",
        "-X",
        "raw",
        "-e",
        "trace=openat,ioctl",
        "-o",
        str(log),
        str(node.libraries.worker_path),
        *worker_args,
    ]
    proc = subprocess.run(
        cmd, env=sim_env(node, dict(os.environ)), capture_output=True, text=True, timeout=30, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return log.read_text().splitlines()


@pytest.mark.parametrize(("layout", "alloc_cmd"), [("nvos64", RM_ALLOC_NVOS64), ("nvos21", RM_ALLOC_NVOS21)])
def test_strace_sees_device_opens_and_rm_ioctls(tmp_path: Path, layout: str, alloc_cmd: int) -> None:
    with private_node(tmp_path, devices=2, memory_bytes=GIB, rm_alloc_params=layout) as node:
        lines = _strace(
            node, tmp_path, "--gpu", "1", "--mib-per-step", "8", "--steps", "3", "--lifetime-s", "0.1", "--free"
        )
        dev = node.dev_dir
    opened = [m.group(1) for m in (re.search(r'openat\(.*?"([^"]+)"', ln) for ln in lines) if m]
    for name in ("nvidiactl", "nvidia1", "nvidia-uvm"):
        assert str(dev / name) in opened
    assert str(dev / "nvidia0") not in opened  # only the device the context is on
    ioctls = [re.search(r"ioctl\(\d+<([^>]+)>, (0x[0-9a-f]+),", ln) for ln in lines if "ioctl(" in ln]
    calls = [(m.group(1), int(m.group(2), 16)) for m in ioctls if m]
    ctl = str(dev / "nvidiactl")
    assert calls.count((ctl, CARD_INFO_32)) == 1
    assert calls.count((ctl, RM_CONTROL_NVOS54)) == 1  # GET_ID_INFO_V2 of the one GPU used
    # the context's objects and its own memory (17 class-0x40 objects, as the H100's), then one per step
    assert calls.count((ctl, alloc_cmd)) == CONTEXT_OBJECTS + CONTEXT_MEMORY_OBJECTS + 3
    assert calls.count((ctl, RM_FREE_NVOS00)) == 3  # the steps'; the context's go with the process
    assert all(path == ctl for path, cmd in calls if (cmd >> 8) & 0xFF == ord("F"))


BPF_TEXT = r"""
struct ev_t {
    u32 cmd;
    u8 args[48];
    u8 params[128];
};
BPF_PERF_OUTPUT(events);

TRACEPOINT_PROBE(syscalls, sys_enter_ioctl) {
    if ((bpf_get_current_pid_tgid() >> 32) != TARGET_TGID)
        return 0;
    struct ev_t ev = {};
    ev.cmd = (u32)args->cmd;
    if (((ev.cmd >> 8) & 0xff) != 'F')
        return 0;
    u32 size = (ev.cmd >> 16) & 0x3fff;
    if (size > 48)
        size = 48;
    bpf_probe_read_user(ev.args, size & 63, (void *)args->arg);
    if ((ev.cmd & 0xff) == 0x2b) {
        u64 p = 0;
        bpf_probe_read_user(&p, sizeof(p), (void *)(args->arg + 16));
        bpf_probe_read_user(ev.params, sizeof(ev.params), (void *)p);
    }
    events.perf_submit(args, &ev, sizeof(ev));
    return 0;
}
"""


@pytest.fixture
def bpf_module(bcc_required: None) -> Iterator[Any]:
    os.environ.setdefault("BCC_KERNEL_SOURCE", "/opt/gpuwatch/kernel-headers/current")
    import bcc

    yield bcc


def _trace_worker(node: SimNode, bcc: Any) -> list[tuple[int, bytes, bytes]]:
    """Run a simworker (GPU 1, 4 x 5 MiB, freed at exit) under the tracepoint program;
    returns (cmd, first 48 bytes of the ioctl argument, 128 bytes of pAllocParms)."""
    # the shell waits for a line before exec'ing the worker, so the probe is attached
    # (filtered on this pid) before the first ioctl
    proc = subprocess.Popen(
        [
            "/bin/sh",
            "-c",
            f'read go; exec {node.libraries.worker_path} "$@"',
            "sh",
            "--gpu",
            "1",
            "--mib-per-step",
            "5",
            "--steps",
            "4",
            "--lifetime-s",
            "0.2",
            "--free",
        ],
        env=sim_env(node, dict(os.environ)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    events: list[tuple[int, bytes, bytes]] = []
    bpf = bcc.BPF(text=BPF_TEXT.encode(), cflags=[f"-DTARGET_TGID={proc.pid}"])
    try:

        def on_event(cpu: int, data: Any, size: int) -> None:
            raw = ctypes.string_at(data, size)
            cmd = struct.unpack_from("<I", raw, 0)[0]
            events.append((cmd, raw[4:52], raw[52:180]))

        bpf[b"events"].open_perf_buffer(on_event)
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.close()
        assert proc.wait(timeout=20) == 0
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            bpf.perf_buffer_poll(timeout=100)
            if sum(1 for e in events if e[0] == RM_FREE_NVOS00) >= 4:
                break
    finally:
        bpf.cleanup()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    return events


def test_tracepoint_reads_real_rm_alloc_and_free_layout(tmp_path: Path, bpf_module: Any) -> None:
    with private_node(tmp_path, devices=2, memory_bytes=GIB) as node:
        events = _trace_worker(node, bpf_module)
    allocs = [e for e in events if e[0] == RM_ALLOC_NVOS64 and struct.unpack_from("<I", e[1], 12)[0] == 0x40]
    frees = [e for e in events if e[0] == RM_FREE_NVOS00]
    # the context's own memory objects first (freed with the process: no RM_FREE), then the steps'
    context = context_objects()
    assert len(allocs) == len(context) + 4 and len(frees) == 4
    roots, handles, sizes = set(), [], []
    for _, args, params in allocs:
        h_root, h_parent, h_new, h_class = struct.unpack_from("<4I", args, 0)
        params_size, _flags, status = struct.unpack_from("<3I", args, 32)
        assert h_class == 0x40  # NV01_MEMORY_LOCAL_USER
        assert params_size == 0  # as real libcuda 580 sends it: RM sizes pAllocParms by the class
        assert status == 0
        # NV_MEMORY_ALLOCATION_PARAMS.size: RM's rounded size -- the sim's driver writes
        # its answer before the syscall, so entry sees it too
        sizes.append(struct.unpack_from("<Q", params, 64)[0])
        roots.add((h_root, h_parent))
        handles.append(h_new)
    # the steps: the 5 MiB asked for, rounded to 2 MiB pages
    assert sizes == [*context, *[6 * MIB] * 4]
    assert len(roots) == 1  # one client (hRoot) per process, one device parent
    assert len(set(handles)) == len(allocs)  # unique per allocation
    freed = []
    for _, args, _ in frees:
        h_root, h_parent, h_old, status = struct.unpack_from("<4I", args[:16], 0)
        assert (h_root, h_parent) in roots
        freed.append(h_old)
    assert sorted(freed) == sorted(handles[len(context):])  # the steps' objects


def test_device_handle_handshake_precedes_memory_allocations(tmp_path: Path, bpf_module: Any) -> None:
    with private_node(tmp_path, devices=2, memory_bytes=GIB) as node:
        events = _trace_worker(node, bpf_module)
    allocs = [(*struct.unpack_from("<4I", args, 0), params) for cmd, args, params in events if cmd == RM_ALLOC_NVOS64]
    classes = [a[3] for a in allocs]
    # client, device, subdevice, VA space, the context's memory objects, the 4 steps'
    assert classes == [0x41, 0x80, 0x2080, 0x90F1, *[0x40] * (CONTEXT_MEMORY_OBJECTS + 4)]
    (client_root, client_parent, client_new, _, _), device, subdevice = allocs[0], allocs[1], allocs[2]
    assert client_root == client_parent == client_new  # the RM client is its own root
    assert device[0] == client_root and device[1] == client_new
    # NV0080_ALLOC_PARAMETERS.deviceId of GPU 1 (minor 1) is RM's device instance, 0 on the
    # sim's 2-GPU node (instances count down from the last minor)
    assert struct.unpack_from("<I", device[4], 0)[0] == 0
    assert subdevice[1] == device[2]  # subdevice under the device
    assert all(a[1] == device[2] and a[0] == client_root for a in allocs[3:])  # VA space, memory under the device
