"""Seed the device-fd map from /proc: GPU processes that opened the device nodes before the
probes attached (every GPU process already running when the agent starts or restarts).

The kernel programs learn device fds from openat (devices.bpf.c), dup and fork
(inherit.bpf.c). A process that opened /dev/nvidiactl or /dev/nvidiaN earlier is unknown to
them, so its RM_ALLOC/RM_FREE ioctls would never be counted. This module walks
`<proc_root>/<pid>/fd`, keeps the links under the configured device prefix (the configured
spelling and the prefix with its directory resolved: the links name the real path) and
writes `(tgid, fd) -> kind/minor` entries into `gw_fds`, plus a per-process `gw_tgids`
state where the process has none, in exactly the layouts the kernel writes (layout.py).

Race with the tracepoints, and how it is closed (ProbeManager attaches first, then seeds):
* an open that completes after attaching is recorded by the tracepoint; seeding inserts
  with BPF_NOEXIST, so it never overwrites what the kernel recorded (the kernel's entry is
  newer or identical), and reuses the process state the kernel created (same generation);
* a close between our readlink and our insert would leave an entry for a closed fd: after
  inserting, the link is read again and our entry (recognised by its fd_gen) is deleted
  when it no longer names the same device; a close after the insert is seen by the close
  tracepoint, which deletes the entry;
* a process that exits (or whose pid is reused) while being seeded: its start time is read
  before and after; on a change, what we inserted for it is deleted again;
* an open whose syscall entered before the attach and returns after the scan is missed
  until the next periodic seed (ProbeConfig.fd_seed_interval_s), as are forked children
  whose device fds lie beyond the kernel's fork-copy bound.
Bytes allocated before the agent started are unknown to the probes and are not invented:
only allocations made after seeding are decoded (NVML still reports the full memory).
"""

from __future__ import annotations

import errno
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuwatch.containers.cgroupfs import CgroupMounts
from gpuwatch.containers.pidcgroup import cgroup_id_of_pid
from gpuwatch.probes import layout
from gpuwatch.probes.bpfsys import BpfMap, BpfSyscallError

BPF_NOEXIST = 1
DELETED = " (deleted)"


@dataclass(frozen=True)
class DeviceFd:
    """One open descriptor of a device node under the prefix."""

    tgid: int
    fd: int
    kind: int  # layout.GW_KIND_*
    minor: int  # N of <prefix>N, else GW_DEV_UNKNOWN
    path: str


