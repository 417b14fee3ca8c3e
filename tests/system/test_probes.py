"""Kernel probes against real processes in real cgroups (root + BCC).

A tiny C workload (test_probes_workload.c) opens char device nodes (mknod 1:3) under a tmp
prefix and issues real-encoded NVIDIA ioctls, and calls cuMemAlloc_v2 & co. in a stand-in
libcuda (test_probes_fakecuda.c). Each test runs workloads in cgroups it creates under the
cgroup v2 tree, then compares what the probes counted with what the workload did. One
ProbeManager (one BCC compile) is shared by the module.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuwatch.core.model import ProbeCounters
from gpuwatch.probes import bpfsys
from gpuwatch.probes.manager import ProbeConfig, ProbeManager
from tests.conftest import need_bcc
from tests.system.sim_helpers import cgroup2_root, end_trace, gpuwatch_trace

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RM_BOUND = 4096  # max_rm_allocs for this module's manager (the leak test overflows it)
MiB = 1 << 20



class Workload:
    """One workload process; it stops at each `pause` until release()."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, "workload did not reach its pause point"
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", f"workload failed: rc={self.proc.poll()} {line!r}"

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def finish(self, timeout_s: float = 60.0) -> int:
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@dataclass
class Lab:
    root: Path
    prefix: str
    workload: Path
    lib: Path
    cgroup_base: Path
    procs: list[Workload] = field(default_factory=list)
    cgroups: list[Path] = field(default_factory=list)

    def cgroup(self, name: str) -> tuple[Path, int]:
        path = self.cgroup_base / name
        path.mkdir()
        self.cgroups.append(path)
        return path, os.stat(path).st_ino

    def spawn(self, cgroup: Path, *cmds: str) -> Workload:
        procs_file = str(cgroup / "cgroup.procs")

        def enter_cgroup() -> None:  # before exec, so the workload starts inside
            with open(procs_file, "w") as f:
                f.write("0")

        proc = subprocess.Popen([str(self.workload), self.prefix, *cmds], preexec_fn=enter_cgroup,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        w = Workload(proc)
        self.procs.append(w)
        return w

    def cleanup(self) -> None:
        for w in self.procs:
            w.kill()
        for path in reversed(self.cgroups):
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        self.cgroup_base.rmdir()


def build_lab_binaries(work: Path) -> tuple[Path, Path]:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is required (apt-get install gcc)"
    exe = work / "workload"
    lib = work / "lib" / "libcuda.so.1"
    lib.parent.mkdir()
    subprocess.run([cc, "-O1", "-o", str(exe), str(HERE / "test_probes_workload.c"), "-ldl"], check=True)
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(lib), str(HERE / "test_probes_fakecuda.c")],
                   check=True)
    return exe, lib


def make_device_nodes(dev: Path, names: tuple[str, ...]) -> None:
    """Stand-in NVIDIA device nodes: char devices 1:3 (/dev/null's) under the given names."""
    dev.mkdir()
    for name in names:
        os.mknod(dev / name, 0o666 | 0o020000, os.makedev(1, 3))


@contextmanager
def probe_lab(work: Path, name: str, devices: tuple[str, ...]) -> Iterator[Lab]:
    """The C workload and fake libcuda built in `work`, the device nodes in work/dev, a cgroup
    gpuwatch-<name>-test-<pid> for the workloads; all cleaned up at the end."""
    need_bcc()
    exe, lib = build_lab_binaries(work)
    make_device_nodes(work / "dev", devices)
    base = cgroup2_root() / f"gpuwatch-{name}-test-{os.getpid()}"
    base.mkdir()
    lab = Lab(root=work, prefix=str(work / "dev" / "nvidia"), workload=exe, lib=lib, cgroup_base=base)
    try:
        yield lab
    finally:
        lab.cleanup()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    devices = ("nvidiactl", "nvidia0", "nvidia1", "nvidia-uvm")
    with probe_lab(tmp_path_factory.mktemp("probes"), "probes", devices) as lab:
        yield lab


@pytest.fixture(scope="module")
def manager(lab: Lab) -> Iterator[ProbeManager]:
    # scan_all_processes=False: attach only to libraries of GPU processes on our device nodes,
    # never into other processes that happen to map a libcuda on this machine
    with ProbeManager(ProbeConfig(device_prefix=lab.prefix, libcuda_paths=(str(lab.lib),),
                                  launch_uprobes=True, max_rm_allocs=RM_BOUND, sweep_interval_s=0.0,
                                  scan_all_processes=False)) as pm:
        yield pm


