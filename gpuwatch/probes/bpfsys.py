"""The bpf() and perf_event_open() system calls through ctypes: map reads, attach, detach.

The agent keeps only file descriptors (maps, programs, perf events) handed over by the
short-lived compiler child (bcc_loader), so it never imports BCC/LLVM (~125 MB). Everything
it needs afterwards is here: look up / iterate / update / delete map elements, read an
object's info, attach a loaded program to a tracepoint or a uprobe with a perf event
(detach = close the fd; the kernel also detaches when the process dies, whatever the cause).
x86-64 only (syscall numbers below).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SYS_BPF = 321
SYS_PERF_EVENT_OPEN = 298

BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_DELETE_ELEM = 3
BPF_MAP_GET_NEXT_KEY = 4
BPF_OBJ_PIN = 6
BPF_OBJ_GET = 7
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_QUERY = 16
BPF_MAP_LOOKUP_BATCH = 24
BPF_LINK_CREATE = 28
BPF_TRACE_UPROBE_MULTI = 48
BPF_CGROUP_DEVICE = 6  # attach type of cgroup device programs
BPF_F_UPROBE_MULTI_RETURN = 1

BPF_ANY = 0
BPF_MAP_TYPE_PERCPU_HASH = 5
BPF_MAP_TYPE_PERCPU_ARRAY = 6

PERF_TYPE_TRACEPOINT = 2
PERF_SAMPLE_RAW = 1 << 10
PERF_FLAG_FD_CLOEXEC = 1 << 3
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_SET_BPF = 0x40042408

TRACEFS_CANDIDATES = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
UPROBE_PMU = Path("/sys/bus/event_source/devices/uprobe")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class BpfSyscallError(OSError):
    """A bpf()/perf_event_open() call failed; errno and the operation are in the message."""


class _NoBatch(Exception):
    """The kernel or map type has no BPF_MAP_LOOKUP_BATCH."""


def _call(nr: int, *args: object, what: str) -> int:
    ret = _libc.syscall(nr, *args)
    if ret < 0:
        err = ctypes.get_errno()
        raise BpfSyscallError(err, f"{what}: {os.strerror(err)}")
    return int(ret)


class _MapElemAttr(ctypes.Structure):
    _fields_ = [("map_fd", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("key", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


class _BatchAttr(ctypes.Structure):
    _fields_ = [("in_batch", ctypes.c_uint64), ("out_batch", ctypes.c_uint64), ("keys", ctypes.c_uint64),
                ("values", ctypes.c_uint64), ("count", ctypes.c_uint32), ("map_fd", ctypes.c_uint32),
                ("elem_flags", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


class _InfoAttr(ctypes.Structure):
    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32), ("info", ctypes.c_uint64)]


class _ObjAttr(ctypes.Structure):
    _fields_ = [("pathname", ctypes.c_uint64), ("bpf_fd", ctypes.c_uint32),
                ("file_flags", ctypes.c_uint32), ("path_fd", ctypes.c_int32), ("pad", ctypes.c_uint32)]


class _MapInfo(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("key_size", ctypes.c_uint32),
                ("value_size", ctypes.c_uint32), ("max_entries", ctypes.c_uint32),
                ("map_flags", ctypes.c_uint32), ("name", ctypes.c_char * 16),
                ("rest", ctypes.c_uint8 * 64)]


class _ProgInfo(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("tag", ctypes.c_uint8 * 8),
                ("rest", ctypes.c_uint8 * 200)]


class _PerfEventAttr(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64),
                ("read_format", ctypes.c_uint64), ("flags", ctypes.c_uint64),
                ("wakeup_events", ctypes.c_uint32), ("bp_type", ctypes.c_uint32),
                ("config1", ctypes.c_uint64), ("config2", ctypes.c_uint64),
                ("rest", ctypes.c_uint8 * 56)]


def possible_cpus() -> int:
    """Number of possible CPUs (per-CPU map values hold one slot per possible CPU)."""
    text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    count = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        count += (int(hi) if hi else int(lo)) - int(lo) + 1
    return count


@dataclass(frozen=True)
class MapInfo:
    type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int
    name: str


def map_info(fd: int) -> MapInfo:
    info = _MapInfo()
    attr = _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info))
    _call(SYS_BPF, BPF_OBJ_GET_INFO_BY_FD, ctypes.byref(attr), ctypes.sizeof(attr), what="map info")
    return MapInfo(info.type, info.id, info.key_size, info.value_size, info.max_entries,
                   info.name.decode(errors="replace"))


def prog_id(fd: int) -> int:
    """Kernel id of a loaded program (tests use it to prove a program is gone)."""
    info = _ProgInfo()
    attr = _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info))
    _call(SYS_BPF, BPF_OBJ_GET_INFO_BY_FD, ctypes.byref(attr), ctypes.sizeof(attr), what="prog info")
    return int(info.id)


def prog_exists(prog_id_: int) -> bool:
    """Whether a BPF program with this kernel id is still loaded (held by anyone)."""
    attr = (ctypes.c_uint32 * 4)(prog_id_, 0, 0, 0)
    ret = _libc.syscall(SYS_BPF, BPF_PROG_GET_FD_BY_ID, ctypes.byref(attr), ctypes.sizeof(attr))
    if ret >= 0:
        os.close(ret)
        return True
    err = ctypes.get_errno()
    if err == errno.ENOENT:
        return False
    raise BpfSyscallError(err, f"get program {prog_id_}: {os.strerror(err)}")


def obj_pin(fd: int, path: str) -> None:
    raw = ctypes.create_string_buffer(os.fsencode(path))
    attr = _ObjAttr(pathname=ctypes.addressof(raw), bpf_fd=fd)
    _call(SYS_BPF, BPF_OBJ_PIN, ctypes.byref(attr), ctypes.sizeof(attr), what=f"pin {path}")


def obj_get(path: str) -> int:
    raw = ctypes.create_string_buffer(os.fsencode(path))
    attr = _ObjAttr(pathname=ctypes.addressof(raw))
    return _call(SYS_BPF, BPF_OBJ_GET, ctypes.byref(attr), ctypes.sizeof(attr), what=f"open pinned {path}")


class BpfMap:
    """One BPF map by fd. Keys/values are raw bytes; per-CPU values come back concatenated
    (one 8-byte-aligned slot per possible CPU)."""

    def __init__(self, fd: int, name: str = "") -> None:
        self.fd = fd
        info = map_info(fd)
        self.name = name or info.name
        self.info = info
        self.key_size = info.key_size
        self.percpu = info.type in (BPF_MAP_TYPE_PERCPU_HASH, BPF_MAP_TYPE_PERCPU_ARRAY)
        self.slot_size = (info.value_size + 7) // 8 * 8
        self.value_bytes = self.slot_size * possible_cpus() if self.percpu else info.value_size

    def _elem(self, cmd: int, key: bytes | None, value: ctypes.Array[ctypes.c_char] | None,
              flags: int = 0) -> int:
        kbuf = ctypes.create_string_buffer(key, self.key_size) if key is not None else None
        attr = _MapElemAttr(map_fd=self.fd, key=ctypes.addressof(kbuf) if kbuf is not None else 0,
                            value=ctypes.addressof(value) if value is not None else 0, flags=flags)
        ret = _libc.syscall(SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
        return 0 if ret >= 0 else ctypes.get_errno()

    def lookup(self, key: bytes) -> bytes | None:
        value = ctypes.create_string_buffer(self.value_bytes)
        err = self._elem(BPF_MAP_LOOKUP_ELEM, key, value)
        if err == errno.ENOENT:
            return None
        if err:
            raise BpfSyscallError(err, f"lookup in {self.name}: {os.strerror(err)}")
        return value.raw

    def update(self, key: bytes, value: bytes, flags: int = BPF_ANY) -> None:
        vbuf = ctypes.create_string_buffer(value, self.value_bytes)
        err = self._elem(BPF_MAP_UPDATE_ELEM, key, vbuf, flags)
        if err:
            raise BpfSyscallError(err, f"update in {self.name}: {os.strerror(err)}")

    def delete(self, key: bytes) -> bool:
        err = self._elem(BPF_MAP_DELETE_ELEM, key, None)
        if err in (0, errno.ENOENT):
            return err == 0
        raise BpfSyscallError(err, f"delete in {self.name}: {os.strerror(err)}")

    def keys(self) -> Iterator[bytes]:
        """Iterate keys (BPF_MAP_GET_NEXT_KEY). Entries inserted meanwhile may or may not show."""
        nxt = ctypes.create_string_buffer(self.key_size)
        key: bytes | None = None
        while True:
            kbuf = ctypes.create_string_buffer(key, self.key_size) if key is not None else None
            attr = _MapElemAttr(map_fd=self.fd, key=ctypes.addressof(kbuf) if kbuf is not None else 0,
                                value=ctypes.addressof(nxt))
            ret = _libc.syscall(SYS_BPF, BPF_MAP_GET_NEXT_KEY, ctypes.byref(attr), ctypes.sizeof(attr))
            if ret < 0:
                err = ctypes.get_errno()
                if err == errno.ENOENT:
                    return
                raise BpfSyscallError(err, f"iterate {self.name}: {os.strerror(err)}")
            key = nxt.raw
            yield key

    def __iter__(self) -> Iterator[bytes]:
        return self.keys()

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """All (key, value) pairs: BPF_MAP_LOOKUP_BATCH (a few syscalls for the whole map),
        or key-by-key where the kernel/map type has no batch lookup."""
        if self._batch_ok:
            try:
                yield from self._items_batch()
                return
            except _NoBatch:
                self._batch_ok = False
        for key in list(self.keys()):
            value = self.lookup(key)
            if value is not None:
                yield key, value

    _batch_ok = True
    BATCH = 1024

    def _items_batch(self) -> list[tuple[bytes, bytes]]:
        chunk = self.BATCH
        token_in = ctypes.create_string_buffer(max(self.key_size, 8))
        token_out = ctypes.create_string_buffer(max(self.key_size, 8))
        out: list[tuple[bytes, bytes]] = []
        first = True
        while True:
            keys = ctypes.create_string_buffer(self.key_size * chunk)
            values = ctypes.create_string_buffer(self.value_bytes * chunk)
            attr = _BatchAttr(in_batch=0 if first else ctypes.addressof(token_in),
                              out_batch=ctypes.addressof(token_out), keys=ctypes.addressof(keys),
                              values=ctypes.addressof(values), count=chunk, map_fd=self.fd)
            ret = _libc.syscall(SYS_BPF, BPF_MAP_LOOKUP_BATCH, ctypes.byref(attr), ctypes.sizeof(attr))
            err = 0 if ret >= 0 else ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP) and first and not out:
                raise _NoBatch()
            if err == errno.ENOSPC:  # one bucket holds more than `chunk` entries
                chunk *= 4
                continue
            if err not in (0, errno.ENOENT):
                raise BpfSyscallError(err, f"batch lookup in {self.name}: {os.strerror(err)}")
            kraw, vraw = keys.raw, values.raw
            for i in range(attr.count):
                out.append((kraw[i * self.key_size:(i + 1) * self.key_size],
                            vraw[i * self.value_bytes:(i + 1) * self.value_bytes]))
            if err == errno.ENOENT:
                return out
            ctypes.memmove(token_in, token_out, len(token_out))
            first = False

    def percpu_slots(self, value: bytes) -> Iterator[bytes]:
        for off in range(0, len(value), self.slot_size):
            yield value[off:off + self.info.value_size]

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())


# ---- attach -------------------------------------------------------------------------------

def close_all(fds: list[int]) -> None:
    """Close fds (detach/unload), ignoring ones already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            continue  # already closed


