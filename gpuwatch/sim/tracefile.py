"""Reading and checking a gpuwatch ioctl trace (format: gpuwatch/sim/TRACE_FORMAT.md, version 1).

A trace is JSON Lines: a header, then one event per line in the order the calls completed.
`read_trace` parses and checks the whole file before anything is replayed, so a bad trace
fails with the line number and what is wrong (TraceError), never half-way through a replay
and never with a traceback. Only what the replayer needs is kept (tids and timestamps are
checked for type, then dropped).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatch.core.errors import SimError

TRACE_FORMAT = "gpuwatch-ioctl-trace"
TRACE_VERSION = 1
DEVICE_PATH_PREFIX = "/dev/nvidia"
POINTER_BYTES = 8
NV_IOCTL_MAGIC = 0x46  # 'F': RM escapes carry their parameter size in the cmd word
RM_ALLOC_NR = 0x2B
IOCTL_XFER_CMD_NR = 211  # nv_ioctl_xfer_t: inner cmd u32 @0, inner block at the pointer @8
XFER_PTR_AT = 8
# RM_ALLOC's parameter struct: NVOS21 (32 bytes) or NVOS64 (48): hClass @12, pAllocParms @16,
# then paramsSize and status at these offsets
RM_ALLOC_CLASS_AT = 12
RM_ALLOC_PARAMS_AT = 16
RM_ALLOC_SIZE_STATUS_AT = {32: (24, 28), 48: (32, 40)}
NV01_MEMORY_LOCAL_USER = 0x40


class TraceError(SimError):
    """A trace file is unreadable or breaks the format; the message names the line."""


@dataclass(frozen=True)
class Block:
    """One parameter block: its bytes after the call (what the driver answered) and the
    blocks it points to, each at the byte offset of its pointer."""

    after: bytes
    nested: tuple[tuple[int, Block], ...] = ()
    before: bytes = b""  # what the caller passed in (same length as `after`)


@dataclass(frozen=True)
class Open:
    line: int
    path: str
    fd: int  # -1: the open failed (nothing to replay)


@dataclass(frozen=True)
class Close:
    line: int
    fd: int


@dataclass(frozen=True)
class Dup:
    line: int
    fd: int
    newfd: int


@dataclass(frozen=True)
class Ioctl:
    line: int
    fd: int
    cmd: int
    params: Block
    result: int = 0  # what the call returned: >= 0, or -errno


@dataclass(frozen=True)
class Checkpoint:
    line: int
    name: str
    nvml: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Exit:
    line: int
    status: int


Event = Open | Close | Dup | Ioctl | Checkpoint | Exit


@dataclass(frozen=True)
class RmAlloc:
    """What an RM_ALLOC's parameter struct (NVOS21 or NVOS64) says, as recorded."""

    hclass: int
    params_address: int  # pAllocParms in the recorded process (0: none passed)
    params_size: int  # paramsSize as passed: the RM ignores it (real libcuda sends 0)
    status: int  # the RM's status in the after image (0: allocated)
    params: Block | None  # the captured pAllocParms block; None: the recorder kept none


def rm_alloc_of(nr: int, block: Block) -> RmAlloc | None:
    """Parse `block` as the parameter struct of escape `nr` if that is an RM_ALLOC."""
    offsets = RM_ALLOC_SIZE_STATUS_AT.get(len(block.after))
    if nr != RM_ALLOC_NR or offsets is None:
        return None
    size_at, status_at = offsets
    image = block.before or block.after
    nested = dict(block.nested)
    return RmAlloc(hclass=struct.unpack_from("<I", image, RM_ALLOC_CLASS_AT)[0],
                   params_address=struct.unpack_from("<Q", image, RM_ALLOC_PARAMS_AT)[0],
                   params_size=struct.unpack_from("<I", image, size_at)[0],
                   status=struct.unpack_from("<I", block.after, status_at)[0],
                   params=nested.get(RM_ALLOC_PARAMS_AT))


