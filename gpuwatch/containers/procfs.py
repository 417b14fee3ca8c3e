"""Readers for the few /proc/<pid> files identity needs: cgroup, stat, status.

The parsers are pure (text in, values out) and tolerate truncated or garbage input by
returning None/empty instead of raising; the readers return None when the pid is gone or
the file is unreadable. Nothing here caches: resolver.py does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class CgroupFile:
    """/proc/<pid>/cgroup parsed: the unified (v2) path and the v1 paths by controller."""

    unified: str | None
    v1: tuple[tuple[str, str], ...] = ()  # (controller or "name=systemd", path)


@dataclass(frozen=True)
class CgroupChoice:
    """The path that identifies a process and the hierarchy it came from.

    hierarchy is "" for the unified (v2) hierarchy, else the v1 controller it was read from.
    """

    path: str
    hierarchy: str
    unified: str | None


def parse_cgroup_file(text: str) -> CgroupFile:
    """Parse `hierarchy-id:controllers:path` lines; v2 is `0::/path`. Bad lines are skipped."""
    unified: str | None = None
    v1: list[tuple[str, str]] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if not path.startswith("/"):
            continue
        if hid == "0" and controllers == "":
            unified = path
        elif controllers:
            for ctrl in controllers.split(","):
                v1.append((ctrl, path))
    return CgroupFile(unified=unified, v1=tuple(v1))


# v1 hierarchies to consult, best first, when the unified path says nothing ("/").
_V1_PREFERENCE = ("name=systemd", "cpu", "cpuacct", "memory", "pids", "devices", "cpuset", "blkio", "freezer")


def choose_cgroup_path(cg: CgroupFile) -> CgroupChoice:
    """The path that identifies the process.

    Pure v2: the `0::` line. Hybrid: prefer the unified line (runc and systemd create the
    cgroup there too, and it is what bpf_get_current_cgroup_id() reports); when it is "/" or
    missing but a v1 hierarchy places the process deeper (runtimes that only manage v1),
    take name=systemd, else the v1 path shared by the most controllers.
    """
    if cg.unified not in (None, "/"):
        assert cg.unified is not None
        return CgroupChoice(cg.unified, "", cg.unified)
    deeper = [(c, p) for c, p in cg.v1 if p != "/"]
    if not deeper:
        return CgroupChoice(cg.unified or "/", "", cg.unified)
    by_ctrl = dict(deeper)
    counts: dict[str, int] = {}
    for _, p in deeper:
        counts[p] = counts.get(p, 0) + 1
    if "name=systemd" in by_ctrl:
        return CgroupChoice(by_ctrl["name=systemd"], "name=systemd", cg.unified)
    best = max(counts.items(), key=lambda kv: (kv[1], len(kv[0])))[0]
    for ctrl in _V1_PREFERENCE:
        if by_ctrl.get(ctrl) == best:
            return CgroupChoice(best, ctrl, cg.unified)
    ctrl = next(c for c, p in deeper if p == best)
    return CgroupChoice(best, ctrl, cg.unified)


class ProcStat(NamedTuple):
    """The /proc/<pid>/stat fields identity needs."""

    comm: str
    state: str  # R, S, D, Z (zombie), X (dead), ...
    start_ticks: int  # start time in clock ticks since boot: with the pid, a unique process key

    @property
    def exited(self) -> bool:
        return self.state in ("Z", "X", "x")


def parse_stat(text: str) -> ProcStat | None:
    """comm, state and start time from /proc/<pid>/stat, or None if garbled.

    comm may contain spaces and ')' so we split at the last ')'.
    """
    open_at = text.find("(")
    close_at = text.rfind(")")
    if open_at < 0 or close_at < open_at:
        return None
    fields = text[close_at + 2 :].split()
    # After comm: state(3) ppid(4) ... starttime is field 22 overall -> index 19 here.
    if len(fields) < 20:
        return None
    try:
        return ProcStat(text[open_at + 1 : close_at], fields[0], int(fields[19]))
    except ValueError:
        return None


def parse_status(text: str) -> tuple[str, tuple[int, ...]]:
    """(Name, NSpid list outermost..innermost) from /proc/<pid>/status; missing -> ("", ())."""
    name = ""
    nspid: tuple[int, ...] = ()
    for line in text.splitlines():
        if line.startswith("Name:"):
            name = line[5:].strip()
        elif line.startswith("NSpid:"):
            try:
                nspid = tuple(int(x) for x in line[6:].split())
            except ValueError:
                nspid = ()
            break  # NSpid comes after Name
    return name, nspid


def read_text(path: str) -> str | None:
    """File contents, or None when it is gone or unreadable (a pid can exit at any time)."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None
