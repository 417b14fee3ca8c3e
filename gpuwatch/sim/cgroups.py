"""Cgroup filesystem helpers for the simulated-container lab (gpuwatch/sim/runc.py).

Finds where the cgroup hierarchies are mounted (pure v2, or hybrid: v1 controllers plus a
v2 tree at /sys/fs/cgroup/unified) from /proc/self/mountinfo, and maps one cgroup path
(as written in the v2 line of /proc/<pid>/cgroup) to its directory in every hierarchy.
The lab uses it to create plain cgroups, list a container's pids and remove what it made.
The mountinfo path is injectable so the parser is unit-testable without root.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpuwatch.errors import SimError


@dataclass(frozen=True)
class CgroupMounts:
    """Mount points of the cgroup hierarchies on this host.

    `v2` is the cgroup2 mount (None when there is none); `v1` maps each v1 hierarchy's
    option string (e.g. "cpu", "name=systemd", "cpu,cpuacct") to its mount point.
    """

    v2: Path | None
    v1: dict[str, Path] = field(default_factory=dict)

    @property
    def pure_v2(self) -> bool:
        """True when only cgroup2 is mounted (no v1 hierarchies)."""
        return self.v2 is not None and not self.v1

    def v1_controller(self, controller: str) -> Path | None:
        """Mount point of the v1 hierarchy that carries `controller`, if any."""
        for options, mount in self.v1.items():
            if controller in options.split(","):
                return mount
        return None

    def v2_dir(self, cgroup_path: str) -> Path:
        """Directory of `cgroup_path` in the v2 tree."""
        if self.v2 is None:
            raise SimError(
                "no cgroup2 hierarchy is mounted",
                fix="mount cgroup2 (e.g. at /sys/fs/cgroup/unified) or boot with a v2 systemd",
            )
        return self.v2 / cgroup_path.lstrip("/")

    @property
    def roots(self) -> list[Path]:
        """Mount points of every hierarchy (v2 first)."""
        return ([self.v2] if self.v2 is not None else []) + list(self.v1.values())

    def all_dirs(self, cgroup_path: str) -> list[Path]:
        """Directories of `cgroup_path` in every hierarchy (v2 first, then v1)."""
        dirs = [self.v2 / cgroup_path.lstrip("/")] if self.v2 is not None else []
        dirs += [mount / cgroup_path.lstrip("/") for mount in self.v1.values()]
        return dirs


def parse_mountinfo(text: str) -> CgroupMounts:
    """Parse /proc/self/mountinfo text into the cgroup mount points it lists.

    Only hierarchies mounted at their root ("/" in the root field) are used; a bind of a
    sub-cgroup (as inside a container) would make host paths map wrongly.
    """
    v2: Path | None = None
    v1: dict[str, Path] = {}
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        if not sep:
            continue
        pre_fields, post_fields = pre.split(), post.split()
        if len(pre_fields) < 5 or len(post_fields) < 3:
            continue
        root, mount_point = pre_fields[3], Path(_unescape(pre_fields[4]))
        fstype, super_options = post_fields[0], post_fields[2]
        if root != "/":
            continue
        if fstype == "cgroup2" and v2 is None:
            v2 = mount_point
        elif fstype == "cgroup":
            names = [
                o
                for o in super_options.split(",")
                if o not in ("rw", "ro")
                and not o.startswith(("release_agent", "clone_children"))
                and o not in ("noprefix", "cpuset_v2_mode", "xattr", "favordynmods")
            ]
            if names:
                v1.setdefault(",".join(names), mount_point)
    return CgroupMounts(v2=v2, v1=v1)


def _unescape(path: str) -> str:
    """Undo mountinfo's octal escapes (\\040 for space...)."""
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def detect(mountinfo: str | Path = "/proc/self/mountinfo") -> CgroupMounts:
    """Cgroup mounts of this process's mount namespace."""
    return parse_mountinfo(Path(mountinfo).read_text())


