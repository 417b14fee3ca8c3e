"""ProbeManager: load, attach, read and detach gpuwatch's kernel probes.

Lifecycle: `start()` has bcc_loader compile and load bpf/ in a short-lived child that passes
the map/program fds back; the manager writes the configuration map, attaches the syscall and
sched tracepoints with perf events and the libcuda uprobes per library inode. `read()` reads
the per-cgroup maps once per interval into ProbeCounters; `poll_events()` drains the ring
buffer of rare events. `stop()` closes every fd (= detach and unload); it is idempotent and
also runs at interpreter exit. If the process dies any other way (SIGTERM default action,
SIGKILL, crash) the kernel closes the fds and the probes go with it: nothing is left
attached, by construction (uprobes go through the perf uprobe PMU, not uprobe_events).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.util
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from gpuwatch.errors import ProbesUnavailable
from gpuwatch.model import ProbeCounters
from gpuwatch.probes import bcc_loader, bpfsys, layout, pinning
from gpuwatch.probes.cgroupgc import cgroup2_mount, live_cgroup_ids
from gpuwatch.probes.elf import ElfError, symbol_offsets
from gpuwatch.probes.events import ProbeEvent, device_index, ioctl_op_name
from gpuwatch.probes.libcuda import LibraryCopy, discover
from gpuwatch.probes.ringbuf import RingBuffer

# libcuda symbol -> (program, also attach the return probe)
ALLOC_SYMBOLS: dict[str, tuple[str, bool]] = {
    "cuMemAlloc_v2": ("gw_cu_alloc", True),
    "cuMemAllocManaged": ("gw_cu_alloc", True),
    "cuMemAllocAsync": ("gw_cu_alloc", True),
    "cuMemAllocPitch_v2": ("gw_cu_alloc_pitch", True),
    "cuMemCreate": ("gw_cu_create", True),
    "cuMemFree_v2": ("gw_cu_free", False),
    "cuMemFreeAsync": ("gw_cu_free", False),
    "cuMemRelease": ("gw_cu_free", False),
}
LAUNCH_SYMBOLS: dict[str, tuple[str, bool]] = {
    "cuLaunchKernel": ("gw_cu_launch", False),
    "cuLaunchKernelEx": ("gw_cu_launch", False),
    "cuGraphLaunch": ("gw_cu_graph_launch", False),
}
ALLOC_RET_PROG = "gw_cu_alloc_ret"

# (program, tracepoint category, tracepoint name, group)
TRACEPOINTS: tuple[tuple[str, str, str, str], ...] = (
    ("gw_sched_exit", "sched", "sched_process_exit", "core"),
    ("gw_sched_exec", "sched", "sched_process_exec", "core"),
    ("gw_enter_openat", "syscalls", "sys_enter_openat", "ioctl"),
    ("gw_exit_openat", "syscalls", "sys_exit_openat", "ioctl"),
    ("gw_enter_close", "syscalls", "sys_enter_close", "ioctl"),
    ("gw_enter_ioctl", "syscalls", "sys_enter_ioctl", "ioctl"),
    ("gw_exit_ioctl", "syscalls", "sys_exit_ioctl", "ioctl"),
)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[Concatenate[ProbeManager, _P], _R]) -> Callable[Concatenate[ProbeManager, _P], _R]:
    """Run a ProbeManager method under its lock (map fds are used and closed under it)."""

    @functools.wraps(method)
    def wrapper(self: ProbeManager, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


ACTIONS = {"event": layout.GW_ACTION_EVENT, "kill": layout.GW_ACTION_KILL, "stop": layout.GW_ACTION_STOP}


@dataclass(frozen=True)
class ProbeConfig:
    """Which probe groups run and where they look. Every group is individually switchable."""

    device_prefix: str = "/dev/nvidia"
    libcuda_paths: tuple[str, ...] = ()  # () = auto (ld cache + process maps + container roots)
    ioctl: bool = True  # device fds + ioctls (syscall tracepoints: a cost on every syscall)
    alloc_uprobes: bool = True
    launch_uprobes: bool = False  # opt-in: a uprobe per launch costs 0.2-17 us per call
    pin_dir: str | None = None  # pin the maps here (bpffs): counters survive an agent restart
    verbose_events: bool = False  # per open/alloc/free events: `gpuwatch trace` only
    uprobe_multi: bool = True  # one BPF link per program and file where the kernel allows
    max_rm_allocs: int = 65536
    max_cuda_allocs: int = 65536
    sweep_interval_s: float = 5.0
    full_rescan_interval_s: float = 60.0  # read() also attaches libcuda of new GPU processes
    scan_all_processes: bool = True  # full rescans look at every process, not only GPU ones
    cgroup_gc_interval_s: float = 60.0  # drop counters of removed cgroups this often
    cgroup_root: str | None = None  # cgroup v2 mount (None: from /proc/self/mounts)
    proc_root: str = "/proc"


@dataclass
class _Attachment:
    library: LibraryCopy
    fds: list[int] = field(default_factory=list)
    symbols: tuple[str, ...] = ()


def preflight(config: ProbeConfig) -> None:
    """Raise ProbesUnavailable naming exactly what is off and the fix."""
    lost = "per-container ioctl counts, decoded allocations and CUDA allocation/launch counters are off; " \
           "NVML attribution continues"
    if os.geteuid() != 0:
        raise ProbesUnavailable(f"BPF probes off: not running as root; {lost}",
                                fix="run the agent as root (or with CAP_BPF+CAP_PERFMON+CAP_SYS_ADMIN)")
    if importlib.util.find_spec("bcc") is None:
        raise ProbesUnavailable(f"BPF probes off: BCC (python3-bpfcc) is not importable; {lost}",
                                fix="apt-get install python3-bpfcc; use a venv made with "
                                    "--system-site-packages (never `pip install bcc`)")
    if len(config.device_prefix.encode()) not in range(1, layout.GW_PREFIX_MAX + 1):
        raise ProbesUnavailable(f"device prefix {config.device_prefix!r} must be "
                                f"1..{layout.GW_PREFIX_MAX} bytes", fix="pass a shorter --device-prefix")
    bcc_loader.kernel_headers_env()
    try:
        bpfsys.ensure_tracefs()
    except OSError as err:
        raise ProbesUnavailable(f"BPF probes off: tracefs unavailable ({err}); {lost}",
                                fix="mount -t tracefs tracefs /sys/kernel/tracing") from err


class ProbeManager:
    """Owns the loaded programs, maps and attachments of one agent."""

    def __init__(self, config: ProbeConfig | None = None) -> None:
        self.config = config or ProbeConfig()
        self._objs: bcc_loader.LoadedObjects | None = None
        self._maps: dict[str, bpfsys.BpfMap] = {}
        self._tp_fds: list[int] = []
        self._libs: dict[tuple[int, int], _Attachment] = {}
        self._ring: RingBuffer | None = None
        self.adopted: pinning.AdoptReport | None = None
        self._last_exits = -1
        self._scanned_tgids: set[int] = set()
        self._last_gc = time.monotonic()
        self._last_full_scan = 0.0
        self._last_sweep = 0.0
        self.load_s = 0.0
        self.attach_s = 0.0
        self.notes: list[str] = []
        # read() (sampler thread), poll_events/set_limit (enforcer), rescan and stop may run
        # on different threads: map handles are only used and closed under this lock
        self._lock = threading.RLock()

    # ---- lifecycle ------------------------------------------------------------------------
    @_locked
    def start(self) -> None:
        if self._objs is not None:
            return
        cfg = self.config
        preflight(cfg)
        t0 = time.monotonic()
        request = bcc_loader.LoadRequest(ioctl=cfg.ioctl, alloc_uprobes=cfg.alloc_uprobes,
                                         launch_uprobes=cfg.launch_uprobes,
                                         verbose_events=cfg.verbose_events,
                                         max_rm_allocs=cfg.max_rm_allocs,
                                         max_cuda_allocs=cfg.max_cuda_allocs)
        self._objs = bcc_loader.load_programs(request)
        self.notes.extend(self._objs.notes)
        self.load_s = time.monotonic() - t0
        atexit.register(self.stop)
        try:
            t1 = time.monotonic()
            self._maps = {name: bpfsys.BpfMap(fd, name) for name, fd in self._objs.maps.items()}
            self._write_config()
            if cfg.pin_dir:  # before attaching: adopted counters are not raced by new events
                self.adopted = pinning.adopt_and_pin(self._maps, cfg.pin_dir, Path(cfg.proc_root))
            self._ring = RingBuffer(self._objs.maps["gw_events"])
            for prog, category, name, group in TRACEPOINTS:
                if group == "ioctl" and not cfg.ioctl:
                    continue
                self._tp_fds.append(bpfsys.attach_tracepoint(self._objs.progs[prog], category, name))
            if cfg.alloc_uprobes or cfg.launch_uprobes:
                self.rescan()
            self.attach_s = time.monotonic() - t1
        except ProbesUnavailable:
            self.stop()
            raise
        except (OSError, KeyError) as err:
            self.stop()
            raise ProbesUnavailable(f"BPF probes off: the kernel refused to attach: {err}",
                                    fix="run `gpuwatch doctor` (tracepoints and uprobes must work)") from err

    def _write_config(self) -> None:
        prefix = self.config.device_prefix.encode()
        conf = layout.GwConfig(prefix_len=len(prefix), flags=0, prefix=prefix)
        self._maps["gw_config"].update(struct.pack("<I", 0), bytes(conf))

    @_locked
    def unpin(self) -> None:
        """Remove the pinned maps (with pin_dir, stop() keeps them for the next start)."""
        if self.config.pin_dir:
            pinning.unpin(self.config.pin_dir)

    @_locked
    def stop(self) -> None:
        """Detach everything and unload (close every fd). Safe to call any number of times."""
        for att in self._libs.values():
            _close_all(att.fds)
        self._libs.clear()
        _close_all(self._tp_fds)
        self._tp_fds.clear()
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        self._maps.clear()
        if self._objs is not None:
            self._objs.close()
            self._objs = None
        atexit.unregister(self.stop)

    @property
    def running(self) -> bool:
        return self._objs is not None

    def __enter__(self) -> ProbeManager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- uprobes ------------------------------------------------------------------------------
    def _symbol_table(self) -> dict[str, tuple[str, bool]]:
        table: dict[str, tuple[str, bool]] = {}
        if self.config.alloc_uprobes:
            table.update(ALLOC_SYMBOLS)
        if self.config.launch_uprobes:
            table.update(LAUNCH_SYMBOLS)
        return table

    @_locked
    def rescan(self, pids: Iterable[int] | None = None) -> int:
        """Attach uprobes to libcuda copies (inodes) not attached yet; returns how many.

        Without `pids` (a full rescan): the configured paths (or the ld cache), the maps of
        GPU processes (of every process on the first scan, to find copies mapped before we
        started) and the root filesystems of every process (scan_all_processes) or of GPU
        processes. With `pids`: only those processes (cheap; what read() does for GPU
        processes it has not looked at yet)."""
        if self._objs is None or not (self.config.alloc_uprobes or self.config.launch_uprobes):
            return 0
        table = self._symbol_table()
        added = 0
        proc_root = Path(self.config.proc_root)
        if pids is not None:
            found = discover((), proc_root, pids=pids, use_ld_cache=False)
        else:
            scan_all = self.config.scan_all_processes
            first = self._last_full_scan == 0.0
            self._last_full_scan = time.monotonic()
            found = discover(self.config.libcuda_paths, proc_root,
                             pids=None if (scan_all and first) else sorted(self._gpu_tgids()),
                             roots_of_all=scan_all)
        for lib in found:
            if lib.inode_key in self._libs:
                continue
            try:
                offsets = symbol_offsets(lib.path, table)
            except (OSError, ElfError, ValueError) as err:
                self.notes.append(f"libcuda {lib.path}: not attached ({err})")
                continue
            att = _Attachment(library=lib, symbols=tuple(sorted(offsets)))
            try:
                self._attach_library(att, table, offsets)
            except OSError as err:
                _close_all(att.fds)
                self.notes.append(f"libcuda {lib.path}: uprobe refused ({err})")
                continue
            self._libs[lib.inode_key] = att
            added += 1
        return added

    def _attach_library(self, att: _Attachment, table: dict[str, tuple[str, bool]],
                        offsets: dict[str, int]) -> None:
        """One uprobe_multi link per (program, entry/return) for this file when the kernel
        has them (attach and detach in ms), else one perf uprobe per symbol."""
        assert self._objs is not None
        progs = self._objs.progs
        wanted: dict[tuple[str, bool], list[int]] = {}
        for sym, offset in offsets.items():
            prog, with_ret = table[sym]
            wanted.setdefault((prog, False), []).append(offset)
            if with_ret:
                wanted.setdefault((ALLOC_RET_PROG, True), []).append(offset)
        path = att.library.path
        for (prog, ret), offs in wanted.items():
            multi = progs.get(prog + bcc_loader.MULTI_SUFFIX) if self.config.uprobe_multi else None
            if multi is not None:
                try:
                    att.fds.append(bpfsys.attach_uprobe_multi(multi, path, offs, retprobe=ret))
                    continue
                except OSError as err:
                    self.notes.append(f"uprobe_multi refused for {path} ({err}); using perf uprobes")
            att.fds.extend(bpfsys.attach_uprobe(progs[prog], path, off, retprobe=ret) for off in offs)

    def attached_libraries(self) -> tuple[LibraryCopy, ...]:
        return tuple(att.library for att in self._libs.values())

    def attached_symbols(self, lib: LibraryCopy) -> tuple[str, ...]:
        att = self._libs.get(lib.inode_key)
        return att.symbols if att else ()

    def prog_ids(self) -> tuple[int, ...]:
        """Kernel ids of our loaded programs (to check later that they are gone)."""
        if self._objs is None:
            return ()
        return tuple(bpfsys.prog_id(fd) for fd in self._objs.progs.values())

    # ---- reading --------------------------------------------------------------------------
    def _map(self, name: str) -> bpfsys.BpfMap:
        if name not in self._maps:
            raise ProbesUnavailable("probes are not started", fix="call ProbeManager.start() first")
        return self._maps[name]

    @_locked
    def map_fd(self, name: str) -> int:
        """File descriptor of one of our maps (for tools and tests; owned by the manager)."""
        return self._map(name).fd

    @_locked
    def stats(self) -> dict[str, int]:
        """Kernel-side overflow/drop counters (map full, ring full, unmatched frees...)."""
        m = self._map("gw_stats")
        out: dict[str, int] = {}
        for idx, name in enumerate(layout.STAT_NAMES):
            raw = m.lookup(struct.pack("<I", idx))
            out[name] = struct.unpack("<Q", raw[:8])[0] if raw else 0
        return out

    def _gpu_tgids(self) -> set[int]:
        """Processes with GPU state (opened a device node or called libcuda)."""
        return {struct.unpack("<I", k)[0] for k in self._map("gw_tgids")}

    def _attach_new_gpu_processes(self) -> None:
        """Look at the libcuda of GPU processes not seen yet (a container's own copy gets its
        uprobes within one interval of its first device open); full rescan now and then."""
        if not (self.config.alloc_uprobes or self.config.launch_uprobes):
            return
        if time.monotonic() - self._last_full_scan >= self.config.full_rescan_interval_s:
            self.rescan()
            return
        current = self._gpu_tgids()
        new = current - self._scanned_tgids
        self._scanned_tgids = current
        if new:
            self.rescan(pids=sorted(new))

    @_locked
    def read(self) -> tuple[ProbeCounters, ...]:
        """One read of every per-cgroup map -> one ProbeCounters per cgroup seen (and, as
        housekeeping, sweep stale entries and attach uprobes to new libcuda copies)."""
        self._maybe_sweep()
        self._attach_new_gpu_processes()
        acc: dict[int, _CgroupAcc] = {}

        def get(cg: int) -> _CgroupAcc:
            if cg not in acc:
                acc[cg] = _CgroupAcc()
            return acc[cg]

        ioctls = self._map("gw_ioctls")
        for key, value in ioctls.items():
            k = layout.GwIoctlKey.from_buffer_copy(key)
            a = get(k.cgroup_id)
            for slot in ioctls.percpu_slots(value):
                v = layout.GwIoctlVal.from_buffer_copy(slot)
                a.calls[k.nr] = a.calls.get(k.nr, 0) + v.calls
                a.failures[k.nr] = a.failures.get(k.nr, 0) + v.failures
        for key, value in self._map("gw_mem").items():
            mk = layout.GwMemKey.from_buffer_copy(key)
            mv = layout.GwMemVal.from_buffer_copy(value)
            a = get(mk.cgroup_id)
            if mk.device == layout.GW_DEV_CUDA:
                a.cuda = mv
            else:
                dev = device_index(mk.device)
                a.rm[-1 if dev is None else dev] = mv
        launches = self._maps.get("gw_launches")
        if launches is not None:
            for key, value in launches.items():
                a = get(struct.unpack("<Q", key)[0])
                for slot in launches.percpu_slots(value):
                    lv = layout.GwLaunchVal.from_buffer_copy(slot)
                    a.kernel_launches += lv.kernel_launches
                    a.graph_launches += lv.graph_launches
        return tuple(a.counters(cg, self.config) for cg, a in sorted(acc.items()))

    def poll_events(self, timeout_ms: int) -> list[ProbeEvent]:
        """Rare events (new GPU process, OOM return, over-limit allocation, kill, stop).
        Waits without holding the manager's lock, so read() and stop() are never blocked."""
        ring = self._ring
        if ring is None:
            raise ProbesUnavailable("probes are not started", fix="call ProbeManager.start() first")
        try:
            ring.wait(timeout_ms)
        except ValueError:  # stop() closed the ring buffer while we waited
            return []
        out: list[ProbeEvent] = []
        with self._lock:
            if self._ring is ring:
                ring.consume(lambda raw: out.append(ProbeEvent.from_record(raw)))
        return out

    # ---- limits (kill/stop at the allocation, used by the enforcer) ---------------------------
    @_locked
    def set_limit(self, cgroup_id: int, limit_bytes: int, action: str = "event") -> None:
        """CUDA-API live-bytes limit for a cgroup: over-limit allocations raise an event and,
        with action="kill", get SIGKILL (action="stop": SIGSTOP, the enforcer decides what
        next) from the kernel before the allocation proceeds."""
        if action not in ACTIONS:
            raise ValueError(f"unknown limit action {action!r}; use one of {', '.join(ACTIONS)}")
        lim = layout.GwLimit(limit_bytes=limit_bytes, action=ACTIONS[action])
        self._map("gw_limits").update(struct.pack("<Q", cgroup_id), bytes(lim))

    @_locked
    def clear_limit(self, cgroup_id: int) -> None:
        self._map("gw_limits").delete(struct.pack("<Q", cgroup_id))

    # ---- housekeeping ---------------------------------------------------------------------
    def _maybe_sweep(self) -> None:
        exits = self.stats()["exits"]
        now = time.monotonic()
        if exits != self._last_exits and now - self._last_sweep >= self.config.sweep_interval_s:
            self.sweep()
            self._last_exits = exits
            self._last_sweep = now
        if now - self._last_gc >= self.config.cgroup_gc_interval_s:
            self.gc_cgroups()
            self._last_gc = now

    @_locked
    def gc_cgroups(self) -> int:
        """Drop the counters of cgroups that no longer exist (and hold no live process
        state), so the bounded per-cgroup maps never fill up with removed containers.
        Returns the number of map entries removed."""
        root = Path(self.config.cgroup_root) if self.config.cgroup_root else cgroup2_mount()
        if root is None:
            return 0
        maps = [(self._map("gw_ioctls"), 0), (self._map("gw_mem"), 0), (self._map("gw_limits"), 0)]
        if "gw_launches" in self._maps:
            maps.append((self._maps["gw_launches"], 0))
        # keys first, then the tree: a cgroup created in between has no key in our list
        keyed = [(m, key, struct.unpack_from("<Q", key, off)[0]) for m, off in maps for key in list(m.keys())]
        held = {layout.GwTgidState.from_buffer_copy(v).cgroup_id for _, v in self._map("gw_tgids").items()}
        alive = live_cgroup_ids(root) | held
        return sum(m.delete(key) for m, key, cg in keyed if cg not in alive)

    @_locked
    def sweep(self) -> int:
        """Delete fd/allocation entries left by exited processes (generation mismatch).
        Their bytes were already subtracted in the kernel at exit/close; this only frees map
        slots. Returns the number of entries removed."""
        gens: dict[int, int] = {}
        for key, value in self._map("gw_tgids").items():
            gens[struct.unpack("<I", key)[0]] = layout.GwTgidState.from_buffer_copy(value).gen
        removed = 0
        fd_gens: dict[tuple[int, int], int] = {}
        fds = self._map("gw_fds")
        for key, value in fds.items():
            fk = layout.GwFdKey.from_buffer_copy(key)
            fv = layout.GwFdVal.from_buffer_copy(value)
            if gens.get(fk.tgid) != fv.tgid_gen:
                removed += fds.delete(key)
            else:
                fd_gens[(fk.tgid, fk.fd)] = fv.fd_gen
        removed += _sweep(self._map("gw_rm"), layout.GwRmKey, layout.GwRmVal,
                          lambda k, v: gens.get(k.tgid) == v.tgid_gen
                          and fd_gens.get((k.tgid, v.fd)) == v.fd_gen)
        removed += _sweep(self._map("gw_cuda"), layout.GwCudaKey, layout.GwCudaVal,
                          lambda k, v: gens.get(k.tgid) == v.tgid_gen)
        removed += _sweep(self._map("gw_devh"), layout.GwRmKey, layout.GwDevhVal,
                          lambda k, v: gens.get(k.tgid) == v.tgid_gen)
        return removed

    @_locked
    def live_entries(self) -> dict[str, int]:
        """Current number of entries in the bounded per-process maps."""
        return {name: len(self._map(name)) for name in ("gw_tgids", "gw_fds", "gw_rm", "gw_cuda", "gw_devh")}


