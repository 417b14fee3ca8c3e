"""The simulated driver (issue 11, item 2): what the stub libcuda tells the driver, and
NVML's per-process number following RM's rule.

A driven CUDA program (ctypes on the stub, commands on stdin) allocates, frees and
destroys contexts step by step; after each step the test reads the sim state and NVML
(pynvml on the fake) and compares the process's used memory with RM's rule computed
here from the documented sizes (gpuwatch/sim/README.md "Driver traffic"):
  the live class-0x40 memory objects at their rounded sizes -- 2 MiB pages from 2 MiB,
  64 KiB below; context memory included; chunks, not the cuMemAllocs carved from them;
  never managed memory (nvidia-uvm), as the real H100 trace shows (test_sim_real_shape.py).
The traffic itself is checked from outside: strace for the ioctl words and fds, and a
syscall tracepoint that reads the parameter blocks from the caller's memory.
"""

from __future__ import annotations

import ctypes
import os
import re
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.sim import SimNode, sim_env, status
from gpuwatch.sim.node import DEFAULT_CONTEXT_MIB, driver_env
from tests.conftest import need_binary, need_root
from tests.system.sim_helpers import GIB, MIB, private_node, run_nvml, sim_run_argv

KIB = 1024
RM_ALLOC_NVOS64 = 0xC030462B
RM_FREE_NVOS00 = 0xC0104629
RM_CONTROL_NVOS54 = 0xC020462A
VID_HEAP_NVOS32 = 0xC0B8464A  # _IOWR('F', 0x4A, 184 bytes)
CARD_INFO_32 = 0xC90046C8  # _IOWR('F', 200, 32 x 72 bytes)
UVM_INITIALIZE = 0x30000001
CONTEXT_RM_ALLOCS = 4  # client, device, subdevice, VA space


