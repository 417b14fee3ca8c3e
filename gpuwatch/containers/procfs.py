"""Readers for the few /proc/<pid> files identity needs: cgroup, stat, status.

The parsers are pure (text in, values out) and tolerate truncated or garbage input by
returning None/empty instead of raising; the readers return None when the pid is gone or
the file is unreadable. Nothing here caches: resolver.py does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from gpuwatch.containers.cgroup_path import parse_cgroup_path
from gpuwatch.core.model import HOST_IDENTITY


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
    """Parse `hierarchy-id:controllers:path` lines; v2 is `0::/path`. Bad lines are skipped.

    A v1 line with an empty controller field (`13::/docker/<id>`, seen in some dumps) is
    kept under the hierarchy name "#<id>". Paths relative to another cgroup namespace
    (`/../../x`, which some tools print without the leading slash: `../../x`) are kept.
    """
    unified: str | None = None
    v1: list[tuple[str, str]] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if path.startswith(".."):
            path = "/" + path
        if not path.startswith("/"):
            continue
        if hid == "0" and controllers == "":
            unified = path
        elif controllers:
            for ctrl in controllers.split(","):
                v1.append((ctrl, path))
        elif hid.isdigit():
            v1.append((f"#{hid}", path))
    return CgroupFile(unified=unified, v1=tuple(v1))


# v1 hierarchies to consult, best first, when several name the process equally well.
_V1_PREFERENCE = ("name=systemd", "cpu", "cpuacct", "memory", "pids", "devices", "cpuset", "blkio", "freezer")


_parse_path = parse_cgroup_path.__wrapped__  # uncached: the resolver's path cache is the cache


def identity_rank(path: str) -> int:
    """How much a cgroup path says about who a process is: 3 a container, 2 a pod-level
    cgroup, 1 anything else below the root (a unit, a session, an unknown cgroup), 0 the root."""
    if path.strip("/. ") == "":
        return 0
    ident = _parse_path(path)
    if ident.container_id:
        return 3
    if ident.pod_uid or ident.pod_name:  # a pod-level cgroup, or a Slurm job's
        return 2
    return 0 if ident == HOST_IDENTITY else 1


def choose_cgroup_path(cg: CgroupFile) -> CgroupChoice:
    """The path that identifies the process, judged from every line of the file.

    The unified (`0::`) line wins unless a v1 line says more (it is what
    bpf_get_current_cgroup_id() reports): a hybrid host whose runtime manages v1 only shows
    `0::/system.slice/containerd.service` (or `0::/`) while the v1 controllers name the
    pod's container, and that container is who the process is. Among v1 lines that say
    equally much: name=systemd, else the path shared by the most controllers.
    """
    unified_rank = identity_rank(cg.unified) if cg.unified is not None else -1
    if unified_rank == 3:  # the unified line names a container: nothing can say more
        assert cg.unified is not None
        return CgroupChoice(cg.unified, "", cg.unified)
    ranks: dict[str, int] = {}  # v1 lines mostly repeat one path: judge each path once
    for _, p in cg.v1:
        if p not in ranks:
            ranks[p] = identity_rank(p)
    ranked = [(ranks[p], c, p) for c, p in cg.v1]
    best_rank = max((r for r, _, _ in ranked), default=-1)
    if cg.unified is not None and unified_rank >= best_rank:
        return CgroupChoice(cg.unified, "", cg.unified)
    if best_rank <= 0:
        return CgroupChoice(cg.unified or "/", "", cg.unified)
    best = [(c, p) for r, c, p in ranked if r == best_rank]
    by_ctrl = dict(best)
    if "name=systemd" in by_ctrl:
        return CgroupChoice(by_ctrl["name=systemd"], "name=systemd", cg.unified)
    counts: dict[str, int] = {}
    for _, p in best:
        counts[p] = counts.get(p, 0) + 1
    path = max(counts.items(), key=lambda kv: (kv[1], len(kv[0])))[0]
    for ctrl in _V1_PREFERENCE:
        if by_ctrl.get(ctrl) == path:
            return CgroupChoice(path, ctrl, cg.unified)
    ctrl = next(c for c, p in best if p == path)
    return CgroupChoice(path, ctrl, cg.unified)


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


def parse_uid(text: str) -> int | None:
    """The real uid (first field of `Uid:`) from /proc/<pid>/status; None if missing."""
    for line in text.splitlines():
        if line.startswith("Uid:"):
            fields = line[4:].split()
            return int(fields[0]) if fields and fields[0].isdigit() else None
    return None


def read_text(path: str) -> str | None:
    """File contents, or None when it is gone or unreadable (a pid can exit at any time)."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None
