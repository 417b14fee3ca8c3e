"""Where the cgroup hierarchies are mounted, and the cgroup id <-> path index.

A cgroup id (what bpf_get_current_cgroup_id() returns) is the inode number of the cgroup's
directory in the v2 (unified) hierarchy. We find that hierarchy in /proc/self/mountinfo:
/sys/fs/cgroup on pure v2 hosts, /sys/fs/cgroup/unified on hybrid ones.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuwatch.containers.procfs import read_text


@dataclass(frozen=True)
class CgroupMounts:
    """The v2 mount point (None if absent) and v1 mount points by controller."""

    unified: str | None
    v1: dict[str, str] = field(default_factory=dict)


def _unescape(s: str) -> str:
    r"""mountinfo escapes space, tab, newline and backslash as \ooo octal."""
    if "\\" not in s:
        return s
    out = []
    i = 0
    while i < len(s):
        if s[i] == "\\" and i + 4 <= len(s) and s[i + 1 : i + 4].isdigit():
            out.append(chr(int(s[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> CgroupMounts:
    """cgroup mounts from /proc/<pid>/mountinfo text; malformed lines are skipped.

    Format: id parent major:minor root mountpoint options [optional...] - fstype source super.
    Only mounts of the hierarchy's root (root field "/") are used.
    """
    unified: str | None = None
    v1: dict[str, str] = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        lf = left.split()
        rf = right.split()
        if len(lf) < 5 or len(rf) < 3:
            continue
        root, mountpoint = lf[3], _unescape(lf[4])
        fstype, super_opts = rf[0], rf[2]
        if root != "/":
            continue
        if fstype == "cgroup2":
            if unified is None:
                unified = mountpoint
        elif fstype == "cgroup":
            for opt in super_opts.split(","):
                if opt in ("rw", "ro") or opt.startswith("release_agent") or opt == "clone_children":
                    continue
                v1.setdefault(opt, mountpoint)
    return CgroupMounts(unified=unified, v1=v1)


def discover_mounts(proc_root: str = "/proc") -> CgroupMounts:
    """cgroup mounts as this process sees them (empty when mountinfo is unreadable)."""
    text = read_text(os.path.join(proc_root, "self", "mountinfo"))
    return parse_mountinfo(text) if text is not None else CgroupMounts(unified=None)


def cgroup_dir(mount: str, path: str) -> str:
    """Filesystem directory of a cgroup path under a hierarchy's mount point."""
    return mount.rstrip("/") + path if path != "/" else mount


class CgroupIdIndex:
    """cgroup id <-> path for the v2 hierarchy, filled lazily and by tree walks.

    `id_for_path` stats one directory. `path_for_id` answers from the index and, on a miss,
    walks the whole tree again, at most once per `rescan_min_interval_s` so a stream of
    unknown ids (short-lived cgroups) cannot turn into a stream of tree walks.
    """

    def __init__(
        self,
        unified_root: str | None,
        clock: Callable[[], float],
        rescan_min_interval_s: float = 2.0,
    ) -> None:
        self.unified_root = unified_root
        self._clock = clock
        self._rescan_min_interval_s = rescan_min_interval_s
        self._by_id: dict[int, str] = {}
        self._by_path: dict[str, int] = {}
        self._last_scan_s: float | None = None
        self.scans = 0

    def id_for_path(self, path: str) -> int | None:
        """Inode of <v2 mount><path>, or None without a v2 mount or if the dir is absent."""
        if self.unified_root is None or "/.." in path:
            # ".." means the cgroup lies outside our cgroup namespace: no dir of ours names it
            return None
        try:
            ino = os.stat(cgroup_dir(self.unified_root, path)).st_ino
        except OSError:
            self.forget(path)
            return None
        old = self._by_path.get(path)
        if old is not None and old != ino:
            self._by_id.pop(old, None)  # recreated under the same name: a new cgroup
        self._by_path[path] = ino
        self._by_id[ino] = path
        return ino

    def path_for_id(self, cgroup_id: int) -> str | None:
        """Path of a cgroup id, rescanning the tree on a miss (rate-limited)."""
        path = self._by_id.get(cgroup_id)
        if path is not None:
            return path
        now = self._clock()
        if self._last_scan_s is not None and now - self._last_scan_s < self._rescan_min_interval_s:
            return None
        self.rescan()
        return self._by_id.get(cgroup_id)

    def rescan(self) -> None:
        """Walk the v2 tree and rebuild the index (gone cgroups drop out)."""
        self._last_scan_s = self._clock()
        self.scans += 1
        if self.unified_root is None:
            return
        by_id: dict[int, str] = {}
        root = self.unified_root.rstrip("/") or "/"
        try:
            by_id[os.stat(root).st_ino] = "/"
        except OSError:
            self._by_id, self._by_path = {}, {}
            return
        stack = [(root, "")]
        while stack:
            fs_dir, rel = stack.pop()
            try:
                with os.scandir(fs_dir) as it:
                    for entry in it:
                        if not entry.is_dir(follow_symlinks=False):
                            continue
                        sub = f"{rel}/{entry.name}"
                        try:
                            by_id[entry.inode()] = sub
                        except OSError:
                            continue
                        stack.append((entry.path, sub))
            except OSError:
                continue  # removed while walking, or unreadable: skip that subtree
        self._by_id = by_id
        self._by_path = {p: i for i, p in by_id.items()}

    def forget(self, path: str) -> None:
        ino = self._by_path.pop(path, None)
        if ino is not None and self._by_id.get(ino) == path:
            del self._by_id[ino]

    def __len__(self) -> int:
        return len(self._by_id)