def counters_for(pm: ProbeManager, cgroup_id: int) -> ProbeCounters:
    found = [c for c in pm.read() if c.cgroup_id == cgroup_id]
    assert found, f"no counters for cgroup {cgroup_id}"
    return found[0]


def wait_for(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    assert predicate(), "condition not reached in time"  # type: ignore[operator]


def test_ioctl_counts_and_decoded_bytes_per_cgroup(lab: Lab, manager: ProbeManager) -> None:
    cg, cg_id = lab.cgroup("ioctl")
    # two GPU nodes open: an allocation through nvidiactl cannot be pinned to one GPU (-1)
    w = lab.spawn(cg, "open", "ctl", "open", "0", "open", "1",
                  "ioctl", "0", "0x2a", "5",                              # 5 x RM_CONTROL
                  "rmalloc", "1", "7", "100", "0x40", str(3 * MiB), "21",  # on nvidia0
                  "rmalloc", "0", "7", "101", "0x40", "4096", "64",        # on ctl, NVOS64
                  "rmalloc", "0", "7", "102", "0xc2", "8192", "x21",       # physical (no FB memory), xfer
                  "rmalloc", "0", "7", "103", "0x3e", "65536", "21",       # system memory: not counted
                  "rmfree", "0", "7", "101", "00",
                  "pause")
    w.wait_ready()
    c = counters_for(manager, cg_id)
    assert dict(c.ioctl_calls_by_op) == {"rm_control": 5, "rm_alloc": 4, "rm_free": 1}
    # the nodes are /dev/null: the kernel answers ENOTTY, and the probes say so
    assert c.ioctl_failures_total == 10
    # NV01_MEMORY_LOCAL_PHYSICAL (0xC2) allocates no framebuffer memory: never counted (issue 11)
    assert dict(c.allocated_bytes_by_gpu) == {0: 3 * MiB, -1: 0}
    assert c.allocations_total == 2 and c.frees_total == 1
    w.release()
    assert w.finish() == 0
    wait_for(lambda: dict(counters_for(manager, cg_id).allocated_bytes_by_gpu) == {0: 0, -1: 0})
    assert dict(counters_for(manager, cg_id).ioctl_calls_by_op)["rm_alloc"] == 4


def test_close_releases_memory_allocated_through_the_fd(lab: Lab, manager: ProbeManager) -> None:
    cg, cg_id = lab.cgroup("close")
    # one GPU node open (a container given GPU 1): allocations through nvidiactl are GPU 1's
    w = lab.spawn(cg, "open", "ctl", "open", "1",
                  "rmalloc", "1", "9", "200", "0x40", str(MiB), "21",
                  "rmalloc", "0", "9", "201", "0x40", str(2 * MiB), "21", "pause",
                  "close", "1", "pause")
    w.wait_ready()
    assert dict(counters_for(manager, cg_id).allocated_bytes_by_gpu) == {1: 3 * MiB}
    w.release()
    w.wait_ready()  # closing nvidia1 released what was allocated through it, not the rest
    assert dict(counters_for(manager, cg_id).allocated_bytes_by_gpu) == {1: 2 * MiB}
    w.kill()
    wait_for(lambda: dict(counters_for(manager, cg_id).allocated_bytes_by_gpu) == {1: 0})


def test_cuda_uprobes_bytes_frees_oom_and_kill_balance(lab: Lab, manager: ProbeManager) -> None:
    cg, cg_id = lab.cgroup("cuda")
    manager.poll_events(0)  # drain earlier events
    w = lab.spawn(cg, "dlopen", str(lab.lib),
                  "cualloc", "1000000", "3", "cufree", "1",
                  "cualloc", str(2 << 40), "1",          # > fake capacity: CUDA_ERROR_OUT_OF_MEMORY
                  "cupitch", "1000", "10",               # pitch 1024 x 10 rows
                  "cucreate", "65536", "pause")
    w.wait_ready()
    c = counters_for(manager, cg_id)
    assert c.cuda_allocated_bytes == 2 * 1000000 + 1024 * 10 + 65536
    assert (c.cuda_allocations_total, c.cuda_frees_total, c.cuda_oom_total) == (5, 1, 1)
    events = manager.poll_events(1000)
    ooms = [e for e in events if e.type == "oom" and e.tgid == w.pid]
    assert len(ooms) == 1 and ooms[0].size_bytes == 2 << 40 and ooms[0].cgroup_id == cg_id
    assert any(e.type == "new_gpu_process" and e.tgid == w.pid for e in events)
    w.kill()  # SIGKILL without freeing: exit must return everything
    wait_for(lambda: counters_for(manager, cg_id).cuda_allocated_bytes == 0)


def test_launches_counted_per_cgroup(lab: Lab, manager: ProbeManager) -> None:
    cg, cg_id = lab.cgroup("launch")
    w = lab.spawn(cg, "dlopen", str(lab.lib), "culaunch", "700", "cugraph", "20")
    assert w.finish() == 0
    c = counters_for(manager, cg_id)
    assert (c.launches_total, c.graph_launches_total) == (720, 20)


def test_two_cgroups_sharing_one_library_inode_are_attributed_separately(
        lab: Lab, manager: ProbeManager) -> None:
    cg_a, id_a = lab.cgroup("share-a")
    cg_b, id_b = lab.cgroup("share-b")
    a = lab.spawn(cg_a, "dlopen", str(lab.lib), "cualloc", "4096", "3", "open", "0",
                  "rmalloc", "0", "1", "10", "0x40", str(MiB), "21", "pause")
    b = lab.spawn(cg_b, "dlopen", str(lab.lib), "cualloc", "8192", "5", "open", "0",
                  "rmalloc", "0", "1", "10", "0x40", str(5 * MiB), "21", "pause")
    a.wait_ready()
    b.wait_ready()
    assert len({lib.inode_key for lib in manager.attached_libraries()
                if os.stat(lib.path).st_ino == os.stat(lab.lib).st_ino}) == 1
    ca, cb = counters_for(manager, id_a), counters_for(manager, id_b)
    assert (ca.cuda_allocated_bytes, cb.cuda_allocated_bytes) == (3 * 4096, 5 * 8192)
    assert (dict(ca.allocated_bytes_by_gpu)[0], dict(cb.allocated_bytes_by_gpu)[0]) == (MiB, 5 * MiB)
    a.release()
    b.release()
    assert (a.finish(), b.finish()) == (0, 0)


def test_library_copy_at_new_inode_is_attached_after_rescan(lab: Lab, manager: ProbeManager) -> None:
    copy_dir = lab.root / "container-root" / "usr" / "lib"
    copy_dir.mkdir(parents=True)
    copy = copy_dir / "libcuda.so.1"
    shutil.copy(lab.lib, copy)  # a container's own libcuda: same bytes, new inode
    cg, cg_id = lab.cgroup("rescan")
    w = lab.spawn(cg, "dlopen", str(copy), "open", "ctl", "pause", "cualloc", "12345", "2", "pause")
    w.wait_ready()
    inode = (os.stat(copy).st_dev, os.stat(copy).st_ino)
    assert inode not in {lib.inode_key for lib in manager.attached_libraries()}
    assert manager.rescan() == 1  # (without calling read(), which would also have found it)
    assert inode in {lib.inode_key for lib in manager.attached_libraries()}
    assert manager.rescan() == 0  # one attachment per inode
    w.release()
    w.wait_ready()
    assert counters_for(manager, cg_id).cuda_allocated_bytes == 2 * 12345
    w.release()
    assert w.finish() == 0


@contextmanager
def grower_over_limit(lab: Lab, manager: ProbeManager, name: str, limit_bytes: int,
                      action: str) -> Iterator[tuple[int, Workload]]:
    """A cgroup with an in-kernel limit (`action` when it is crossed), the events so far drained,
    and a workload in it that allocates 1000 bytes ten times through libcuda; (the cgroup id,
    the workload). The limit is cleared at the end."""
    cg, cg_id = lab.cgroup(name)
    manager.set_limit(cg_id, limit_bytes, action=action)
    try:
        manager.poll_events(0)
        yield cg_id, lab.spawn(cg, "dlopen", str(lab.lib), "cualloc", "1000", "10", "pause")
    finally:
        manager.clear_limit(cg_id)


def test_over_limit_allocation_is_killed_in_kernel(lab: Lab, manager: ProbeManager) -> None:
    with grower_over_limit(lab, manager, "limit", 5 * 1000, "kill") as (cg_id, w):
        assert w.finish() == -signal.SIGKILL
        events = [e for e in manager.poll_events(1000) if e.tgid == w.pid]
        assert [e.type for e in events if e.type in ("over_limit", "kill")] == ["over_limit", "kill"]
        wait_for(lambda: counters_for(manager, cg_id).cuda_allocated_bytes == 0)
        assert counters_for(manager, cg_id).cuda_allocations_total == 5


def test_over_limit_allocation_is_stopped_in_kernel(lab: Lab, manager: ProbeManager) -> None:
    with grower_over_limit(lab, manager, "limit-stop", 3 * 1000, "stop") as (cg_id, w):

        def stopped() -> bool:
            return Path(f"/proc/{w.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"

        wait_for(stopped)
        events = [e for e in manager.poll_events(1000) if e.tgid == w.pid]
        assert [e.type for e in events if e.type in ("over_limit", "stop")] == ["over_limit", "stop"]
        # stopped at the entry of the 4th allocation: 3 succeeded, the 4th has not happened
        assert counters_for(manager, cg_id).cuda_allocated_bytes == 3 * 1000
        w.kill()
        wait_for(lambda: counters_for(manager, cg_id).cuda_allocated_bytes == 0)


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_100k_leaked_allocations_stay_within_the_bound_and_overflow_is_counted(
        lab: Lab, manager: ProbeManager) -> None:
    manager.sweep()
    before = manager.stats()
    free_slots = RM_BOUND - manager.live_entries()["gw_rm"]
    rss_before = _rss_kib()
    cg, cg_id = lab.cgroup("leak")
    w = lab.spawn(cg, "open", "0", "rmleak", "0", "3", "1000", "100000", "4096", "pause")
    w.wait_ready(timeout_s=120)
    c = counters_for(manager, cg_id)
    assert dict(c.allocated_bytes_by_gpu)[0] == 100000 * 4096  # exact even past the bound
    assert manager.live_entries()["gw_rm"] <= RM_BOUND
    overflow = manager.stats()["rm_alloc_overflow"] - before["rm_alloc_overflow"]
    assert overflow == 100000 - free_slots
    assert _rss_kib() - rss_before < 8 * 1024  # the agent reads counters, not entries
    w.kill()
    wait_for(lambda: dict(counters_for(manager, cg_id).allocated_bytes_by_gpu)[0] == 0)
    manager.sweep()
    assert manager.live_entries()["gw_rm"] == 0


def test_perf_uprobes_count_and_stop_leaves_nothing_attached(lab: Lab) -> None:
    # the fallback for kernels without uprobe_multi links: one perf uprobe per symbol; and
    # the mode without any syscall tracepoint (ioctl group off): CUDA accounting still works
    pm = ProbeManager(ProbeConfig(device_prefix=lab.prefix, libcuda_paths=(str(lab.lib),), uprobe_multi=False,
                                  ioctl=False, scan_all_processes=False))
    pm.start()
    ids = pm.prog_ids()
    assert ids and all(bpfsys.prog_exists(i) for i in ids)
    assert pm.attached_libraries()
    cg, cg_id = lab.cgroup("perf-uprobes")
    w = lab.spawn(cg, "dlopen", str(lab.lib), "cualloc", "4096", "4", "cufree", "1", "pause")
    w.wait_ready()
    c = counters_for(pm, cg_id)
    assert (c.cuda_allocated_bytes, c.cuda_allocations_total, c.cuda_frees_total) == (3 * 4096, 4, 1)
    assert c.ioctl_calls_by_op == ()
    w.kill()
    wait_for(lambda: counters_for(pm, cg_id).cuda_allocated_bytes == 0)
    pm.stop()
    pm.stop()  # idempotent
    wait_for(lambda: not any(bpfsys.prog_exists(i) for i in ids), timeout_s=30.0)
    assert "gw_" not in _uprobe_events()


def _uprobe_events() -> str:
    root = bpfsys.tracefs_root()
    return (root / "uprobe_events").read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "crash-sigkill"])