def rm_size(nbytes: int) -> int:
    """The size RM gives a memory object of `nbytes` (the sim's documented page sizes)."""
    page = 2 * MIB if nbytes >= 2 * MIB else 64 * KIB
    return -(-nbytes // page) * page


RECORDED_CONTEXT_MIB = [6, *[2] * 14, 70]  # the H100 context's objects, then the rest in one


def context_objects(context_mib: int) -> list[int]:
    """The context's own memory objects (README "Driver traffic"): the recorded H100
    context's pieces in order, the rest in one, each capped at what is left and kept a
    multiple of 2 MiB, an odd last MiB on its own."""
    pieces, left = [], context_mib * MIB
    while left:
        piece = min(left, RECORDED_CONTEXT_MIB[len(pieces)] * MIB if len(pieces) < len(RECORDED_CONTEXT_MIB) else left)
        piece -= piece % (2 * MIB) if piece >= 2 * MIB else 0
        pieces.append(piece)
        left -= piece
    return [rm_size(p) for p in pieces]


def test_context_objects_of_the_default_context_are_the_recorded_ones() -> None:
    assert context_objects(518) == [m * MIB for m in (6, *[2] * 14, 70, 414)]
    assert context_objects(5) == [4 * MIB, 1 * MIB] and context_objects(3) == [2 * MIB, 1 * MIB]


DRIVEN = r"""
import ctypes, os, sys
cu = ctypes.CDLL(sys.argv[1])
cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t]
cu.cuMemAllocManaged.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t, ctypes.c_uint]
cu.cuMemFree_v2.argtypes = [ctypes.c_ulonglong]
cu.cuCtxDestroy_v2.argtypes = [ctypes.c_void_p]
print("init", cu.cuInit(0), os.getpid(), flush=True)
ctxs = {}
for line in sys.stdin:
    op, *args = line.split()
    if op == "ctx":
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        rc = cu.cuDeviceGet(ctypes.byref(dev), int(args[0])) or cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)
        ctxs[args[0]] = ctx.value
        print(rc, flush=True)
    elif op == "use":
        print(cu.cuCtxSetCurrent(ctypes.c_void_p(ctxs[args[0]])), flush=True)
    elif op in ("alloc", "managed"):
        p = ctypes.c_ulonglong()
        rc = (cu.cuMemAlloc_v2(ctypes.byref(p), int(args[0])) if op == "alloc"
              else cu.cuMemAllocManaged(ctypes.byref(p), int(args[0]), 1))
        print(rc, p.value, flush=True)
    elif op == "free":
        print(cu.cuMemFree_v2(int(args[0])), flush=True)
    elif op == "destroy":
        print(cu.cuCtxDestroy_v2(ctypes.c_void_p(ctxs.pop(args[0]))), flush=True)
    elif op == "exit":
        break
"""


class Driven:
    """A CUDA program on the stub, one driver-API step per command; optionally under strace."""

    def __init__(self, node: SimNode, tmp_path: Path, env: dict[str, str], trace: bool) -> None:
        argv = [sys.executable, "-c", DRIVEN, str(node.libraries.cuda_path)]
        self.strace_log = tmp_path / f"strace-{time.monotonic_ns()}.txt"
        if trace:
            strace = need_binary("strace", "strace")
            argv = [strace, "-f", "-y", "-X", "raw", "-e", "trace=openat,ioctl,mmap,munmap,close",
                    "-o", str(self.strace_log), *argv]
        full_env = sim_env(node, dict(os.environ))
        full_env.update(env)
        self.proc = subprocess.Popen(argv, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        first = self._line()
        assert first[:2] == ["init", "0"], first
        self.pid = int(first[2])  # the program's, not strace's

    def _line(self) -> list[str]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            pytest.fail(f"driven program ended: {err[-2000:]}")
        return line.split()

    def do(self, *cmd: object) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(str(c) for c in cmd) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def ok(self, *cmd: object) -> None:
        reply = self.do(*cmd)
        assert reply[0] == "0", (cmd, reply)

    def alloc(self, nbytes: int, managed: bool = False) -> int:
        rc, ptr = self.do("managed" if managed else "alloc", nbytes)
        assert rc == "0", (nbytes, rc)
        return int(ptr)

    def finish(self) -> list[str]:
        """Exit the program; its strace lines (empty when not traced)."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("exit\n")
            self.proc.stdin.close()
            assert self.proc.wait(timeout=20) == 0
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return self.strace_log.read_text().splitlines() if self.strace_log.exists() else []

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def driven(node: SimNode, tmp_path: Path, trace: bool = False, **cfg: Any) -> Iterator[Driven]:
    program = Driven(node, tmp_path, driver_env(**cfg), trace)
    try:
        yield program
    finally:
        program.kill()


def ledger_of(node: SimNode, pid: int, gpu: int) -> Any:
    """The sim state's entry of (pid, gpu), None when the process is not listed there."""
    return next((p for p in status(node).processes if p.host_pid == pid and p.device == gpu), None)


def nvml_used(node: SimNode, gpu: int) -> dict[str, int]:
    """NVML's per-process used memory on `gpu` (pynvml on the fake, a fresh process)."""
    return run_nvml(
        node,
        f"h = pynvml.nvmlDeviceGetHandleByIndex({gpu})\n"
        "print(json.dumps({str(p.pid): p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}))",
    )


def ioctl_words(lines: list[str], node: SimNode) -> list[tuple[str, int]]:
    """(device node name, ioctl request word) of every ioctl strace saw on the sim's nodes."""
    calls = []
    for ln in lines:
        m = re.search(r"ioctl\(\d+<([^>]+)>, (0x[0-9a-f]+),", ln)
        if m and m.group(1).startswith(str(node.dev_dir)):
            calls.append((Path(m.group(1)).name, int(m.group(2), 16)))
    return calls


SIZES = [1 * KIB, 100 * KIB, 1 * MIB, 3 * MIB, 5 * MIB, 12 * MIB, 40 * MIB]


@pytest.fixture
def two_gpus(tmp_path: Path) -> Iterator[SimNode]:
    need_root()
    with private_node(tmp_path, devices=2, memory_bytes=GIB) as node:
        yield node


@pytest.mark.parametrize("alloc_path", ["rm-alloc", "vid-heap"])
@pytest.mark.parametrize("suballoc_mib", [0, 16])
def test_nvml_per_process_memory_follows_rms_rule(
    two_gpus: SimNode, tmp_path: Path, alloc_path: str, suballoc_mib: int
) -> None:
    node, context_mib = two_gpus, 5
    ctx = context_objects(context_mib)
    assert ctx == [4 * MIB, 1 * MIB]
    # suballocation: 1 KiB .. 5 MiB (9.1 MiB carved) share the first 16 MiB chunk, 12 MiB
    # does not fit in what is left and opens a second one, 40 MiB > 16 MiB is its own object
    objects = [16 * MIB, 16 * MIB, rm_size(40 * MIB)] if suballoc_mib else [rm_size(s) for s in SIZES]
    with driven(node, tmp_path, trace=True, alloc_path=alloc_path, suballoc_mib=suballoc_mib,
                context_mib=context_mib) as prog:
        pid = prog.pid
        prog.ok("ctx", 1)
        entry = ledger_of(node, pid, 1)
        assert entry.memory_bytes == entry.context_bytes == sum(ctx) and entry.rm_objects == len(ctx)
        ptrs = [prog.alloc(s) for s in SIZES]
        entry = ledger_of(node, pid, 1)
        want = sum(ctx) + sum(objects)
        assert (entry.memory_bytes, entry.rm_memory_bytes, entry.managed_bytes) == (want, want, 0)
        assert entry.rm_objects == len(ctx) + len(objects)
        assert entry.requested_bytes == sum(SIZES)
        assert nvml_used(node, 1) == {str(pid): want}
        assert nvml_used(node, 0) == {}  # nothing on the other GPU
        # free all but the 40 MiB: every object of its own goes at once; the chunks only
        # when the last cuMemAlloc carved from them is freed
        for ptr in ptrs[:-1]:
            prog.ok("free", ptr)
        after = sum(ctx) + rm_size(40 * MIB)
        assert ledger_of(node, pid, 1).memory_bytes == after
        assert nvml_used(node, 1) == {str(pid): after}
        prog.ok("destroy", 1)  # frees the device: context memory and the 40 MiB with it
        assert ledger_of(node, pid, 1) is None
        assert nvml_used(node, 1) == {}
        lines = prog.finish()
    calls = ioctl_words(lines, node)
    n_driver_objects = len(ctx) + len(objects)
    assert calls.count(("nvidiactl", CARD_INFO_32)) == 1
    assert calls.count(("nvidiactl", RM_CONTROL_NVOS54)) == 1
    assert calls.count(("nvidiactl", RM_FREE_NVOS00)) == 1 + (len(objects) - 1 if alloc_path == "rm-alloc" else 0)
    if alloc_path == "rm-alloc":
        assert calls.count(("nvidiactl", RM_ALLOC_NVOS64)) == CONTEXT_RM_ALLOCS + n_driver_objects
        assert ("nvidiactl", VID_HEAP_NVOS32) not in calls
    else:  # every memory object through VID_HEAP_CONTROL: ALLOC_SIZE, and FREE for all but the 40 MiB
        assert calls.count(("nvidiactl", RM_ALLOC_NVOS64)) == CONTEXT_RM_ALLOCS
        assert calls.count(("nvidiactl", VID_HEAP_NVOS32)) == n_driver_objects + len(objects) - 1
    assert all(name == "nvidiactl" for name, word in calls if (word >> 8) & 0xFF == ord("F"))


def test_allocation_that_does_not_fit_reports_the_drivers_refusal(two_gpus: SimNode, tmp_path: Path) -> None:
    node = two_gpus  # 1 GiB GPUs: the default 518 MiB context and 400 MiB fit, 200 MiB more does not
    with driven(node, tmp_path, trace=True) as prog:
        prog.ok("ctx", 0)
        prog.alloc(400 * MIB)
        assert prog.do("alloc", 200 * MIB)[0] == "2"  # CUDA_ERROR_OUT_OF_MEMORY
        assert ledger_of(node, prog.pid, 0).memory_bytes == (DEFAULT_CONTEXT_MIB + 400) * MIB
        lines = prog.finish()
    # the refused allocation reached the driver too (RM answered NV_ERR_NO_MEMORY)
    context = len(context_objects(DEFAULT_CONTEXT_MIB))
    assert ioctl_words(lines, node).count(("nvidiactl", RM_ALLOC_NVOS64)) == CONTEXT_RM_ALLOCS + context + 2


def test_managed_memory_goes_through_nvidia_uvm_and_nvml_leaves_it_out(two_gpus: SimNode, tmp_path: Path) -> None:
    """As on the H100 (test_sim_real_shape.py): no RM object, NVML's number unchanged, and
    no room check (managed memory oversubscribes: 2 GiB of ranges on a 1 GiB GPU)."""
    node = two_gpus
    with driven(node, tmp_path, trace=True, context_mib=1) as prog:
        pid = prog.pid
        prog.ok("ctx", 0)
        big = prog.alloc(5 * MIB, managed=True)
        small = prog.alloc(1 * KIB, managed=True)
        entry = ledger_of(node, pid, 0)
        # mapped in 2 MiB chunks (the ledger keeps the length); no RM object for it
        assert (entry.managed_bytes, entry.rm_objects, entry.memory_bytes) == (6 * MIB + 2 * MIB, 1, 1 * MIB)
        assert nvml_used(node, 0) == {str(pid): 1 * MIB}
        huge = prog.alloc(2 * GIB, managed=True)
        prog.ok("free", huge)
        prog.ok("free", big)
        assert nvml_used(node, 0) == {str(pid): 1 * MIB}
        prog.ok("free", small)
        assert ledger_of(node, pid, 0).managed_bytes == 0
        lines = prog.finish()
    calls = ioctl_words(lines, node)
    assert calls.count(("nvidia-uvm", UVM_INITIALIZE)) == 1  # once per process
    assert calls.count(("nvidiactl", RM_ALLOC_NVOS64)) == CONTEXT_RM_ALLOCS + 1  # the context's 1 MiB only
    uvm = str(node.dev_dir / "nvidia-uvm")
    maps = [ln for ln in lines if ln.split("(", 1)[0].split()[-1] == "mmap" and f"<{uvm}>" in ln]
    assert len(maps) == 3 and all("= 0x" in ln for ln in maps)  # three ranges, all mapped


@pytest.mark.parametrize("teardown", ["free-device", "free-client", "close-fd"])
def test_frees_by_parent_and_by_closing_the_control_fd(two_gpus: SimNode, tmp_path: Path, teardown: str) -> None:
    node = two_gpus
    with driven(node, tmp_path, trace=True, context_mib=2, ctx_teardown=teardown) as prog:
        pid = prog.pid
        prog.ok("ctx", 0)
        prog.alloc(64 * MIB)
        prog.alloc(3 * MIB, managed=True)
        prog.ok("ctx", 1)
        prog.alloc(32 * MIB)
        assert nvml_used(node, 0) == {str(pid): 2 * MIB + 64 * MIB}  # the managed range is not counted
        assert nvml_used(node, 1) == {str(pid): 2 * MIB + 32 * MIB}
        # not the last context: its device is freed with everything under it, GPU 0 keeps its own
        prog.ok("destroy", 1)
        assert ledger_of(node, pid, 1) is None
        assert ledger_of(node, pid, 0).memory_bytes == 66 * MIB
        # the last context: device, client or fd -- every object is gone either way
        prog.ok("destroy", 0)
        assert [p for p in status(node).processes if p.host_pid == pid] == []
        assert nvml_used(node, 0) == {}
        # and the process can start again: a new client (re-opening nvidiactl after close)
        prog.ok("ctx", 0)
        assert ledger_of(node, pid, 0).memory_bytes == 2 * MIB
        lines = prog.finish()
    calls = ioctl_words(lines, node)
    ctl = str(node.dev_dir / "nvidiactl")
    ctl_closes = [ln for ln in lines if re.search(rf"close\(\d+<{re.escape(ctl)}>\)", ln)]
    frees = calls.count(("nvidiactl", RM_FREE_NVOS00))
    if teardown == "close-fd":
        assert (frees, len(ctl_closes)) == (1, 1)  # device 1 freed; then the fd closed with GPU 0's objects live
        assert calls.count(("nvidiactl", CARD_INFO_32)) == 2  # re-opened for the new client
    else:
        assert (frees, len(ctl_closes)) == (2, 0)  # device 1, then device 0 or the client
        assert calls.count(("nvidiactl", CARD_INFO_32)) == 1
    # GPU 0: client, device, subdevice, VA space, 2 MiB context memory, 64 MiB (6); GPU 1:
    # the same without a client, 32 MiB (5); GPU 0 again: 4, plus a new client unless the
    # first one survived (free-device)
    assert calls.count(("nvidiactl", RM_ALLOC_NVOS64)) == 6 + 5 + 4 + (teardown != "free-device")


def test_process_exit_frees_everything_it_held(two_gpus: SimNode, tmp_path: Path) -> None:
    node = two_gpus
    with driven(node, tmp_path, context_mib=4, suballoc_mib=8) as prog:
        pid = prog.pid
        prog.ok("ctx", 1)
        prog.alloc(3 * MIB)
        prog.alloc(1 * MIB, managed=True)
        assert nvml_used(node, 1) == {str(pid): 4 * MIB + 8 * MIB}  # the managed MiB is not counted
        prog.kill()
        deadline = time.monotonic() + 2
        while ledger_of(node, pid, 1) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert nvml_used(node, 1) == {}


def test_device_instances_are_numbered_differently_from_minors(tmp_path: Path) -> None:
    need_root()
    with private_node(tmp_path, devices=4, memory_bytes=GIB) as node:
        devices = status(node).devices
    assert [d.minor for d in devices] == [0, 1, 2, 3]
    assert [d.device_instance for d in devices] == [3, 2, 1, 0]
    assert len({d.gpu_id for d in devices}) == 4


def test_sim_run_passes_the_driver_options_to_the_stub(two_gpus: SimNode, tmp_path: Path) -> None:
    node = two_gpus
    argv = sim_run_argv(name=node.name, gpu=1, mib_per_step=1, steps=3, interval_s=0, alloc_path="vid-heap",
                        suballoc_mib=8, context_mib=3)
    runs = {"cuMemAlloc": argv, "managed": [*argv, "--managed"]}
    for what, cmd in runs.items():
        proc = subprocess.Popen(cmd, env=sim_env(node, dict(os.environ)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            words: list[str] = []
            for line in proc.stdout:
                words = line.split()
                if words and words[0] == "ready":
                    break
            assert words[:1] == ["ready"], proc.stderr.read() if proc.stderr else ""
            entry = ledger_of(node, proc.pid, 1)
            if what == "managed":  # the context's 2 + 1 MiB; three 1 MiB ranges in 2 MiB chunks, not in NVML
                assert (entry.memory_bytes, entry.managed_bytes, entry.rm_objects) == (3 * MIB, 6 * MIB, 2)
            else:  # the context's 2 + 1 MiB and one 8 MiB chunk for the three 1 MiB allocations
                assert (entry.memory_bytes, entry.context_bytes, entry.rm_objects) == (11 * MIB, 3 * MIB, 3)
            assert entry.requested_bytes == 3 * MIB
        finally:
            proc.kill()
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
    bad = subprocess.run([*argv[:5], "--name", node.name, "--alloc-path", "rm-free"], capture_output=True,
                         text=True, env=sim_env(node, dict(os.environ)), check=False)
    assert bad.returncode == 2 and "rm-free" in bad.stderr


BPF_TEXT = r"""
struct ev_t {
    u32 cmd;
    u32 pad;
    u8 args[192];
    u8 params[64];
};
BPF_PERCPU_ARRAY(scratch, struct ev_t, 1);
BPF_PERF_OUTPUT(events);

TRACEPOINT_PROBE(syscalls, sys_enter_ioctl) {
    if ((bpf_get_current_pid_tgid() >> 32) != TARGET_TGID)
        return 0;
    int zero = 0;
    struct ev_t *ev = scratch.lookup(&zero);
    if (!ev)
        return 0;
    __builtin_memset(ev, 0, sizeof(*ev));
    ev->cmd = (u32)args->cmd;
    if (((ev->cmd >> 8) & 0xff) != 'F')
        return 0;
    bpf_probe_read_user(ev->args, sizeof(ev->args), (void *)args->arg);
    u32 nr = ev->cmd & 0xff;
    if (nr == 0x2b || nr == 0x2a) {  /* RM_ALLOC pAllocParms / RM_CONTROL params, both at 16 */
        u64 p = 0;
        bpf_probe_read_user(&p, sizeof(p), (void *)(args->arg + 16));
        bpf_probe_read_user(ev->params, sizeof(ev->params), (void *)p);
    }
    events.perf_submit(args, ev, sizeof(*ev));
    return 0;
}
"""


@pytest.fixture
def bcc_module(bcc_required: None) -> Any:
    os.environ.setdefault("BCC_KERNEL_SOURCE", "/opt/gpuwatch/kernel-headers/current")
    import bcc

    return bcc


@contextmanager
def ioctl_trace(bcc: Any, pid: int, events: list[tuple[int, bytes, bytes]]) -> Iterator[Any]:
    """BPF_TEXT for the process `pid`: each ioctl it makes appended to `events` as (request word,
    parameter block at entry, the driver's answer); unloaded at the end."""
    bpf = bcc.BPF(text=BPF_TEXT.encode(), cflags=[f"-DTARGET_TGID={pid}"])
    try:

        def on_event(cpu: int, data: Any, size: int) -> None:
            raw = ctypes.string_at(data, size)
            events.append((struct.unpack_from("<I", raw, 0)[0], raw[8:200], raw[200:264]))

        bpf[b"events"].open_perf_buffer(on_event)
        yield bpf
    finally:
        bpf.cleanup()


def poll_until_seen(bpf: Any, events: list[tuple[int, bytes, bytes]], word: int, timeout_s: float = 3) -> None:
    """Read the perf buffer until an event with request `word` is in `events` (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not any(c == word for c, _, _ in events):
        bpf.perf_buffer_poll(timeout=100)


def test_tracepoint_reads_id_info_vid_heap_and_client_free(two_gpus: SimNode, tmp_path: Path, bcc_module: Any) -> None:
    """The parameter blocks as the kernel sees them at syscall entry (the sim's driver
    answers before the call, so its answers are there too)."""
    bcc = bcc_module
    node = two_gpus
    events: list[tuple[int, bytes, bytes]] = []
    # no context memory: the test reads the device objects and two allocations by position,
    # and the default context's 17 memory objects would only sit between them
    with driven(node, tmp_path, alloc_path="vid-heap", ctx_teardown="free-client", context_mib=0) as prog:
        with ioctl_trace(bcc, prog.pid, events) as bpf:
            prog.ok("ctx", 1)  # cuInit ran before the probe: CARD_INFO is checked on a re-open below
            ptr = prog.alloc(5 * MIB)
            prog.ok("free", ptr)
            prog.alloc(3 * MIB)
            prog.ok("destroy", 1)
            poll_until_seen(bpf, events, RM_FREE_NVOS00)
        prog.finish()
    words = [c for c, _, _ in events]
    assert words == [RM_ALLOC_NVOS64, RM_CONTROL_NVOS54, RM_ALLOC_NVOS64, RM_ALLOC_NVOS64, RM_ALLOC_NVOS64,
                     VID_HEAP_NVOS32, VID_HEAP_NVOS32, VID_HEAP_NVOS32, RM_FREE_NVOS00]
    client = struct.unpack_from("<4I", events[0][1], 0)
    h_client = client[0]
    assert client == (h_client, h_client, h_client, 0x41)
    # GET_ID_INFO_V2 on the client: gpu_id of GPU 1 -> device instance 0 (minor 1)
    h_obj_client, h_obj, cmd = struct.unpack_from("<3I", events[1][1], 0)
    assert (h_obj_client, h_obj, cmd) == (h_client, h_client, 0x205)
    assert struct.unpack_from("<I", events[1][1], 24)[0] == 32  # paramsSize
    gpu_id, _flags, instance = struct.unpack_from("<3I", events[1][2], 0)
    assert (gpu_id, instance) == (status(node).devices[1].gpu_id, 0)
    device = struct.unpack_from("<4I", events[2][1], 0)
    assert device[3] == 0x80 and struct.unpack_from("<I", events[2][2], 0)[0] == 0  # deviceId = instance
    h_device = device[2]
    assert [struct.unpack_from("<I", e[1], 12)[0] for e in events[3:5]] == [0x2080, 0x90F1]
    allocs = []
    for _, args, _ in events[5:8]:
        h_root, h_parent, function = struct.unpack_from("<3I", args, 0)
        status_word = struct.unpack_from("<I", args, 20)[0]
        _owner, h_memory = struct.unpack_from("<2I", args, 40)
        attr = struct.unpack_from("<I", args, 56)[0]
        size = struct.unpack_from("<Q", args, 88)[0]
        assert (h_root, h_parent, status_word) == (h_client, h_device, 0)
        allocs.append((function, h_memory, size, (attr >> 25) & 3))
    (f1, h1, s1, loc1), (f2, h2, _, _), (f3, h3, s3, _) = allocs
    assert (f1, s1, loc1) == (2, 6 * MIB, 0)  # ALLOC_SIZE, 5 MiB rounded, LOCATION VIDMEM
    assert (f2, h2) == (3, h1)  # FREE of that handle
    assert (f3, s3) == (2, 4 * MIB) and h3 != h1
    # the last context ends the client: RM_FREE of the client itself, its objects still live
    assert struct.unpack_from("<3I", events[8][1], 0) == (h_client, h_client, h_client)


def test_card_info_lists_every_gpu_with_its_minor(two_gpus: SimNode, tmp_path: Path, bcc_module: Any) -> None:
    bcc = bcc_module
    node = two_gpus
    events: list[tuple[int, bytes, bytes]] = []
    with driven(node, tmp_path, ctx_teardown="close-fd") as prog:
        with ioctl_trace(bcc, prog.pid, events) as bpf:
            prog.ok("ctx", 0)
            prog.ok("destroy", 0)  # closes nvidiactl ...
            prog.ok("ctx", 0)  # ... so the next context opens it again and asks CARD_INFO first
            poll_until_seen(bpf, events, CARD_INFO_32)
        prog.finish()
        devices = status(node).devices
    card = next(args for c, args, _ in events if c == CARD_INFO_32)
    cards = [(card[72 * i], *struct.unpack_from("<I", card, 72 * i + 16), *struct.unpack_from("<I", card, 72 * i + 56))
             for i in range(2)]
    # valid, gpu_id, minor_number of each GPU
    assert cards == [(1, d.gpu_id, d.minor) for d in devices]
    assert devices[0].gpu_id != devices[1].gpu_id
