"""ProbeManager: load, attach, read and detach gpuwatch's kernel probes.

Lifecycle: `start()` has bcc_loader compile and load bpf/ in a short-lived child that passes
the map/program fds back; the manager writes the configuration map, attaches the syscall and
sched tracepoints with perf events, then seeds the device fds that running processes opened
before (fdseed.py: attach first, so nothing opened in between is lost), then attaches the
libcuda uprobes per library inode. read() seeds again every fd_seed_interval_s. `read()` reads
the per-cgroup maps once per interval into ProbeCounters; `poll_events()` drains the ring
buffer of rare events. `stop()` closes every fd (= detach and unload); it is idempotent and
also runs at interpreter exit. If the process dies any other way (SIGTERM default action,
SIGKILL, crash) the kernel closes the fds and the probes go with it: nothing is left
attached, by construction (uprobes go through the perf uprobe PMU, not uprobe_events).
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

from gpuwatch.containers.cgroupfs import CgroupMounts, discover_mounts
from gpuwatch.core.errors import ProbesUnavailable
from gpuwatch.core.model import ProbeCounters, ProcessProbe
from gpuwatch.probes import bcc_loader, bpfsys, fdseed, housekeeping, layout, pinning, uprobes
from gpuwatch.probes.counters import read_counters, read_process_counters, read_uvm_ioctls
from gpuwatch.probes.elf import ElfError, symbol_offsets
from gpuwatch.probes.kernel_events import KernelEvent
from gpuwatch.probes.libcuda import LibraryCopy, discover
from gpuwatch.probes.ringbuf import RingBuffer

# (program, tracepoint category, tracepoint name, group)
TRACEPOINTS: tuple[tuple[str, str, str, str], ...] = (
    ("gw_sched_exit", "sched", "sched_process_exit", "core"),
    ("gw_sched_exec", "sched", "sched_process_exec", "core"),
    ("gw_enter_openat", "syscalls", "sys_enter_openat", "ioctl"),
    ("gw_exit_openat", "syscalls", "sys_exit_openat", "ioctl"),
    ("gw_enter_close", "syscalls", "sys_enter_close", "ioctl"),
    ("gw_enter_ioctl", "syscalls", "sys_enter_ioctl", "ioctl"),
    ("gw_exit_ioctl", "syscalls", "sys_exit_ioctl", "ioctl"),
    # device fds a process gets without an open (bpf/inherit.bpf.c)
    ("gw_enter_dup", "syscalls", "sys_enter_dup", "ioctl"),
    ("gw_enter_dup2", "syscalls", "sys_enter_dup2", "ioctl"),
    ("gw_enter_dup2", "syscalls", "sys_enter_dup3", "ioctl"),
    ("gw_enter_fcntl", "syscalls", "sys_enter_fcntl", "ioctl"),
    ("gw_exit_dup", "syscalls", "sys_exit_dup", "ioctl"),
    ("gw_exit_dup", "syscalls", "sys_exit_dup2", "ioctl"),
    ("gw_exit_dup", "syscalls", "sys_exit_dup3", "ioctl"),
    ("gw_exit_dup", "syscalls", "sys_exit_fcntl", "ioctl"),
    ("gw_task_newtask", "task", "task_newtask", "ioctl"),
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
    cgroup_root: str | None = None  # cgroup v2 mount (None: from /proc/self/mountinfo)
    proc_root: str = "/proc"
    max_fds: int = 8192  # tracked (tgid, fd) device descriptors (gw_fds bound)
    # device fds opened before the probes attached are seeded from /proc at start and again
    # this often (catches opens in flight during the attach and fds beyond the fork copy);
    # 0: at start only
    fd_seed_interval_s: float = 30.0


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
        self._last_seed = 0.0
        self._mounts: CgroupMounts | None = None
        self.seed_totals = fdseed.SeedReport()
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
                                         max_cuda_allocs=cfg.max_cuda_allocs,
                                         max_fds=cfg.max_fds)
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
            if cfg.ioctl:  # after attaching: an fd opened from now on is seen by the tracepoints
                self.seed_fds()
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
            bpfsys.close_all(att.fds)
        self._libs.clear()
        bpfsys.close_all(self._tp_fds)
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
        return uprobes.symbol_table(self.config.alloc_uprobes, self.config.launch_uprobes)

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
                att.fds.extend(uprobes.attach_library(self._objs.progs, lib.path, table, offsets,
                                                      self.config.uprobe_multi, self.notes))
            except OSError as err:
                bpfsys.close_all(att.fds)
                self.notes.append(f"libcuda {lib.path}: uprobe refused ({err})")
                continue
            self._libs[lib.inode_key] = att
            added += 1
        return added

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
        # seeding from /proc happens in user space: what did not fit is counted here
        out["fd_seed_overflow"] = self.seed_totals.fd_overflow
        out["fd_seed_tgid_overflow"] = self.seed_totals.tgid_overflow
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
        self._maybe_seed()
        self._attach_new_gpu_processes()
        return read_counters(self._maps, launches_on=self.config.launch_uprobes,
                             cuda_on=self.config.alloc_uprobes)

    @_locked
    def read_processes(self) -> tuple[ProcessProbe, ...]:
        """Live bytes per GPU process (gw_tgids): the sampler joins them to containers one
        process at a time where a cgroup's counters belong to several (hybrid hosts)."""
        return read_process_counters(self._maps)

    @_locked
    def uvm_ioctls(self) -> dict[tuple[int, int], tuple[int, int]]:
        """nvidia-uvm ioctls per (cgroup id, bare ioctl number) -> (calls, failures): counted
        apart from the RM escapes (their numbers collide); managed memory is not RM bytes."""
        return read_uvm_ioctls(self._maps)

    @_locked
    def gpu_mapping(self) -> dict[str, dict[int, int]]:
        """What the probes learned host-wide from the driver's answers: gpu_id -> minor
        (CARD_INFO) and RM device instance -> gpu_id (GET_ID_INFO(_V2))."""
        def read(name: str) -> dict[int, int]:
            return {struct.unpack("<I", k)[0]: struct.unpack("<I", v[:4])[0] for k, v in self._map(name).items()}
        return {"gpu_id_to_minor": read("gw_gpu_minor"), "instance_to_gpu_id": read("gw_gpu_instance")}

    def poll_events(self, timeout_ms: int) -> list[KernelEvent]:
        """Rare events (new GPU process, OOM return, over-limit allocation, kill, stop, GPU process
        exit or exec).
        Waits without holding the manager's lock, so read() and stop() are never blocked."""
        ring = self._ring
        if ring is None:
            raise ProbesUnavailable("probes are not started", fix="call ProbeManager.start() first")
        try:
            ring.wait(timeout_ms)
        except ValueError:  # stop() closed the ring buffer while we waited
            return []
        out: list[KernelEvent] = []
        with self._lock:
            if self._ring is ring:
                ring.consume(lambda raw: out.append(KernelEvent.from_record(raw)))
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

    @_locked
    def limit_of(self, cgroup_id: int) -> tuple[int, str] | None:
        """The cgroup's entry in the kernel limit map as (limit_bytes, action); None: no
        entry, so the kernel does nothing at its allocations."""
        raw = self._map("gw_limits").lookup(struct.pack("<Q", cgroup_id))
        if raw is None:
            return None
        lim = layout.GwLimit.from_buffer_copy(raw)
        names = {code: name for name, code in ACTIONS.items()}
        return int(lim.limit_bytes), names.get(int(lim.action), str(lim.action))

    # ---- device fds opened before the probes attached ----------------------------------------
    @_locked
    def seed_fds(self) -> fdseed.SeedReport:
        """Record the device fds of processes that opened them before the probes attached
        (walks /proc; see fdseed.py for the race with the tracepoints and how it is closed).
        Idempotent; returns this pass's report and adds it to `seed_totals`."""
        mounts = self._cgroup_mounts()
        self._last_seed = time.monotonic()
        if mounts.unified is None or not self.config.ioctl:
            return fdseed.SeedReport()
        seeder = fdseed.Seeder(self._map("gw_fds"), self._map("gw_tgids"), Path(self.config.proc_root),
                               mounts, self.config.device_prefix)
        report = seeder.seed()
        self.seed_totals.add(report)
        if report.fd_overflow or report.tgid_overflow:
            self.notes.append(f"fd seeding: {report.fd_overflow} device fds of {report.tgid_overflow} "
                              "processes did not fit in the bounded maps (gw_fds/gw_tgids)")
        return report

    def _maybe_seed(self) -> None:
        interval = self.config.fd_seed_interval_s
        if self.config.ioctl and interval > 0 and time.monotonic() - self._last_seed >= interval:
            self.seed_fds()

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
        root = self._cgroup_mounts().unified
        return 0 if root is None else housekeeping.drop_removed_cgroups(self._maps, Path(root))

    def _cgroup_mounts(self) -> CgroupMounts:
        """The cgroup hierarchies (containers/cgroupfs.py), found once; config.cgroup_root
        overrides the v2 mount."""
        if self._mounts is None:
            mounts = discover_mounts()
            self._mounts = mounts.with_unified(self.config.cgroup_root) if self.config.cgroup_root else mounts
        return self._mounts

    @_locked
    def sweep(self) -> int:
        """Delete fd/allocation entries left by exited processes (generation mismatch).
        Their bytes were already subtracted in the kernel at exit/close; this only frees map
        slots. Returns the number of entries removed."""
        return housekeeping.sweep_stale(self._maps)

    @_locked
    def live_entries(self) -> dict[str, int]:
        """Current number of entries in the bounded per-process maps."""
        return {name: len(self._map(name))
                for name in ("gw_tgids", "gw_fds", "gw_rm", "gw_clients", "gw_cuda", "gw_gpu_minor", "gw_gpu_instance")}