def rm_allocs_in(event: Ioctl) -> Iterator[RmAlloc]:
    """The RM_ALLOC an 'F' ioctl carries: its own parameter struct, or the inner one of an
    IOCTL_XFER_CMD whose inner command is RM_ALLOC."""
    if (event.cmd >> 8) & 0xFF != NV_IOCTL_MAGIC:
        return
    nr = event.cmd & 0xFF
    found = rm_alloc_of(nr, event.params)
    if found is not None:
        yield found
    elif nr == IOCTL_XFER_CMD_NR and len(event.params.before) >= 4:
        inner = dict(event.params.nested).get(XFER_PTR_AT)
        if inner is not None:
            found = rm_alloc_of(struct.unpack_from("<I", event.params.before, 0)[0] & 0xFF, inner)
            if found is not None:
                yield found


@dataclass(frozen=True)
class Trace:
    path: Path
    header: dict[str, Any]
    events: tuple[Event, ...]

    @property
    def device_paths(self) -> tuple[str, ...]:
        """Every device path the trace opens, in order of first use."""
        return tuple(dict.fromkeys(e.path for e in self.events if isinstance(e, Open) and e.fd >= 0))

    def checkpoints(self) -> tuple[Checkpoint, ...]:
        return tuple(e for e in self.events if isinstance(e, Checkpoint))

    @property
    def allocation_sizes_recorded(self) -> bool:
        """False when some successful RM_ALLOC of video memory (class 0x40, status 0) has no
        captured pAllocParms block: the trace was made by a recorder that followed paramsSize
        only, and real libcuda sends paramsSize 0 (the real traces of driver 580), so the
        allocation sizes were never recorded and a replay can only show them as 0 bytes.
        Such traces have no "alloc_params" in their header (the class-sizing recorder writes
        "by-class")."""
        for event in self.events:
            if isinstance(event, Ioctl):
                for alloc in rm_allocs_in(event):
                    if alloc.hclass == NV01_MEMORY_LOCAL_USER and alloc.status == 0 and alloc.params is None:
                        return False
        return True