def read_pids(directory: Path) -> list[int]:
    """Pids listed in `directory`/cgroup.procs ([] when the cgroup is gone)."""
    try:
        text = (directory / "cgroup.procs").read_text()
    except FileNotFoundError:
        return []
    return [int(token) for token in text.split()]


def make_dirs(directory: Path) -> list[Path]:
    """mkdir -p `directory`; return the directories that did not exist, deepest first."""
    created: list[Path] = []
    current = directory
    while not current.exists():
        created.append(current)
        current = current.parent
    for path in reversed(created):
        try:
            path.mkdir()
        except FileExistsError:
            continue  # raced with another creator: it exists, which is what we want
    return created


def remove_dir(directory: Path, timeout_s: float = 2.0) -> bool:
    """rmdir one cgroup directory; True when it is gone.

    Returns False (without raising) when the cgroup still has children or member tasks
    (EBUSY / ENOTEMPTY): someone else still uses it. A cgroup whose last task has just
    been reaped can report EBUSY for a moment, so that is retried until `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(directory)
            return True
        except FileNotFoundError:
            return True
        except OSError as err:
            if err.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                raise
            has_children = any(p.is_dir() for p in directory.iterdir())
            if has_children or read_pids(directory) or time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def kill_all(directory: Path) -> bool:
    """SIGKILL every process in a v2 cgroup via cgroup.kill; False when unsupported."""
    kill_file = directory / "cgroup.kill"
    if not kill_file.exists():
        return False
    try:
        kill_file.write_text("1")
    except FileNotFoundError:
        return True  # the cgroup vanished: nothing left to kill
    return True


def thaw(mounts: CgroupMounts, cgroup_path: str) -> None:
    """Thaw a cgroup in the v2 tree and the v1 freezer (whichever exist).

    A task frozen by the v1 freezer does not die from SIGKILL until thawed, so cleanup
    thaws first (an enforcer may have paused the container and not resumed it).
    """
    if mounts.v2 is not None:
        freeze_file = mounts.v2_dir(cgroup_path) / "cgroup.freeze"
        if freeze_file.exists():
            _write_if_present(freeze_file, "0")
    freezer = mounts.v1_controller("freezer")
    if freezer is not None:
        state_file = freezer / cgroup_path.lstrip("/") / "freezer.state"
        if state_file.exists():
            _write_if_present(state_file, "THAWED")


def _write_if_present(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except FileNotFoundError:
        return  # the cgroup was removed meanwhile: nothing to thaw


@contextlib.contextmanager
def tree_lock(mounts: CgroupMounts, exclusive: bool) -> Iterator[None]:
    """flock on the cgroup mount root, shared by creators, exclusive for parent removal.

    Labs in different processes share parent cgroups (/kubepods/burstable...). Without
    this, one lab can rmdir an empty parent just as another's runc is creating a pod
    cgroup inside it (runc then fails with ENOENT). Nothing is left on disk by the lock.
    """
    root = mounts.v2 or next(iter(mounts.v1.values()), None)
    if root is None:
        raise SimError("no cgroup hierarchy is mounted", fix="mount cgroup2 at /sys/fs/cgroup")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing the last fd of the open file releases the flock


# Extended attribute set on parent cgroups a lab caused (e.g. /kubepods/besteffort), so a
# lab in another process that finds them empty later knows it may remove them, while
# parents made by someone else (a real kubelet) are never touched.
CREATED_MARK = "trusted.gpuwatch-sim-created"


def mark_created(directory: Path) -> bool:
    """Tag a cgroup directory as made by the sim lab; False when xattrs are unsupported."""
    try:
        os.setxattr(directory, CREATED_MARK, b"1")
    except OSError as err:
        if err.errno in (errno.ENOTSUP, errno.EPERM, errno.ENOENT):
            return False
        raise
    return True


def is_marked_created(directory: Path) -> bool:
    """True when `mark_created` tagged this cgroup directory."""
    try:
        return os.getxattr(directory, CREATED_MARK) == b"1"
    except OSError as err:
        if err.errno in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT):
            return False
        raise
