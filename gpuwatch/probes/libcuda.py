"""Find every copy of libcuda on the node that a uprobe should be attached to.

Sources: the explicit configured paths (or, when none are configured, the ld cache via
`ldconfig -p`), /proc/<pid>/maps of processes that have libcuda mapped (paths are opened
through /proc/<pid>/root, so a container's own copy is found in its root filesystem), and
the usual library directories inside container root filesystems (/proc/<pid>/root). Copies
are deduplicated by (st_dev, st_ino): a uprobe is per inode, so one attachment serves every
process and container that maps that file. Only regular files are kept (stat, never open):
BCC opens what it attaches to, and a container could plant a FIFO or a device under that name.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

LIB_PREFIX = "libcuda.so"
CONTAINER_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib/x86_64-linux-gnu",
                      "/lib64", "/usr/local/cuda/compat", "/usr/local/nvidia/lib64")


@dataclass(frozen=True)
class LibraryCopy:
    """One file (inode) holding libcuda, and a path through which it can be opened now."""

    path: str
    dev: int
    ino: int

    @property
    def inode_key(self) -> tuple[int, int]:
        return (self.dev, self.ino)


def ld_cache_paths(name_prefix: str = LIB_PREFIX) -> list[str]:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10,
                             check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    paths = []
    for line in out.splitlines():
        name, _, target = line.strip().partition(" => ")
        if name.split(" ", 1)[0].startswith(name_prefix) and target:
            paths.append(target.strip())
    return paths


def _pids(proc_root: Path, only: Iterable[int] | None = None) -> Iterable[str]:
    if only is not None:
        return [str(p) for p in only]
    try:
        return [p for p in os.listdir(proc_root) if p.isdigit()]
    except OSError:
        return []


def mapped_paths(proc_root: Path = Path("/proc"), name_prefix: str = LIB_PREFIX,
                 pids: Iterable[int] | None = None) -> list[str]:
    """Paths (via /proc/<pid>/root) of libcuda copies mapped by running processes (all, or
    only `pids`)."""
    found: dict[str, str] = {}
    for pid in _pids(proc_root, pids):
        try:
            text = (proc_root / pid / "maps").read_text(errors="replace")
        except OSError:
            continue  # exited or not readable
        for line in text.splitlines():
            parts = line.split(None, 5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue
            path = parts[5].removesuffix(" (deleted)")
            if os.path.basename(path).startswith(name_prefix) and path not in found:
                found[path] = f"{proc_root}/{pid}/root{path}"
    return list(dict.fromkeys(found.values()))


def container_root_paths(proc_root: Path = Path("/proc"), name_prefix: str = LIB_PREFIX,
                         pids: Iterable[int] | None = None) -> list[str]:
    """libcuda copies in the root filesystems of processes (all, or only `pids`) whose root
    is not ours."""
    try:
        own = os.stat(proc_root / "self" / "root")
    except OSError:
        return []
    seen_roots: set[tuple[int, int]] = {(own.st_dev, own.st_ino)}
    paths: list[str] = []
    for pid in _pids(proc_root, pids):
        root = proc_root / pid / "root"
        try:
            st = os.stat(root)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in seen_roots:
            continue
        seen_roots.add((st.st_dev, st.st_ino))
        for libdir in CONTAINER_LIB_DIRS:
            try:
                names = os.listdir(f"{root}{libdir}")
            except OSError:
                continue
            paths.extend(f"{root}{libdir}/{n}" for n in names if n.startswith(name_prefix))
    return paths


def discover(configured: Iterable[str] = (), proc_root: Path = Path("/proc"),
             name_prefix: str = LIB_PREFIX, pids: Iterable[int] | None = None,
             use_ld_cache: bool = True, root_pids: Iterable[int] | None = None,
             roots_of_all: bool = False) -> list[LibraryCopy]:
    """Distinct libcuda inodes reachable now, first path wins: the configured paths (or the
    ld cache when none are configured and use_ld_cache), then the copies mapped by `pids`
    (None: every process; reading every process's maps is the expensive part) and those in
    the root filesystems of `root_pids` (default: `pids`; roots_of_all: every process,
    cheap: one stat per process, one listing per distinct root)."""
    configured = list(configured)
    pid_list = None if pids is None else list(pids)
    roots = None if roots_of_all else (pid_list if root_pids is None else list(root_pids))
    base = configured or (ld_cache_paths(name_prefix) if use_ld_cache else [])
    candidates = [*base, *mapped_paths(proc_root, name_prefix, pid_list),
                  *container_root_paths(proc_root, name_prefix, roots)]
    copies: dict[tuple[int, int], LibraryCopy] = {}
    for path in candidates:
        try:
            st = os.stat(path)  # no open: a device planted as "libcuda.so" in a container is never opened
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue  # BCC would open it to read symbols (a FIFO blocks, a watchdog device arms)
        key = (st.st_dev, st.st_ino)
        if key not in copies:
            copies[key] = LibraryCopy(path=path, dev=st.st_dev, ino=st.st_ino)
    return list(copies.values())
