"""gpuwatch's freeze marker: the truth about what an agent froze, kept on the cgroup itself.

Before the enforcer freezes a cgroup (pause, or the duty cycle of a throttle) it sets an
extended attribute on the cgroup directory it freezes -- `trusted.gpuwatch.frozen` in the
v2 tree (cgroup.freeze) or the v1 freezer tree (freezer.state) -- and removes it after the
thaw. cgroupfs (kernfs) accepts `trusted.*` (root with CAP_SYS_ADMIN: no container can set,
forge or remove it) and `user.*` xattrs on both v1 and v2 on this kernel (6.x); the marker
goes with the directory when the cgroup is removed, so it can never outlive what it marks.
Without CAP_SYS_ADMIN the store falls back to `user.gpuwatch.frozen` (a cgroup's delegated
owner could forge that one; the state file journal still works as before).

The value (small JSON) names the owner: pid, its start time (pid reuse), its pid namespace
and the node lock it held. On start the agent scans both trees (`scan()`) and thaws every
marked cgroup whose owner is gone -- whatever the state file says -- and leaves alone the
ones a live agent holds (`classify()`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

TRUSTED_NAME = "trusted.gpuwatch.frozen"
USER_NAME = "user.gpuwatch.frozen"
MAX_MARKER_BYTES = 1024
_REASON_CHARS = 200
CAP_SYS_ADMIN = 21

MINE = "mine"
STALE = "stale"
LIVE_OTHER = "live-other"
UNKNOWN_OTHER = "unknown-other"


def _start_ticks(pid: int, proc_root: str = "/proc") -> int | None:
    """Start time of a process in clock ticks since boot (field 22 of stat), None if gone."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _pid_namespace(proc_root: str = "/proc") -> str | None:
    try:
        return os.readlink(f"{proc_root}/self/ns/pid")
    except OSError:
        return None


@dataclass(frozen=True)
class MarkerOwner:
    """Who set a marker: enough to tell later whether it is still alive."""

    pid: int
    start_ticks: int | None
    pidns: str | None
    lock: str | None
    """The node lock the owner held (None: an enforcer run without the agent's lock)."""

    @classmethod
    def current(cls, lock: str | os.PathLike[str] | None = None, proc_root: str = "/proc") -> MarkerOwner:
        pid = os.getpid()
        return cls(pid, _start_ticks(pid, proc_root), _pid_namespace(proc_root),
                   os.path.abspath(lock) if lock is not None else None)

    def alive(self, proc_root: str = "/proc") -> bool:
        started = _start_ticks(self.pid, proc_root)
        return started is not None and (self.start_ticks is None or started == self.start_ticks)

    def describe(self) -> str:
        lock = f", lock {self.lock}" if self.lock else ""
        return f"pid {self.pid}{lock}"


@dataclass(frozen=True)
class Marker:
    owner: MarkerOwner
    mechanism: str
    reason: str = ""
    since_s: float = 0.0

    def encode(self) -> bytes:
        data = {"v": 1, "pid": self.owner.pid, "start": self.owner.start_ticks, "pidns": self.owner.pidns,
                "lock": self.owner.lock, "mechanism": self.mechanism, "reason": self.reason[:_REASON_CHARS],
                "since_s": round(self.since_s, 3)}
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Marker | None:
        """The marker, or None when the value is not one gpuwatch wrote (still a marker:
        callers treat it as stale)."""
        try:
            data = json.loads(raw[:MAX_MARKER_BYTES])
            pid = data["pid"]
            start = data.get("start")
            if not isinstance(pid, int) or not (start is None or isinstance(start, int)):
                return None
            pidns, lock = data.get("pidns"), data.get("lock")
            owner = MarkerOwner(pid, start, pidns if isinstance(pidns, str) else None,
                                lock if isinstance(lock, str) else None)
            since = data.get("since_s", 0.0)
            return cls(owner, str(data.get("mechanism", "")), str(data.get("reason", "")),
                       float(since) if isinstance(since, int | float) else 0.0)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


def classify(marker: Marker | None, me: MarkerOwner, proc_root: str = "/proc") -> str:
    """MINE, STALE (its owner is gone: thaw it), LIVE_OTHER (another running agent holds it)
    or UNKNOWN_OTHER (an owner in another pid namespace: cannot tell, leave it)."""
    if marker is None:
        return STALE
    owner = marker.owner
    if (owner.pid, owner.start_ticks, owner.pidns) == (me.pid, me.start_ticks, me.pidns):
        return MINE
    if me.lock is not None and owner.lock == me.lock:
        return STALE  # this agent holds that node lock now: whoever set it has exited
    if owner.pidns != me.pidns:
        return UNKNOWN_OTHER
    return LIVE_OTHER if owner.alive(proc_root) else STALE


class MarkerStore(Protocol):
    """Raw marker values on cgroup directories (xattrs on a real host, a dict in unit tests)."""

    def get(self, directory: Path) -> bytes | None: ...

    def set(self, directory: Path, value: bytes) -> None: ...

    def remove(self, directory: Path) -> None: ...


def _has_cap_sys_admin() -> bool:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


class XattrMarkers:
    """Markers as an extended attribute on the cgroup directory (trusted.*, else user.*)."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or (TRUSTED_NAME if _has_cap_sys_admin() else USER_NAME)

    def get(self, directory: Path) -> bytes | None:
        try:
            return os.getxattr(directory, self.name, follow_symlinks=False)
        except OSError as err:
            if err.errno in (errno.ENODATA, errno.ENOENT, errno.ENOTSUP, errno.EPERM, errno.EACCES):
                return None
            raise

    def set(self, directory: Path, value: bytes) -> None:
        try:
            os.setxattr(directory, self.name, value, follow_symlinks=False)
        except OSError as err:
            if err.errno != errno.EPERM or self.name != TRUSTED_NAME:
                raise
            log.warning("cannot set %s (no CAP_SYS_ADMIN in this user namespace): freeze markers use %s, "
                        "which a cgroup's delegated owner could forge", TRUSTED_NAME, USER_NAME)
            self.name = USER_NAME
            os.setxattr(directory, self.name, value, follow_symlinks=False)

    def remove(self, directory: Path) -> None:
        try:
            os.removexattr(directory, self.name, follow_symlinks=False)
        except OSError as err:
            if err.errno not in (errno.ENODATA, errno.ENOENT):
                raise


def scan(root: Path, store: MarkerStore) -> Iterator[tuple[str, bytes]]:
    """(cgroup path, raw marker) for every marked cgroup below `root` (the root itself is
    never a target). Directories that vanish during the walk are skipped."""
    stack = [root]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as entries:
                subdirs = [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for sub in subdirs:
            try:
                raw = store.get(sub)
            except OSError as err:
                log.debug("cannot read the freeze marker of %s: %s", sub, err)
                raw = None
            if raw is not None:
                yield "/" + str(sub.relative_to(root)), raw
        stack.extend(sorted(subdirs, reverse=True))