def tracefs_root() -> Path:
    for root in TRACEFS_CANDIDATES:
        if (root / "events").is_dir():
            return root
    raise FileNotFoundError("tracefs is not mounted (mount -t tracefs tracefs /sys/kernel/tracing)")


def ensure_tracefs() -> Path:
    """Return the tracefs mount, mounting it at /sys/kernel/tracing when missing (root)."""
    try:
        return tracefs_root()
    except FileNotFoundError:
        pass
    target = TRACEFS_CANDIDATES[0]
    ret = _libc.mount(b"tracefs", os.fsencode(target), b"tracefs", 0, None)
    if ret != 0:
        err = ctypes.get_errno()
        raise BpfSyscallError(err, f"mount tracefs at {target}: {os.strerror(err)}")
    return tracefs_root()


def _perf_open(attr: _PerfEventAttr, what: str) -> int:
    attr.size = ctypes.sizeof(attr)
    return _call(SYS_PERF_EVENT_OPEN, ctypes.byref(attr), -1, 0, -1, PERF_FLAG_FD_CLOEXEC, what=what)


def _set_bpf(perf_fd: int, prog_fd: int, what: str) -> None:
    try:
        fcntl.ioctl(perf_fd, PERF_EVENT_IOC_SET_BPF, prog_fd)
        fcntl.ioctl(perf_fd, PERF_EVENT_IOC_ENABLE, 0)
    except OSError as err:
        os.close(perf_fd)
        raise BpfSyscallError(err.errno or 0, f"{what}: attach program: {err.strerror}") from err


