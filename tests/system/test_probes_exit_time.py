"""The decoder reads what the driver wrote back *during* the ioctl (root + BCC + FUSE).

A real NVIDIA driver answers inside the syscall: it writes the status, the handle it chose when
the caller passed 0, and the rounded size of a VID_HEAP_CONTROL allocation into the caller's
parameter block. The simulated node cannot show that (its device nodes do nothing, so the sim
writes its answer before the call); here a user-space driver behind FUSE (gpuwatch/sim/
fusedev.py) writes it during the call, the way the kernel module does. Every expectation
below differs between a decoder that reads at syscall exit (right) and one that reads at entry:
the requested 1000 bytes vs the 64 KiB the driver granted, a free whose status is still
"pending" at entry, an allocation that looks successful at entry and failed, a handle that is 0
at entry.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.probes.manager import ProbeConfig, ProbeManager
from gpuwatch.sim import fusedev
from tests.conftest import need_bcc
from tests.system.sim_helpers import scratch_cgroup

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
PENDING = 0xFFFFFFFF  # what a caller leaves in status before the driver answers
NO_MEMORY = 0x51  # NV_ERR_NO_MEMORY
RM_FREE, RM_ALLOC, VID_HEAP = 0xC0104629, 0xC030462B, 0xC0B8464A  # NVOS00, NVOS64, NVOS32

# The driver: what RM would answer, written into the caller's block during the ioctl.
CHOSEN_CLIENT, CHOSEN_MEMORY = 0xC1D00001, 0x6001
GRANTED_BYTES = 64 * 1024  # VID_HEAP ALLOC_SIZE of 1000 bytes, rounded up by RM


def driver(name: str, cmd: int, block: bytes) -> tuple[int, bytes]:
    b = bytearray(block)
    if cmd == RM_ALLOC:
        _root, _parent, h_new, h_class = struct.unpack_from("<IIII", b)
        if h_class == 0x41 and h_new == 0:
            struct.pack_into("<II", b, 0, CHOSEN_CLIENT, 0)  # RM picks the client handle
            struct.pack_into("<I", b, 8, CHOSEN_CLIENT)
        elif h_class == 0x40 and h_new == 0:
            struct.pack_into("<I", b, 8, CHOSEN_MEMORY)  # RM picks the memory handle
        status = NO_MEMORY if (h_class == 0x40 and h_new == 0x6002) else 0
        struct.pack_into("<I", b, 40, status)
    elif cmd == RM_FREE:
        struct.pack_into("<I", b, 12, 0)
    elif cmd == VID_HEAP:
        if struct.unpack_from("<I", b, 8)[0] == 2:  # ALLOC_SIZE: round the size up
            struct.pack_into("<Q", b, 88, GRANTED_BYTES)
        struct.pack_into("<I", b, 20, 0)
    return 0, bytes(b)


# The caller: a libcuda-like sequence on <mount>/nvidiactl, pausing at checkpoints.
CALLER = r"""
import ctypes, fcntl, os, struct, sys
PENDING = 0xFFFFFFFF
fd = os.open(sys.argv[1], os.O_RDWR)
keep = []

def pause(name):
    print(name, flush=True)
    sys.stdin.readline()

def rm_alloc(h_root, h_parent, h_new, h_class, params, status=PENDING):
    p = ctypes.create_string_buffer(bytes(params), max(len(params), 8))
    keep.append(p)
    b = bytearray(struct.pack("<IIIIQQIII", h_root, h_parent, h_new, h_class, ctypes.addressof(p),
                              0, len(params), 0, status) + bytes(4))
    fcntl.ioctl(fd, 0xC030462B, b)
    return struct.unpack_from("<III", b, 0)[2], struct.unpack_from("<I", b, 40)[0]

def memory_params(size):
    m = bytearray(128)
    struct.pack_into("<Q", m, 64, size)
    return m