@dataclass
class SeedReport:
    """What one seeding pass did. `fd_overflow`/`tgid_overflow`: entries that did not fit in
    the bounded maps (counted, never silent)."""

    processes: int = 0
    seeded: int = 0  # new gw_fds entries
    known: int = 0  # already recorded by the kernel (or an earlier pass)
    fd_overflow: int = 0
    tgid_overflow: int = 0
    vanished: int = 0  # closed or exited while being seeded: removed again
    seeded_tgids: set[int] = field(default_factory=set)

    def add(self, other: SeedReport) -> None:
        for name in ("processes", "seeded", "known", "fd_overflow", "tgid_overflow", "vanished"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.seeded_tgids |= other.seeded_tgids


def device_prefixes(prefix: str) -> tuple[str, ...]:
    """The configured prefix and, when different, the same with its directory resolved
    (/proc/<pid>/fd links name the real path, e.g. through a symlinked /tmp or /run)."""
    directory, base = os.path.split(prefix)
    resolved = os.path.join(os.path.realpath(directory or "."), base)
    return (prefix,) if resolved == prefix else (prefix, resolved)


def classify(suffix: str) -> tuple[int, int]:
    """(kind, minor) of the path text after the prefix, exactly as gw_classify (devices.bpf.c)
    decides it from the first four bytes: "ctl", "-uvm...", "N" or "NN", anything else."""
    s = suffix.encode(errors="replace")[:4].ljust(4, b"\0")
    if s == b"ctl\0":
        return layout.GW_KIND_CTL, layout.GW_DEV_UNKNOWN
    if s.startswith(b"-uvm"):
        return layout.GW_KIND_UVM, layout.GW_DEV_UNKNOWN
    if s[:1].isdigit():
        if s[1:2] == b"\0":
            return layout.GW_KIND_GPU, int(s[:1])
        if s[1:2].isdigit() and s[2:3] == b"\0":
            return layout.GW_KIND_GPU, int(s[:2])
    return layout.GW_KIND_OTHER, layout.GW_DEV_UNKNOWN


def match(link: str, prefixes: tuple[str, ...]) -> tuple[int, int] | None:
    """(kind, minor) when `link` (a readlink of /proc/<pid>/fd/N) names a node under a prefix."""
    if link.endswith(DELETED):
        link = link[:-len(DELETED)]
    for prefix in prefixes:
        if link.startswith(prefix):
            return classify(link[len(prefix):])
    return None


def _readlink(path: Path) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def process_device_fds(proc_root: Path, tgid: int, prefixes: tuple[str, ...]) -> list[DeviceFd]:
    """Device fds of one process (empty when it is gone or unreadable)."""
    fd_dir = proc_root / str(tgid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return []
    found: list[DeviceFd] = []
    for name in names:
        if not name.isdigit():
            continue
        link = _readlink(fd_dir / name)
        hit = match(link, prefixes) if link is not None else None
        if hit is not None:
            assert link is not None
            found.append(DeviceFd(tgid, int(name), hit[0], hit[1], link))
    return sorted(found, key=lambda d: d.fd)


def scan(proc_root: Path, prefix: str) -> dict[int, list[DeviceFd]]:
    """Every process under `proc_root` holding a device fd under `prefix`: tgid -> its fds."""
    prefixes = device_prefixes(prefix)
    out: dict[int, list[DeviceFd]] = {}
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit():
            fds = process_device_fds(proc_root, int(entry), prefixes)
            if fds:
                out[int(entry)] = fds
    return out


def cgroup_id(proc_root: Path, tgid: int, mounts: CgroupMounts) -> int | None:
    """cgroup v2 id (the directory's inode, what bpf_get_current_cgroup_id returns) of a
    process; None when it is gone or has no v2 cgroup here (containers/pidcgroup.py)."""
    return cgroup_id_of_pid(tgid, mounts, str(proc_root))


def start_time(proc_root: Path, tgid: int) -> int | None:
    """Start time (clock ticks since boot, field 22 of stat): tells a pid's reuse apart."""
    try:
        text = (proc_root / str(tgid) / "stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    return int(fields[19]) if len(fields) > 19 else None


class Seeder:
    """Writes /proc's device fds into the kernel's maps (gw_fds, gw_tgids). Generations it
    creates come from CLOCK_MONOTONIC like the kernel's bpf_ktime_get_ns, kept unique."""

    def __init__(self, fds: BpfMap, tgids: BpfMap, proc_root: Path, mounts: CgroupMounts, prefix: str) -> None:
        self.fds = fds
        self.tgids = tgids
        self.proc_root = proc_root
        self.mounts = mounts
        self.prefix = prefix
        self._last_gen = 0

    def _gen(self) -> int:
        self._last_gen = max(time.monotonic_ns(), self._last_gen + 1)
        return self._last_gen

    def seed(self) -> SeedReport:
        """One pass over every process. Idempotent: what is recorded stays as it is."""
        report = SeedReport()
        for tgid, fds in sorted(scan(self.proc_root, self.prefix).items()):
            report.add(self.seed_process(tgid, fds))
        return report

    def seed_process(self, tgid: int, fds: list[DeviceFd]) -> SeedReport:
        report = SeedReport(processes=1)
        started = start_time(self.proc_root, tgid)
        cg = cgroup_id(self.proc_root, tgid, self.mounts)
        if started is None or cg is None:
            report.vanished += len(fds)
            return report
        tkey = struct.pack("<I", tgid)
        gen, created = self._process_state(tkey, cg, fds)
        if gen is None:
            report.tgid_overflow += 1
            report.fd_overflow += len(fds)
            return report
        mine: list[tuple[bytes, int, DeviceFd]] = []
        for dev in fds:
            key = bytes(layout.GwFdKey(tgid=tgid, fd=dev.fd))
            fd_gen = self._gen()
            value = layout.GwFdVal(kind=dev.kind, minor=dev.minor, tgid_gen=gen, fd_gen=fd_gen)
            try:
                self.fds.update(key, bytes(value), BPF_NOEXIST)
            except BpfSyscallError as err:
                if err.errno == errno.EEXIST:
                    report.known += 1
                elif err.errno == errno.E2BIG:
                    report.fd_overflow += 1
                else:
                    raise
                continue
            mine.append((key, fd_gen, dev))
        if start_time(self.proc_root, tgid) != started:  # exited, or the pid was reused
            for key, fd_gen, _dev in mine:
                self._delete_if_mine(key, fd_gen)
            if created:
                self._delete_state_if_mine(tkey, gen)
            report.vanished += len(mine)
            return report
        prefixes = device_prefixes(self.prefix)
        for key, fd_gen, dev in mine:
            link = _readlink(self.proc_root / str(tgid) / "fd" / str(dev.fd))
            if link is None or match(link, prefixes) != (dev.kind, dev.minor):
                self._delete_if_mine(key, fd_gen)  # closed (and maybe reused) meanwhile
                report.vanished += 1
            else:
                report.seeded += 1
                report.seeded_tgids.add(tgid)
        return report

    def _process_state(self, tkey: bytes, cg: int, fds: list[DeviceFd]) -> tuple[int | None, bool]:
        """(generation, created by us) of the process's state; a new state when it has none."""
        raw = self.tgids.lookup(tkey)
        if raw is not None:
            return layout.GwTgidState.from_buffer_copy(raw).gen, False
        mask = 0
        for dev in fds:
            if dev.kind == layout.GW_KIND_GPU and dev.minor < layout.GW_DEV_UNKNOWN:
                mask |= 1 << dev.minor
        st = layout.GwTgidState(cgroup_id=cg, gen=self._gen(), gpu_mask=mask,
                                fd_hi=max(d.fd for d in fds) + 1)
        try:
            self.tgids.update(tkey, bytes(st), BPF_NOEXIST)
        except BpfSyscallError as err:
            if err.errno == errno.E2BIG:
                return None, False
            if err.errno != errno.EEXIST:
                raise
            raw = self.tgids.lookup(tkey)  # the kernel created it meanwhile: use its generation
            if raw is None:
                return None, False
            return layout.GwTgidState.from_buffer_copy(raw).gen, False
        return st.gen, True

    def _delete_if_mine(self, key: bytes, fd_gen: int) -> None:
        raw = self.fds.lookup(key)
        if raw is not None and layout.GwFdVal.from_buffer_copy(raw).fd_gen == fd_gen:
            self.fds.delete(key)

    def _delete_state_if_mine(self, tkey: bytes, gen: int) -> None:
        raw = self.tgids.lookup(tkey)
        if raw is not None and layout.GwTgidState.from_buffer_copy(raw).gen == gen:
            self.tgids.delete(tkey)