def attach_tracepoint(prog_fd: int, category: str, name: str) -> int:
    """Attach a BPF_PROG_TYPE_TRACEPOINT program; returns the perf event fd (close = detach)."""
    tp_id = int((tracefs_root() / "events" / category / name / "id").read_text())
    attr = _PerfEventAttr(type=PERF_TYPE_TRACEPOINT, config=tp_id, sample_period=1,
                          sample_type=PERF_SAMPLE_RAW, wakeup_events=1)
    fd = _perf_open(attr, f"tracepoint {category}:{name}")
    _set_bpf(fd, prog_fd, f"tracepoint {category}:{name}")
    return fd


def _uprobe_pmu() -> tuple[int, int]:
    pmu_type = int((UPROBE_PMU / "type").read_text())
    fmt = (UPROBE_PMU / "format" / "retprobe").read_text().strip()  # "config:0"
    return pmu_type, int(fmt.split(":")[1])


class _UprobeMultiLinkAttr(ctypes.Structure):
    _fields_ = [("prog_fd", ctypes.c_uint32), ("target_fd", ctypes.c_uint32),
                ("attach_type", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("path", ctypes.c_uint64), ("offsets", ctypes.c_uint64),
                ("ref_ctr_offsets", ctypes.c_uint64), ("cookies", ctypes.c_uint64),
                ("cnt", ctypes.c_uint32), ("multi_flags", ctypes.c_uint32), ("pid", ctypes.c_uint32),
                ("pad", ctypes.c_uint32)]


def attach_uprobe_multi(prog_fd: int, path: str, offsets: list[int], retprobe: bool = False) -> int:
    """Attach one program (loaded with expected_attach_type BPF_TRACE_UPROBE_MULTI) to many
    offsets of one file with a single BPF link (kernel >= 6.6). Returns the link fd; closing
    it detaches all of them with one synchronisation, where perf uprobes pay one each."""
    raw_path = ctypes.create_string_buffer(os.fsencode(path))
    offs = (ctypes.c_uint64 * len(offsets))(*offsets)
    attr = _UprobeMultiLinkAttr(prog_fd=prog_fd, attach_type=BPF_TRACE_UPROBE_MULTI,
                                path=ctypes.addressof(raw_path), offsets=ctypes.addressof(offs),
                                cnt=len(offsets), multi_flags=BPF_F_UPROBE_MULTI_RETURN if retprobe else 0)
    return _call(SYS_BPF, BPF_LINK_CREATE, ctypes.byref(attr), ctypes.sizeof(attr),
                 what=f"uprobe_multi link {path} ({len(offsets)} offsets)")


def attach_uprobe(prog_fd: int, path: str, offset: int, retprobe: bool = False) -> int:
    """Attach a kprobe-type program to path+offset as a uprobe (perf uprobe PMU, so nothing is
    written to uprobe_events); returns the perf event fd (close = detach)."""
    pmu_type, ret_bit = _uprobe_pmu()
    raw_path = ctypes.create_string_buffer(os.fsencode(path))
    attr = _PerfEventAttr(type=pmu_type, config=(1 << ret_bit) if retprobe else 0,
                          sample_period=1, wakeup_events=1, config1=ctypes.addressof(raw_path),
                          config2=offset)
    what = f"{'uretprobe' if retprobe else 'uprobe'} {path}+{offset:#x}"
    fd = _perf_open(attr, what)
    _set_bpf(fd, prog_fd, what)
    return fd


# ---- cgroup programs ------------------------------------------------------------------------

class _CgroupLinkAttr(ctypes.Structure):
    _fields_ = [("prog_fd", ctypes.c_uint32), ("target_fd", ctypes.c_uint32),
                ("attach_type", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("relative_fd", ctypes.c_uint32), ("pad", ctypes.c_uint32),
                ("expected_revision", ctypes.c_uint64), ("rest", ctypes.c_uint8 * 32)]


class _ProgQueryAttr(ctypes.Structure):
    _fields_ = [("target_fd", ctypes.c_uint32), ("attach_type", ctypes.c_uint32),
                ("query_flags", ctypes.c_uint32), ("attach_flags", ctypes.c_uint32),
                ("prog_ids", ctypes.c_uint64), ("prog_cnt", ctypes.c_uint32), ("pad", ctypes.c_uint32),
                ("prog_attach_flags", ctypes.c_uint64), ("link_ids", ctypes.c_uint64),
                ("link_attach_flags", ctypes.c_uint64), ("revision", ctypes.c_uint64)]


def attach_cgroup_link(prog_fd: int, cgroup_fd: int, attach_type: int) -> int:
    """Attach a cgroup program to the cgroup open at `cgroup_fd` with a BPF link; returns the
    link fd. A cgroup link is always BPF_F_ALLOW_MULTI (composes with programs others attach)
    and, unlike BPF_PROG_ATTACH, lives only as long as its fd: closing it — or the process
    dying, whatever the cause — detaches it, so nothing can be left attached behind us."""
    attr = _CgroupLinkAttr(prog_fd=prog_fd, target_fd=cgroup_fd, attach_type=attach_type)
    return _call(SYS_BPF, BPF_LINK_CREATE, ctypes.byref(attr), ctypes.sizeof(attr),
                 what=f"cgroup link (attach type {attach_type})")


def cgroup_prog_ids(cgroup_fd: int, attach_type: int) -> tuple[int, ...]:
    """Ids of the programs attached directly to a cgroup for `attach_type` (BPF_PROG_QUERY)."""
    ids = (ctypes.c_uint32 * 64)()
    attr = _ProgQueryAttr(target_fd=cgroup_fd, attach_type=attach_type,
                          prog_ids=ctypes.addressof(ids), prog_cnt=len(ids))
    _call(SYS_BPF, BPF_PROG_QUERY, ctypes.byref(attr), ctypes.sizeof(attr),
          what=f"query cgroup programs (attach type {attach_type})")
    return tuple(int(ids[i]) for i in range(min(attr.prog_cnt, len(ids))))