def vid_heap(function, h_root, h_parent, h_memory, size=0, free_flags=0):
    b = bytearray(184)
    struct.pack_into("<IIII", b, 0, h_root, h_parent, function, 0)
    struct.pack_into("<I", b, 20, PENDING)
    struct.pack_into("<II", b, 44, h_memory, free_flags)
    struct.pack_into("<Q", b, 88, size)
    fcntl.ioctl(fd, 0xC0B8464A, b)
    return struct.unpack_from("<Q", b, 88)[0]

client, _ = rm_alloc(0, 0, 0, 0x41, bytearray(8))
rm_alloc(client, client, 0xD1, 0x80, bytearray(56))
granted = vid_heap(2, client, 0xD1, 0x5001, size=1000)
pause(f"vid-heap requested 1000 granted {granted}")
mem, status = rm_alloc(client, 0xD1, 0, 0x40, memory_params(2 << 20))
pause(f"rm-alloc handle {mem:#x} status {status}")
_, status = rm_alloc(client, 0xD1, 0x6002, 0x40, memory_params(4 << 20), status=0)
pause(f"rm-alloc refused status {status:#x}")
b = bytearray(struct.pack("<IIII", client, 0xD1, mem, PENDING))
fcntl.ioctl(fd, 0xC0104629, b)
vid_heap(3, client, 0xD1, 0x5001, free_flags=1)
pause("freed")
"""



@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[Path]:
    need_bcc()
    why = fusedev.available()
    if why:
        pytest.skip(why)
    dev = tmp_path / "dev"
    dev.mkdir()
    with fusedev.FuseDriver(dev, ["nvidiactl", "nvidia0"], driver) as fuse:
        yield dev
        assert not fuse.errors, fuse.errors


@pytest.fixture
def cgroup() -> Iterator[Path]:
    with scratch_cgroup("gpuwatch-test-exit-time") as path:
        yield path


def test_the_decoder_reads_the_drivers_answer_at_syscall_exit(mounted: Path, cgroup: Path) -> None:
    pm = ProbeManager(ProbeConfig(device_prefix=str(mounted / "nvidia"), alloc_uprobes=False,
                                  scan_all_processes=False, sweep_interval_s=0.0))
    pm.start()
    procs = str(cgroup / "cgroup.procs")

    def enter() -> None:
        with open(procs, "w") as f:
            f.write("0")

    caller = subprocess.Popen([sys.executable, "-c", CALLER, str(mounted / "nvidiactl")], preexec_fn=enter,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cgroup_id = os.stat(cgroup).st_ino
    seen: list[tuple[str, int, int]] = []
    try:
        assert caller.stdout is not None and caller.stdin is not None
        for _ in range(4):
            ready, _, _ = select.select([caller.stdout], [], [], 30.0)
            assert ready, "caller stalled"
            line = caller.stdout.readline().strip()
            assert line, caller.stderr.read() if caller.stderr else "caller exited"
            found = [c for c in pm.read() if c.cgroup_id == cgroup_id]
            live = sum(b for _, b in found[0].allocated_bytes_by_gpu) if found else 0
            failures = found[0].allocation_failures_total if found else 0
            seen.append((line, live, failures))
            caller.stdin.write("\n")
            caller.stdin.flush()
        assert caller.wait(10) == 0
    finally:
        if caller.poll() is None:
            caller.kill()
        caller.wait()
        pm.stop()
    print(json.dumps(seen, indent=1))
    # the caller saw the driver's answers (the FUSE driver really wrote during the syscall)
    assert seen[0][0] == f"vid-heap requested 1000 granted {GRANTED_BYTES}"
    assert seen[1][0] == f"rm-alloc handle {CHOSEN_MEMORY:#x} status 0"
    assert seen[2][0] == f"rm-alloc refused status {NO_MEMORY:#x}"
    # and so did the probe: granted size, not the 1000 asked for
    assert seen[0][1] == GRANTED_BYTES
    # + 2 MiB under the handle RM chose (0 at entry)
    assert seen[1][1] == GRANTED_BYTES + 2 * MiB
    # the refusal (status 0 at entry) adds nothing and counts as a failure
    assert seen[2][1] == GRANTED_BYTES + 2 * MiB and seen[2][2] >= 1
    # frees whose status was "pending" at entry, keyed by the chosen handle
    assert seen[3][1] == 0