def test_a_killed_process_holding_probes_leaves_nothing_attached_and_its_rss_is_small(
        lab: Lab, sig: signal.Signals) -> None:
    script = textwrap.dedent(f"""
        import json, sys, time
        from gpuwatch.probes.manager import ProbeConfig, ProbeManager
        pm = ProbeManager(ProbeConfig(device_prefix={lab.prefix!r}, libcuda_paths=({str(lab.lib)!r},),
                                      launch_uprobes=True, scan_all_processes=False))
        pm.start()
        pm.read()
        status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
        print(json.dumps({{"ids": pm.prog_ids(), "bcc": "bcc" in sys.modules,
                          "rss_kib": int(status["VmRSS"].split()[0]),
                          "rss_anon_kib": int(status["RssAnon"].split()[0])}}), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        report = json.loads(proc.stdout.readline())
        ids = report["ids"]
        assert ids and all(bpfsys.prog_exists(i) for i in ids)
        # the agent side never maps BCC/LLVM: the compile ran in a child that has exited
        assert report["bcc"] is False
        assert report["rss_kib"] <= 60 * 1024, report
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == -sig
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_for(lambda: not any(bpfsys.prog_exists(i) for i in ids), timeout_s=30.0)
    assert "gw_" not in _uprobe_events()


def test_trace_streams_per_container_events_as_json(lab: Lab) -> None:
    cg, cg_id = lab.cgroup("trace")
    with gpuwatch_trace("--json", "--device-prefix", lab.prefix, "--libcuda", str(lab.lib), cwd=REPO) as trace:
        w = lab.spawn(cg, "open", "ctl", "open", "0", "rmalloc", "1", "7", "100", "0x40", str(MiB), "21",
                      "rmfree", "1", "7", "100", "00", "dlopen", str(lab.lib), "cualloc", "1000", "2",
                      "cufree", "1", "cualloc", str(2 << 40), "1")
        assert w.finish() == 0
        time.sleep(1.0)  # the trace loop polls every 200 ms
        out = end_trace(trace)
    mine = [json.loads(line) for line in out.splitlines() if json.loads(line)["pid"] == w.pid]
    assert [(e["event"], e["source"], e["size_bytes"]) for e in mine] == [
        ("new_gpu_process", None, 0),
        ("device_open", None, 0), ("device_open", None, 0),
        ("alloc", "ioctl", MiB), ("free", "ioctl", MiB),
        ("alloc", "cuda", 1000), ("alloc", "cuda", 1000), ("free", "cuda", 1000),
        ("oom", "cuda", 2 << 40),
        ("process_exit", None, 0),
    ]
    assert {e["cgroup_id"] for e in mine} == {cg_id}
    assert all(e["container"]["cgroup_path"].endswith("/trace") for e in mine)
    assert [e["device_kind"] for e in mine if e["event"] == "device_open"] == ["ctl", "gpu"]


def test_pinned_counters_survive_an_agent_restart(lab: Lab) -> None:
    pin_dir = f"/sys/fs/bpf/gpuwatch-probes-test-{os.getpid()}"
    config = ProbeConfig(device_prefix=lab.prefix, libcuda_paths=(str(lab.lib),), pin_dir=pin_dir,
                         scan_all_processes=False)
    cg, cg_id = lab.cgroup("pinned")
    first = ProbeManager(config)
    first.start()
    try:
        stays = lab.spawn(cg, "open", "0", "rmalloc", "0", "5", "50", "0x40", str(2 * MiB), "21",
                          "ioctl", "0", "0x2a", "3", "pause")
        leaves = lab.spawn(cg, "open", "1", "rmalloc", "0", "6", "60", "0x40", str(MiB), "21", "pause")
        stays.wait_ready()
        leaves.wait_ready()
        before = counters_for(first, cg_id)
        assert dict(before.allocated_bytes_by_gpu) == {0: 2 * MiB, 1: MiB}
    finally:
        first.stop()  # the agent goes away; the pinned maps stay
    leaves.kill()  # exits while no probe runs
    second = ProbeManager(config)
    second.start()
    try:
        assert second.adopted is not None and second.adopted.released_tgids == 1
        after = counters_for(second, cg_id)
        assert dict(after.ioctl_calls_by_op) == dict(before.ioctl_calls_by_op)
        assert dict(after.allocated_bytes_by_gpu) == {0: 2 * MiB, 1: 0}
        stays.release()  # its exit is now seen by the new programs, with the adopted state
        assert stays.finish() == 0
        wait_for(lambda: dict(counters_for(second, cg_id).allocated_bytes_by_gpu) == {0: 0, 1: 0})
    finally:
        second.stop()
        second.unpin()
    assert not os.path.exists(pin_dir)


def test_exec_releases_the_old_image_and_the_new_image_is_counted_afresh(
        lab: Lab, manager: ProbeManager) -> None:
    cg, cg_id = lab.cgroup("exec")
    w = lab.spawn(cg, "open", "0", "rmalloc", "0", "3", "30", "0x40", str(MiB), "21",
                  "dlopen", str(lab.lib), "cualloc", "5000", "2", "pause",
                  "exec", "pause",
                  "open", "1", "rmalloc", "0", "3", "30", "0x40", str(4 * MiB), "21", "pause")
    w.wait_ready()
    c = counters_for(manager, cg_id)
    assert (dict(c.allocated_bytes_by_gpu), c.cuda_allocated_bytes) == ({0: MiB}, 10000)
    w.release()
    w.wait_ready()  # same pid, new image: the device fd closed on exec, CUDA state is gone
    c = counters_for(manager, cg_id)
    assert (dict(c.allocated_bytes_by_gpu), c.cuda_allocated_bytes) == ({0: 0}, 0)
    w.release()
    w.wait_ready()
    c = counters_for(manager, cg_id)
    assert dict(c.allocated_bytes_by_gpu) == {0: 0, 1: 4 * MiB}
    assert dict(c.ioctl_calls_by_op)["rm_alloc"] == 2
    w.release()
    assert w.finish() == 0
    wait_for(lambda: dict(counters_for(manager, cg_id).allocated_bytes_by_gpu) == {0: 0, 1: 0})


def test_read_attaches_the_libcuda_copy_of_a_new_gpu_process(lab: Lab, manager: ProbeManager) -> None:
    copy_dir = lab.root / "other-container-root" / "usr" / "lib64"
    copy_dir.mkdir(parents=True)
    copy = copy_dir / "libcuda.so.1"
    shutil.copy(lab.lib, copy)
    cg, cg_id = lab.cgroup("auto-attach")
    # like CUDA: load the library, open the device (cuInit), then allocate
    w = lab.spawn(cg, "dlopen", str(copy), "open", "ctl", "pause", "cualloc", "777", "3", "pause")
    w.wait_ready()
    inode = (os.stat(copy).st_dev, os.stat(copy).st_ino)
    manager.read()  # the sampler's once-per-interval read
    assert inode in {lib.inode_key for lib in manager.attached_libraries()}
    w.release()
    w.wait_ready()
    assert counters_for(manager, cg_id).cuda_allocated_bytes == 3 * 777
    w.release()
    assert w.finish() == 0


def test_kernel_refusal_is_reported_as_probes_unavailable(bcc_required: None) -> None:
    from gpuwatch.core.errors import ProbesUnavailable
    from gpuwatch.probes import bcc_loader

    with pytest.raises(ProbesUnavailable) as info:  # a hash map with 0 entries is refused
        bcc_loader.load_programs(bcc_loader.LoadRequest(extra_cflags=("-DGW_MAX_FDS=0",)))
    assert "BPF probes off: BCC could not build/load bpf/" in str(info.value)
    assert info.value.fix


def test_batch_and_key_by_key_map_reads_agree(lab: Lab, manager: ProbeManager) -> None:
    cg, _ = lab.cgroup("batch")
    w = lab.spawn(cg, "open", "ctl", "ioctl", "0", "0x2a", "3", "ioctl", "0", "0x4e", "2",
                  "rmalloc", "0", "1", "2", "0x40", "4096", "21")
    assert w.finish() == 0
    for name in ("gw_ioctls", "gw_mem", "gw_config"):  # per-CPU hash, hash, array
        fd = manager.map_fd(name)
        batch = bpfsys.BpfMap(fd, name)
        batched = dict(batch.items())
        assert batch._batch_ok, f"{name}: batch lookup unexpectedly unavailable"
        one_by_one = bpfsys.BpfMap(fd, name)
        one_by_one._batch_ok = False
        assert batched == dict(one_by_one.items()) and batched


def test_counters_of_removed_cgroups_are_dropped(lab: Lab, manager: ProbeManager) -> None:
    gone, gone_id = lab.cgroup("gc-removed")
    kept, kept_id = lab.cgroup("gc-kept")
    for cg in (gone, kept):
        w = lab.spawn(cg, "open", "ctl", "ioctl", "0", "0x2a", "2", "dlopen", str(lab.lib), "cualloc", "100", "1")
        assert w.finish() == 0
    assert {gone_id, kept_id} <= {c.cgroup_id for c in manager.read()}
    wait_for(lambda: not (gone / "cgroup.procs").read_text().strip())
    gone.rmdir()
    lab.cgroups.remove(gone)
    assert manager.gc_cgroups() >= 2  # its ioctl and memory counters
    ids = {c.cgroup_id for c in manager.read()}
    assert gone_id not in ids and kept_id in ids
