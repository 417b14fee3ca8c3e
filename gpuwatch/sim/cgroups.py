"""Cgroup filesystem helpers for the simulated-container lab (gpuwatch/sim/runc.py).

Where the hierarchies are mounted and which directory a cgroup path names in each comes
from the one cgroup layer (gpuwatch/containers/cgroupfs.py, re-exported here for the lab);
this module adds what only the lab does: create plain cgroups, list a container's pids,
kill, thaw and remove what it made, and a lock shared by labs in other processes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from gpuwatch.containers.cgroupfs import CgroupMounts, discover_mounts, parse_mountinfo
from gpuwatch.core.errors import SimError

__all__ = [
    "CREATED_MARK", "CgroupMounts", "detect", "is_marked_created", "kill_all", "make_dirs", "mark_created",
    "parse_mountinfo", "read_pids", "remove_dir", "thaw", "tree_lock",
]


def detect() -> CgroupMounts:
    """Cgroup hierarchies of this process (containers/cgroupfs.py: the one place that reads
    mountinfo, cgroup namespaces included)."""
    return discover_mounts()


def read_pids(directory: Path) -> list[int]:
    """Pids listed in `directory`/cgroup.procs ([] when the cgroup is gone: ENOENT, or ENODEV
    while the kernel is still destroying it -- a container removed between two looks)."""
    try:
        text = (directory / "cgroup.procs").read_text()
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENODEV):
            return []
        raise
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
