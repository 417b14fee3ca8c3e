"""A fixture /proc/<pid>/status: the file rights gpuwatch/core/containerfile.py reads a container's
files with (Uid/Gid 4th field, Groups, CapEff). By default this test process's own."""

from __future__ import annotations

import os
from pathlib import Path


def write_status(pid_dir: Path, uid: int | None = None, gid: int | None = None,
                 groups: tuple[int, ...] = (), cap_effective: int = (1 << 41) - 1) -> None:
    """Write <pid_dir>/status as the kernel does (only the lines the reader uses)."""
    uid = os.geteuid() if uid is None else uid
    gid = os.getegid() if gid is None else gid
    (pid_dir / "status").write_text(
        f"Name:\tjob\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t{gid}\t{gid}\t{gid}\t{gid}\n"
        f"Groups:\t{' '.join(map(str, groups))} \nCapEff:\t{cap_effective:016x}\n")
