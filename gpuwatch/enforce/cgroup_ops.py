"""Cgroup file operations the actions need: list pids, freeze/thaw, kill, CPU time.

Works on pure cgroup v2 hosts and on hybrid hosts (v1 controllers + v2 at
/sys/fs/cgroup/unified). A container's processes may live in the v2 tree, the v1 freezer
tree, or both; `CgroupHandle` uses the v2 files (`cgroup.freeze`, `cgroup.kill`) when the
v2 directory holds the processes and falls back to the v1 freezer (`freezer.state`
FROZEN/THAWED) and SIGKILL otherwise. Roots are injectable for tests.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.containers import cgroupfs
from gpuwatch.containers.cgroupfs import CgroupMounts, discover_mounts
from gpuwatch.core.errors import EnforcementError

V2 = "v2"
V1_FREEZER = "v1-freezer"
FREEZE_TIMEOUT_S = 2.0


def detect_roots(mounts: CgroupMounts | None = None) -> tuple[Path | None, Path | None]:
    """(v2 mount, v1 freezer mount) of this host (containers/cgroupfs.py finds them)."""
    found = mounts if mounts is not None else discover_mounts()
    return found.v2, found.v1_controller("freezer")


def normalise_cgroup_path(cgroup_path: str) -> str:
    """`/a/b` for a container's cgroup path; EnforcementError for the root or a `..` path."""
    return _normalise(cgroup_path)


def _normalise(cgroup_path: str) -> str:
    path = "/" + cgroup_path.strip().strip("/")
    if path == "/":
        raise EnforcementError(
            f"refusing to act on cgroup path {cgroup_path!r}",
            fix="enforcement targets must be a container's own cgroup, never the root",
        )
    if ".." in Path(path).parts:
        raise EnforcementError(
            f"refusing to act on cgroup path {cgroup_path!r}: it lies outside the agent's cgroup namespace, "
            "which could not be placed in the host's hierarchy",
            fix="mount the host's cgroup tree into the agent (hostPath /sys/fs/cgroup) or run it in the host "
                "cgroup namespace; `gpuwatch doctor` shows what it found",
        )
    return path


def _read_pids(directory: Path) -> list[int]:
    """All pids in a cgroup directory and its descendants (missing dirs -> [])."""
    pids: list[int] = []
    for current, dirs, _files in os.walk(directory):
        try:
            text = (Path(current) / "cgroup.procs").read_text()
        except FileNotFoundError:
            continue
        except OSError as err:
            if err.errno in (errno.ENODEV, errno.ENOENT):
                continue
            raise
        pids.extend(int(x) for x in text.split())
        dirs.sort()
    return sorted(set(pids))


