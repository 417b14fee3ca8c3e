"""Which cgroup ids still exist: for dropping the kernel counters of removed cgroups.

The per-cgroup maps are bounded; on a node where short-lived containers come and go, the
counters of removed cgroups would otherwise fill them. A cgroup id is the inode number of its
cgroup v2 directory, so the live ids are the inode numbers of the directories under the v2
mount. Inode numbers of kernfs are allocated cyclically, so a removed id is not handed to a
new cgroup soon after.
"""

from __future__ import annotations

import os
from pathlib import Path


def cgroup2_mount(mounts: Path = Path("/proc/self/mounts")) -> Path | None:
    for line in mounts.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            return Path(parts[1])
    return None


def live_cgroup_ids(root: Path) -> set[int]:
    """Inode numbers of `root` and every directory below it."""
    ids: set[int] = set()
    stack = [str(root)]
    try:
        ids.add(os.stat(root).st_ino)
    except OSError:
        return ids
    while stack:
        path = stack.pop()
        try:
            with os.scandir(path) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        ids.add(entry.inode())
                        stack.append(entry.path)
        except OSError:
            continue  # removed while we walked: its id is gone too
    return ids