def read_trace(path: Path) -> Trace:
    """Parse and check a whole trace file (TraceError names the line and the problem)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TraceError(f"cannot read trace {path}: {err}", fix="pass a trace file the recorder wrote") from err
    lines = list(_json_lines(path, text))
    if not lines:
        raise TraceError(f"{path}: empty trace (no header line)", fix="pass a trace file the recorder wrote")
    header_line, header = lines[0]
    _check_header(path, header_line, header)
    events: list[Event] = []
    open_fds: set[int] = set()
    for number, obj in lines[1:]:
        if events and isinstance(events[-1], Exit):
            raise _error(path, number, "event after the exit event (exit must be the last line)")
        event = _event(path, number, obj)
        _track_fds(path, event, open_fds)
        if event is not None:
            events.append(event)
    return Trace(path=path, header=header, events=tuple(events))


def _json_lines(path: Path, text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as err:
            raise _error(path, number, f"not JSON ({err.msg} at column {err.colno})") from err
        if not isinstance(obj, dict):
            raise _error(path, number, "not a JSON object")
        yield number, obj


def _error(path: Path, line: int, what: str) -> TraceError:
    return TraceError(f"{path}:{line}: {what}", fix="see gpuwatch/sim/TRACE_FORMAT.md for the trace format")


def _check_header(path: Path, line: int, header: dict[str, Any]) -> None:
    if header.get("format") != TRACE_FORMAT:
        raise _error(path, line, f"header: format must be {TRACE_FORMAT!r}, got {header.get('format')!r}")
    if header.get("version") != TRACE_VERSION:
        raise _error(path, line, f"header: version {header.get('version')!r} is not supported "
                                 f"(this replayer reads version {TRACE_VERSION})")
    gpus = header.get("gpus")
    if not isinstance(gpus, list) or not all(isinstance(g, dict) and isinstance(g.get("minor"), int)
                                             for g in gpus):
        raise _error(path, line, "header: gpus must be a list of objects with an integer minor")


def _int(path: Path, line: int, obj: dict[str, Any], key: str) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _error(path, line, f"{obj.get('ev', 'event')}: {key} must be an integer, got {value!r}")
    return value


def _hex(path: Path, line: int, obj: dict[str, Any], key: str) -> bytes:
    value = obj.get(key)
    if not isinstance(value, str):
        raise _error(path, line, f"{key} must be a hex string, got {value!r}")
    try:
        return bytes.fromhex(value)
    except ValueError as err:
        raise _error(path, line, f"{key} is not a hex string ({err})") from err


def _block(path: Path, line: int, obj: dict[str, Any], where: str) -> Block:
    before = _hex(path, line, obj, "before")
    after = _hex(path, line, obj, "after")
    if len(before) != len(after):
        raise _error(path, line, f"{where}: before is {len(before)} bytes but after is {len(after)}")
    nested_raw = obj.get("nested", [])
    if not isinstance(nested_raw, list):
        raise _error(path, line, f"{where}: nested must be a list")
    nested: list[tuple[int, Block]] = []
    for item in nested_raw:
        if not isinstance(item, dict):
            raise _error(path, line, f"{where}: each nested block must be an object")
        at = _int(path, line, item, "at")
        size = _int(path, line, item, "size")
        if at < 0 or at + POINTER_BYTES > len(after):
            raise _error(path, line, f"{where}: nested pointer at {at} lies outside the {len(after)}-byte block")
        child = _block(path, line, item, f"{where} > nested@{at}")
        if size != len(child.after):
            raise _error(path, line, f"{where}: nested@{at} size {size} but its images are {len(child.after)} bytes")
        nested.append((at, child))
    return Block(after=after, nested=tuple(nested), before=before)


def _event(path: Path, line: int, obj: dict[str, Any]) -> Event | None:
    kind = obj.get("ev")
    if kind == "open":
        p = obj.get("path")
        if not isinstance(p, str) or not p.startswith(DEVICE_PATH_PREFIX):
            raise _error(path, line, f"open: path must start with {DEVICE_PATH_PREFIX}, got {p!r}")
        return Open(line, p, _int(path, line, obj, "fd"))
    if kind == "close":
        return Close(line, _int(path, line, obj, "fd"))
    if kind == "dup":
        return Dup(line, _int(path, line, obj, "fd"), _int(path, line, obj, "newfd"))
    if kind == "ioctl":
        cmd = _int(path, line, obj, "cmd")
        fd = _int(path, line, obj, "fd")
        params = _block(path, line, obj, f"ioctl {cmd:#x}")
        # the recorder marks a parameter struct it could not read ("unreadable": empty images)
        sized = not obj.get("unreadable") and not obj.get("size_unknown")
        if sized and (cmd >> 8) & 0xFF == NV_IOCTL_MAGIC and len(params.after) != (cmd >> 16) & 0x3FFF:
            raise _error(path, line, f"ioctl {cmd:#x}: images are {len(params.after)} bytes but _IOC_SIZE "
                                     f"is {(cmd >> 16) & 0x3FFF}")
        ret = obj.get("ret", 0)
        err = obj.get("errno", 0)
        result = ret if isinstance(ret, int) and ret >= 0 else -(err if isinstance(err, int) and err > 0 else 5)
        return Ioctl(line, fd, cmd, params, result)
    if kind == "mmap":
        return None  # no probe decodes mmaps; a /dev/null-like sim node refuses them anyway
    if kind == "checkpoint":
        name = obj.get("name")
        nvml = obj.get("nvml")
        if not isinstance(name, str) or not isinstance(nvml, list) or not all(isinstance(n, dict) for n in nvml):
            raise _error(path, line, "checkpoint: needs a string name and an nvml list of objects")
        return Checkpoint(line, name, tuple(nvml))
    if kind == "exit":
        return Exit(line, _int(path, line, obj, "status"))
    raise _error(path, line, f"unknown event {kind!r} (expected open, close, dup, ioctl, mmap, checkpoint, exit)")


def _track_fds(path: Path, event: Event | None, open_fds: set[int]) -> None:
    """Check that every fd an event uses was opened (or duplicated) before by the trace."""
    if isinstance(event, Open):
        if event.fd >= 0:
            open_fds.add(event.fd)
    elif isinstance(event, Close | Ioctl):
        if event.fd not in open_fds:
            raise _error(path, event.line, f"fd {event.fd} is used but the trace never opened it")
        if isinstance(event, Close):
            open_fds.discard(event.fd)
    elif isinstance(event, Dup):
        if event.fd not in open_fds:
            raise _error(path, event.line, f"dup of fd {event.fd}, which the trace never opened")
        open_fds.add(event.newfd)