@dataclass(frozen=True)
class CgroupHandle:
    """One target cgroup, resolved on one host's cgroup trees."""

    cgroup_path: str
    v2_dir: Path | None
    v1_freezer_dir: Path | None
    v1_cpuacct_dir: Path | None = None

    def exists(self) -> bool:
        return bool((self.v2_dir and self.v2_dir.is_dir()) or (self.v1_freezer_dir and self.v1_freezer_dir.is_dir()))

    def pids(self) -> list[int]:
        found: set[int] = set()
        for directory in (self.v2_dir, self.v1_freezer_dir):
            if directory is not None and directory.is_dir():
                found.update(_read_pids(directory))
        return sorted(found)

    def mechanism(self) -> str:
        """Which freezer to use: the tree that actually holds the processes, v2 first."""
        v2_ok = self.v2_dir is not None and (self.v2_dir / "cgroup.freeze").exists()
        v1_ok = self.v1_freezer_dir is not None and (self.v1_freezer_dir / "freezer.state").exists()
        if v2_ok and self.v2_dir is not None and _read_pids(self.v2_dir):
            return V2
        if v1_ok and self.v1_freezer_dir is not None and _read_pids(self.v1_freezer_dir):
            return V1_FREEZER
        if v2_ok:
            return V2
        if v1_ok:
            return V1_FREEZER
        raise EnforcementError(
            f"cgroup {self.cgroup_path} not found in the v2 or v1 freezer tree",
            fix="the container may have exited; check `ls /sys/fs/cgroup/unified"
            f"{self.cgroup_path}` and /sys/fs/cgroup/freezer{self.cgroup_path}",
        )

    def set_frozen(self, frozen: bool, mechanism: str | None = None, wait_s: float = FREEZE_TIMEOUT_S) -> str:
        """Freeze or thaw; returns the mechanism used. Waits until the kernel reports it done."""
        mech = mechanism or self.mechanism()
        deadline = time.monotonic() + wait_s
        if mech == V2 and self.v2_dir is not None:
            _write(self.v2_dir / "cgroup.freeze", "1" if frozen else "0")
            if frozen:
                while time.monotonic() < deadline and not self._v2_frozen():
                    time.sleep(0.001)
            return mech
        if self.v1_freezer_dir is None:
            raise EnforcementError(f"no freezer for {self.cgroup_path}", fix="mount the v1 freezer or use cgroup v2")
        state = self.v1_freezer_dir / "freezer.state"
        _write(state, "FROZEN" if frozen else "THAWED")
        want = "FROZEN" if frozen else "THAWED"
        while time.monotonic() < deadline and state.read_text().strip() != want:
            time.sleep(0.001)
            if frozen:
                _write(state, "FROZEN")
        return mech

    def _v2_frozen(self) -> bool:
        assert self.v2_dir is not None
        try:
            events = (self.v2_dir / "cgroup.events").read_text()
        except FileNotFoundError:
            return True
        return "frozen 1" in events

    def is_frozen(self) -> bool:
        v2_freeze = self.v2_dir / "cgroup.freeze" if self.v2_dir is not None else None
        if v2_freeze is not None and v2_freeze.exists() and v2_freeze.read_text().strip() == "1":
            return True
        if self.v1_freezer_dir is not None and (self.v1_freezer_dir / "freezer.state").exists():
            return (self.v1_freezer_dir / "freezer.state").read_text().strip() != "THAWED"
        return False

    def signal_all(self, signum: int) -> list[int]:
        """Send a signal to every process; returns the pids it reached."""
        reached = []
        for pid in self.pids():
            try:
                os.kill(pid, signum)
                reached.append(pid)
            except ProcessLookupError:
                continue
        return reached

    def kill(self) -> str:
        """Kill every process: v2 `cgroup.kill` when it holds them, else freeze + SIGKILL + thaw."""
        mech = self.mechanism()
        if mech == V2 and self.v2_dir is not None and (self.v2_dir / "cgroup.kill").exists():
            _write(self.v2_dir / "cgroup.kill", "1")
            return "cgroup.kill"
        # No race with fork: freeze first, kill everything, thaw so SIGKILL is delivered.
        self.set_frozen(True, mech)
        for _ in range(5):
            if not self.signal_all(signal.SIGKILL):
                break
        self.set_frozen(False, mech)
        return "sigkill"

    def wait_empty(self, timeout_s: float, sleep: Callable[[float], None] = time.sleep) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.pids():
                return True
            sleep(0.01)
        return not self.pids()

    def cpu_seconds(self) -> float:
        """CPU time of the cgroup (v2 cpu.stat usage_usec, or v1 cpuacct.usage)."""
        if self.v2_dir is not None and (self.v2_dir / "cpu.stat").exists():
            for line in (self.v2_dir / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
        if self.v1_cpuacct_dir is not None:
            acct = self.v1_cpuacct_dir / "cpuacct.usage"
            if acct.exists():
                return int(acct.read_text()) / 1e9
        return sum(process_cpu_seconds(pid) for pid in self.pids())


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (0.0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def _write(path: Path, value: str) -> None:
    try:
        with open(path, "w") as handle:
            handle.write(value)
    except OSError as err:
        raise EnforcementError(
            f"cannot write {value!r} to {path}: {err.strerror}",
            fix="the agent must run as root with cgroupfs mounted read-write",
        ) from err


class CgroupTree:
    """Resolves cgroup paths (hierarchy paths, as in ContainerIdentity.cgroup_path) to handles.

    By default the mounts come from containers/cgroupfs.py, so a path is a hierarchy path
    even when the agent runs in its own cgroup namespace; explicit roots are for fixtures.
    """

    def __init__(
        self,
        v2_root: Path | str | None = None,
        v1_freezer_root: Path | str | None = None,
        *,
        autodetect: bool = True,
        mounts: CgroupMounts | None = None,
    ) -> None:
        explicit = v2_root is not None or v1_freezer_root is not None
        found = mounts if mounts is not None else (discover_mounts() if autodetect and not explicit else None)
        detected = detect_roots(found) if found is not None else (None, None)
        self.v2_root = Path(v2_root) if v2_root is not None else detected[0]
        self.v1_freezer_root = Path(v1_freezer_root) if v1_freezer_root is not None else detected[1]
        cpuacct = found.v1_controller("cpuacct") if found is not None else None
        if cpuacct is None and self.v1_freezer_root is not None:
            cpuacct = self.v1_freezer_root.parent / "cpuacct"  # the usual hybrid layout beside it
        self.v1_cpuacct_root = cpuacct

    def handle(self, cgroup_path: str) -> CgroupHandle:
        path = _normalise(cgroup_path)
        rel = path.lstrip("/")
        return CgroupHandle(
            path,
            self.v2_root / rel if self.v2_root is not None else None,
            self.v1_freezer_root / rel if self.v1_freezer_root is not None else None,
            self.v1_cpuacct_root / rel if self.v1_cpuacct_root is not None else None,
        )

    def iter_handles(self, paths: Iterator[str]) -> Iterator[CgroupHandle]:
        for path in paths:
            yield self.handle(path)


def own_cgroup_paths(proc_root: str = "/proc", mounts: CgroupMounts | None = None) -> frozenset[str]:
    """Every cgroup path of this process (all hierarchies), as hierarchy paths, for the
    safety filter: in its own cgroup namespace the agent reads its cgroup as "/", which
    must still name the real cgroup it runs in."""
    return cgroupfs.own_cgroup_paths(mounts if mounts is not None else discover_mounts(proc_root), proc_root)
