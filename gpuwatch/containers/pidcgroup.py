"""pid -> cgroup: which cgroup a process is in, as a hierarchy path and as a cgroup id.

/proc/<pid>/cgroup prints paths relative to the reader's cgroup namespace; every path here is
first placed in its hierarchy (cgroupfs.CgroupMounts.absolute), then the line that says most
about who the process is chosen (procfs.choose_cgroup_path). The one place both the identity
resolver and the probes' fd seeding turn a pid into a cgroup.
"""

from __future__ import annotations

import os

from gpuwatch.containers.cgroup_path import normalize_path, parse_cgroup_path
from gpuwatch.containers.cgroupfs import CgroupMounts, cgroup_dir
from gpuwatch.containers.procfs import CgroupChoice, CgroupFile, choose_cgroup_path, parse_cgroup_file, read_text
from gpuwatch.core.model import ContainerIdentity


def placed_cgroup_file(cg: CgroupFile, mounts: CgroupMounts) -> CgroupFile:
    """The same file with every path placed in its hierarchy (namespace-relative paths that
    cannot be placed stay as they are, '..' included)."""
    unified = mounts.absolute(cg.unified, "") if cg.unified is not None else None
    return CgroupFile(unified=unified, v1=tuple((c, mounts.absolute(p, c)) for c, p in cg.v1))


def cgroup_choice(text: str, mounts: CgroupMounts) -> CgroupChoice:
    """The identifying cgroup path of a /proc/<pid>/cgroup text, placed in its hierarchy."""
    return choose_cgroup_path(placed_cgroup_file(parse_cgroup_file(text), mounts))


def identity_of_cgroup_file(text: str, mounts: CgroupMounts | None = None) -> ContainerIdentity:
    """Who a process is, from its /proc/<pid>/cgroup text alone (no runtime metadata, no
    cgroup id): what the resolver starts from. Without mounts, paths stay as printed."""
    choice = cgroup_choice(text, mounts if mounts is not None else CgroupMounts())
    return parse_cgroup_path(normalize_path(choice.path))


def unified_path_of_pid(pid: int, mounts: CgroupMounts, proc_root: str = "/proc") -> str | None:
    """v2 hierarchy path of a process (None: gone, or no v2 line)."""
    text = read_text(f"{proc_root.rstrip('/')}/{pid}/cgroup")
    if text is None:
        return None
    unified = parse_cgroup_file(text).unified
    return mounts.absolute(unified, "") if unified is not None else None


def cgroup_id_of_pid(pid: int, mounts: CgroupMounts, proc_root: str = "/proc") -> int | None:
    """cgroup v2 id (the directory's inode, what bpf_get_current_cgroup_id returns) of a
    process; None when it is gone, has no v2 cgroup, or its cgroup is not visible here."""
    path = unified_path_of_pid(pid, mounts, proc_root)
    root = mounts.unified
    if path is None or root is None or ".." in path.split("/"):
        return None
    try:
        return os.stat(cgroup_dir(root, path)).st_ino
    except OSError:
        return None
