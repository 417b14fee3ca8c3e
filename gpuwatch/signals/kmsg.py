"""Xid lines from the kernel log: which process on which GPU caused which Xid.

NVIDIA's driver logs every Xid with the process it was running for (when it knows it):

    NVRM: Xid (PCI:0000:1b:00): 31, pid=4242, name=python3, Ch 0000000a, intr 00000000. MMU Fault ...
    NVRM: Xid (PCI:0000:1b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
    NVRM: Xid (PCI:0000:01:00): 79, pid=1122, GPU has fallen off the bus.      (older drivers)
    NVRM: Xid (0000:01:00): 13, Graphics Exception ...                         (oldest, no "PCI:")

NVML's Xid events carry no pid, so per-pod Xid attribution needs these lines.

`KmsgReader` follows one source, chosen by what the path is:
* a character device (``/dev/kmsg``): one record per ``read()`` in the kernel's record
  format ``<prio>,<seq>,<usec>,<flags>;<message>\\n`` (continuation lines start with a
  space and are ignored); opened non-blocking and positioned at the end, so an agent
  restart does not count old Xids again; ``EPIPE`` (records overwritten before we read
  them) is counted as lost and reading goes on;
* a regular file (the simulated node's ``<sim root>/kmsg``, or a copy of a log): new bytes
  since the last read, one line each, in the record format above or as plain dmesg /
  journal text. Reading starts at the end of the file as it is when the reader starts
  (from its beginning when the file did not exist yet then); a file that shrank (rotated
  or truncated) is read again from its start.

Each `poll()` reads at most `max_bytes_per_poll`, so a flood of kernel messages costs a
bounded amount per interval (the rest is read next interval). Lines that mention an Xid
but cannot be parsed are counted in `malformed_total`; everything else is ignored.

Only lines as the driver prints them count: ``NVRM: Xid`` at the **start** of the kernel
message (after a record prefix, a dmesg ``[ 12.345]`` stamp or a syslog ``... kernel:``
prefix) -- anyone who can get text into the kernel log (a USB product string, a filesystem
label) would otherwise forge Xids; such lines are counted in `misplaced_total`. The tail of
an over-long line is discarded up to its newline, never parsed as a line of its own. Each
record carries its age (from the record's timestamp, CLOCK_MONOTONIC like the kernel's) so
the collector can refuse to charge an Xid read long after it was logged to a pid.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DEFAULT_KMSG_PATH = "/dev/kmsg"

# "NVRM: Xid (PCI:0000:1b:00): 79, pid=1234, name=python3, ..." -- domain may be 4 or 8 hex
# digits, the function number may follow, pid may be a number or '<unknown>'.
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<domain>[0-9a-fA-F]{1,8}):(?P<bus>[0-9a-fA-F]{1,2}):(?P<device>[0-9a-fA-F]{1,2})"
    r"(?:\.[0-7])?\): (?P<xid>\d{1,5})"
    r"(?:, pid=(?:(?P<pid>\d{1,10})|'?<unknown>'?))?"
    r"(?:, name=(?P<name>[^,]{0,64}))?"
)
_RECORD_PREFIX_RE = re.compile(r"^\d+,\d+,(?P<usec>\d+),[^;]*;")
# where a driver line may start: a dmesg time stamp, a syslog/journal "... kernel:" prefix
_DRIVER_START_RE = re.compile(r"^(?:\[\s*\d+\.\d+\]\s*)?(?:[A-Z][a-z]{2} +\d{1,2} \d\d:\d\d:\d\d \S{1,64} kernel: "
                              r"(?:\[\s*\d+\.\d+\]\s*)?)?(?=NVRM: Xid )")
_MAX_LINE_CHARS = 8192


@dataclass(frozen=True)
class XidRecord:
    """One Xid the kernel logged: on which GPU (PCI address), which code, for which process."""

    pci_address: tuple[int, int, int]  # (domain, bus, device)
    xid: int
    pid: int | None  # host pid; None when the driver did not know the process
    process_name: str | None
    age_s: float | None = field(default=None, compare=False)  # since it was logged; None: unknown


def pci_address(bus_id: str | None) -> tuple[int, int, int] | None:
    """(domain, bus, device) of an NVML or kernel PCI bus id ("00000000:1B:00.0", "0000:1b:00")."""
    if not bus_id:
        return None
    parts = bus_id.strip().split(":")
    if len(parts) != 3:
        return None
    try:
        return int(parts[0], 16), int(parts[1], 16), int(parts[2].split(".")[0], 16)
    except ValueError:
        return None


def parse_xid_line(line: str) -> XidRecord | None:
    """The Xid in one kernel-log line; None when the line is not an NVRM Xid line.

    Only a line that starts as the driver prints it counts (module docstring): "NVRM: Xid"
    anywhere else in a line is not an Xid. Raises ValueError for a driver-shaped line that
    does not parse.
    """
    if "NVRM: Xid" not in line:
        return None
    start = _DRIVER_START_RE.match(line)
    if start is None:
        return None
    match = _XID_RE.match(line, start.end())
    if match is None:
        raise ValueError(f"unparsable Xid line: {line[:200]!r}")
    pid = match.group("pid")
    name = match.group("name")
    name = name.strip() if name is not None else None
    return XidRecord(
        pci_address=(int(match.group("domain"), 16), int(match.group("bus"), 16), int(match.group("device"), 16)),
        xid=int(match.group("xid")),
        pid=int(pid) if pid is not None and int(pid) > 0 else None,
        process_name=None if not name or name == "<unknown>" else name,
    )


def _message(line: str) -> tuple[str, int | None]:
    """(the message without its /dev/kmsg record prefix "6,123,456,-;", the record's usec)."""
    match = _RECORD_PREFIX_RE.match(line)
    if match is None:
        return line, None
    return line[match.end():], int(match.group("usec"))


def misplaced(line: str) -> bool:
    """Whether a line mentions an Xid somewhere a driver line cannot start (a forgery)."""
    message = _message(line)[0]
    return "NVRM: Xid" in message and _DRIVER_START_RE.match(message) is None


class KmsgReader:
    """Non-blocking, bounded reader of Xid records from /dev/kmsg or a log file."""

    def __init__(self, path: str = DEFAULT_KMSG_PATH, max_bytes_per_poll: int = 256 * 1024) -> None:
        self.path = path
        self.max_bytes_per_poll = max_bytes_per_poll
        self.malformed_total = 0
        self.misplaced_total = 0  # "NVRM: Xid" not where the driver prints it: not an Xid
        self.lost_records_total = 0  # /dev/kmsg records overwritten before we read them
        self.errors_total = 0
        self.last_error: str | None = None
        self._fd: int | None = None
        self._is_device = False
        self._offset = 0
        self._partial = b""
        self._skip_to_newline = False  # the rest of an over-long line is dropped, not parsed
        self._logged: set[str] = set()
        self._was_missing = False  # a file that appears later is read from its start
        self._open()

    # ---- lifecycle ----------------------------------------------------------------------

    def _open(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as err:
            if err.errno == errno.ENOENT:
                self._was_missing = True
            self._error(f"cannot open {self.path}: {err.strerror}; per-pod Xid attribution is off "
                        f"until it can be read (pass --kmsg PATH, or run as root)")
            return
        try:
            info = os.fstat(fd)
            self._is_device = stat.S_ISCHR(info.st_mode)
            if self._is_device:
                os.lseek(fd, 0, os.SEEK_END)  # /dev/kmsg: SEEK_END = after the last record
            elif stat.S_ISREG(info.st_mode):
                self._offset = 0 if self._was_missing else info.st_size
            else:
                os.close(fd)
                self._error(f"{self.path} is neither /dev/kmsg nor a regular file; per-pod Xid attribution is off")
                return
        except OSError as err:
            os.close(fd)
            self._error(f"cannot position {self.path}: {err.strerror}")
            return
        self._fd = fd

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    @property
    def available(self) -> bool:
        return self._fd is not None

    # ---- reading ------------------------------------------------------------------------

    def poll(self) -> list[XidRecord]:
        """Xid records logged since the last poll (bounded); never raises."""
        if self._fd is None:
            if not os.path.exists(self.path):
                return []
            self._open()  # the sim's file appears after the agent starts; a device comes back
            if self._fd is None:
                return []
        lines = self._read_device() if self._is_device else self._read_file()
        records: list[XidRecord] = []
        now_s = time.clock_gettime(time.CLOCK_MONOTONIC)  # the kernel's record clock
        for line in lines:
            message, usec = _message(line)
            try:
                record = parse_xid_line(message)
            except ValueError as err:
                self.malformed_total += 1
                self._log_once("malformed", f"kernel log: {err} (counted in gpuwatch_kmsg_malformed_lines_total)")
                continue
            if record is None:
                if "NVRM: Xid" in message:
                    self.misplaced_total += 1
                continue
            if usec is not None and usec / 1e6 <= now_s + 1.0:
                record = XidRecord(record.pci_address, record.xid, record.pid, record.process_name,
                                   age_s=max(0.0, now_s - usec / 1e6))
            records.append(record)
        return records

    def _read_device(self) -> list[str]:
        assert self._fd is not None
        lines: list[str] = []
        budget = self.max_bytes_per_poll
        while budget > 0:
            try:
                data = os.read(self._fd, _MAX_LINE_CHARS)
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno == errno.EPIPE:  # overwritten before we read them: go on from the oldest kept
                    self.lost_records_total += 1
                    continue
                if err.errno == errno.EINVAL:  # a record longer than our buffer: skip it
                    self.malformed_total += 1
                    continue
                self._error(f"reading {self.path}: {err.strerror}")
                self.close()
                break
            if not data:
                break
            budget -= len(data)
            lines.append(data.split(b"\n", 1)[0].decode(errors="replace"))
        return lines

    def _read_file(self) -> list[str]:
        assert self._fd is not None
        try:
            size = os.fstat(self._fd).st_size
            if size < self._offset:  # truncated or replaced in place: start over
                self._offset, self._partial = 0, b""
            if size == self._offset:
                return []
            data = os.pread(self._fd, min(size - self._offset, self.max_bytes_per_poll), self._offset)
        except OSError as err:
            self._error(f"reading {self.path}: {err.strerror}")
            self.close()
            return []
        self._offset += len(data)
        if self._skip_to_newline:  # still inside an over-long line: its tail is no line of its own
            newline = data.find(b"\n")
            if newline < 0:
                return []
            data, self._skip_to_newline = data[newline + 1:], False
        chunks = (self._partial + data).split(b"\n")
        self._partial = chunks.pop()  # an unfinished last line waits for its end
        if len(self._partial) > _MAX_LINE_CHARS:  # a runaway line: drop it up to its newline
            self._partial = b""
            self._skip_to_newline = True
            self.malformed_total += 1
        return [chunk.decode(errors="replace") for chunk in chunks if chunk]

    # ---- error accounting ---------------------------------------------------------------

    def _error(self, message: str) -> None:
        self.errors_total += 1
        self.last_error = message
        self._log_once(message, message)

    def _log_once(self, key: str, message: str) -> None:
        if key in self._logged or len(self._logged) > 64:
            return
        self._logged.add(key)
        log.warning("%s", message)