class _CgroupAcc:
    def __init__(self) -> None:
        self.calls: dict[int, int] = {}
        self.failures: dict[int, int] = {}
        self.rm: dict[int, layout.GwMemVal] = {}
        self.cuda: layout.GwMemVal | None = None
        self.kernel_launches = 0
        self.graph_launches = 0

    def counters(self, cgroup_id: int, config: ProbeConfig) -> ProbeCounters:
        cuda = self.cuda
        return ProbeCounters(
            cgroup_id=cgroup_id,
            ioctl_calls_by_op=tuple(sorted((ioctl_op_name(nr), n) for nr, n in self.calls.items())),
            ioctl_failures_total=sum(self.failures.values()),
            ioctl_failures_by_op=tuple(sorted((ioctl_op_name(nr), n)
                                              for nr, n in self.failures.items() if n)),
            allocated_bytes_by_gpu=tuple(sorted((dev, v.live_bytes) for dev, v in self.rm.items())),
            allocations_total=sum(v.allocs for v in self.rm.values()),
            frees_total=sum(v.frees for v in self.rm.values()),
            allocation_failures_total=sum(v.failures for v in self.rm.values())
            + (cuda.failures if cuda else 0),
            launches_total=self.kernel_launches + self.graph_launches if config.launch_uprobes else None,
            graph_launches_total=self.graph_launches if config.launch_uprobes else None,
            cuda_allocated_bytes=(cuda.live_bytes if cuda else 0) if config.alloc_uprobes else None,
            cuda_allocations_total=cuda.allocs if cuda else 0,
            cuda_frees_total=cuda.frees if cuda else 0,
            cuda_oom_total=cuda.failures if cuda else 0,
        )


def _sweep(m: bpfsys.BpfMap, key_t: type[ctypes.Structure], val_t: type[ctypes.Structure],
           keep: Callable[[Any, Any], bool]) -> int:
    removed = 0
    for key, value in m.items():
        if not keep(key_t.from_buffer_copy(key), val_t.from_buffer_copy(value)):
            removed += m.delete(key)
    return removed


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            continue  # already closed
