"""IdentityResolver's per-pid cache on the real kernel: real processes in real cgroups (root).

A cached pid is revalidated through its kept pidfd and /proc/<pid>/cgroup descriptor
(gpuwatch/containers/pidwatch.py), not by reading /proc every cycle. These tests check the
answers stay right when that matters: a pid reused by a process in another cgroup (forced
with /proc/sys/kernel/ns_last_pid), a process moved to another cgroup through cgroup.procs
(what `runc exec` / `docker exec` do when a process joins a container), and churn (gone
pids dropped, descriptors released), plus the per-cycle cost for unchanged processes.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.containers import BundleRoots, IdentityResolver
from tests.conftest import need, need_root


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Cgroups:
    """Test cgroups under one parent in the v2 hierarchy, and processes started inside them."""

    def __init__(self, unified_root: str) -> None:
        self.root = Path(unified_root)
        self.parent = f"/gpuwatch-test-resolver-{uuid.uuid4().hex[:8]}"
        (self.root / self.parent.lstrip("/")).mkdir()
        self.procs: list[subprocess.Popen[bytes]] = []

    def make(self, name: str) -> str:
        path = f"{self.parent}/{name}"
        (self.root / path.lstrip("/")).mkdir(exist_ok=True)
        return path

    def spawn(self, path: str) -> subprocess.Popen[bytes]:
        """`sleep` started inside cgroup `path` (moved there between fork and exec)."""
        procs = self.root / path.lstrip("/") / "cgroup.procs"
        proc = subprocess.Popen(["sleep", "300"], preexec_fn=lambda: procs.write_text("0"))
        self.procs.append(proc)
        return proc

    def move(self, pid: int, path: str) -> None:
        (self.root / path.lstrip("/") / "cgroup.procs").write_text(str(pid))

    @staticmethod
    def stop(proc: subprocess.Popen[bytes]) -> None:
        proc.kill()
        proc.wait()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.stop(proc)
        base = self.root / self.parent.lstrip("/")
        for child in sorted(base.iterdir(), reverse=True):
            if child.is_dir():
                child.rmdir()
        base.rmdir()


@pytest.fixture
def resolver_and_cgroups() -> Iterator[tuple[IdentityResolver, Cgroups, Clock]]:
    need_root()
    clock = Clock()
    resolver = IdentityResolver(bundle_roots=BundleRoots((), (), (), ()), clock=clock, pid_recheck_s=10.0)
    need(resolver.mounts.unified is not None, "needs a cgroup v2 hierarchy")
    need(resolver.watched_pids() == 0 and resolver._watch is not None, "needs pidfd_open (Linux >= 5.3)")
    assert resolver.mounts.unified is not None
    cgroups = Cgroups(resolver.mounts.unified)
    try:
        yield resolver, cgroups, clock
    finally:
        resolver.close()
        cgroups.close()


def _spawn_with_pid(cgroups: Cgroups, path: str, pid: int, tries: int = 50) -> subprocess.Popen[bytes] | None:
    """A process in `path` that gets exactly `pid` (the kernel hands out ns_last_pid + 1 next;
    other processes forking meanwhile can take it first: then try again)."""
    for _ in range(tries):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        proc = cgroups.spawn(path)
        if proc.pid == pid:
            return proc
        cgroups.stop(proc)
    return None


def test_reused_pid_is_the_new_process_in_its_own_cgroup(
        resolver_and_cgroups: tuple[IdentityResolver, Cgroups, Clock]) -> None:
    resolver, cgroups, _ = resolver_and_cgroups
    old_home, new_home = cgroups.make("old"), cgroups.make("new")
    old = cgroups.spawn(old_home)
    first = resolver.resolve_pids([old.pid])[old.pid]
    assert first.identity.cgroup_path == old_home
    pid = old.pid
    cgroups.stop(old)
    new = _spawn_with_pid(cgroups, new_home, pid)
    need(new is not None, f"could not get pid {pid} again (a busy host forks faster)")
    # no begin_sweep in between: the old process's pidfd has fired, the cache must not answer
    again = resolver.resolve_pids([pid])[pid]
    assert again.identity.cgroup_path == new_home
    assert again.identity.cgroup_id == os.stat(cgroups.root / new_home.lstrip("/")).st_ino


def test_gone_pid_is_gone_at_once(resolver_and_cgroups: tuple[IdentityResolver, Cgroups, Clock]) -> None:
    resolver, cgroups, _ = resolver_and_cgroups
    proc = cgroups.spawn(cgroups.make("a"))
    assert resolver.resolve_pid(proc.pid) is not None
    cgroups.stop(proc)
    assert resolver.resolve_pid(proc.pid) is None
    assert resolver.watched_pids() == 0


def test_pid_moved_with_cgroup_procs_is_seen_within_the_recheck_period(
        resolver_and_cgroups: tuple[IdentityResolver, Cgroups, Clock]) -> None:
    resolver, cgroups, clock = resolver_and_cgroups
    host, container = cgroups.make("host-side"), cgroups.make("container")
    others = [cgroups.spawn(host) for _ in range(9)]
    joiner = cgroups.spawn(host)
    pids = [p.pid for p in [*others, joiner]]
    resolver.begin_sweep()
    assert {i.identity.cgroup_path for i in resolver.resolve_pids(pids).values()} == {host}
    cgroups.move(joiner.pid, container)  # as `runc exec` joins a process to a container
    seen_after_s = None
    for cycle in range(1, 13):  # one sweep per simulated second; the period is 10 s
        clock.now += 1.0
        resolver.begin_sweep()
        ident = resolver.resolve_pids(pids)[joiner.pid].identity
        if ident.cgroup_path == container:
            seen_after_s = cycle
            break
    assert seen_after_s is not None and seen_after_s <= 10, seen_after_s
    assert ident.cgroup_id == os.stat(cgroups.root / container.lstrip("/")).st_ino
    final = resolver.resolve_pids(pids)
    assert all(final[p.pid].identity.cgroup_path == host for p in others)


def test_churn_drops_gone_pids_and_releases_their_descriptors(
        resolver_and_cgroups: tuple[IdentityResolver, Cgroups, Clock]) -> None:
    resolver, cgroups, clock = resolver_and_cgroups
    fds_before = len(os.listdir("/proc/self/fd"))  # the resolver's epoll is open already
    live: list[subprocess.Popen[bytes]] = []
    for round_ in range(6):  # each round: 10 new processes in a new cgroup, the oldest 10 exit
        path = cgroups.make(f"c{round_}")
        live.extend(cgroups.spawn(path) for _ in range(10))
        clock.now += 1.0
        resolver.begin_sweep()
        got = resolver.resolve_pids([p.pid for p in live])
        assert len(got) == len(live)
        assert all(got[p.pid].identity.cgroup_path.startswith(cgroups.parent) for p in live)
        if len(live) > 20:
            for proc in live[:10]:
                cgroups.stop(proc)
            live = live[10:]
    clock.now += 1.0
    resolver.begin_sweep()
    assert resolver.watched_pids() == len(live) == 20
    assert resolver.cache_sizes()["pids"] == 20
    assert len(os.listdir("/proc/self/fd")) == fds_before + 2 * 20  # a pidfd + a cgroup fd per pid
    resolver.close()
    assert len(os.listdir("/proc/self/fd")) == fds_before - 1  # and the epoll


def test_unchanged_pids_cost_under_a_millisecond_per_cycle(
        resolver_and_cgroups: tuple[IdentityResolver, Cgroups, Clock]) -> None:
    """800 processes in 200 cgroups (the bench_pipeline shape), cycles with the resolver's
    rechecks running: CPU per cycle for processes that did not change."""
    resolver, cgroups, clock = resolver_and_cgroups
    procs: list[subprocess.Popen[bytes]] = []
    for c in range(200):
        path = cgroups.make(f"pod{c:03d}")
        procs.extend(cgroups.spawn(path) for _ in range(4))
    pids = [p.pid for p in procs]
    resolver.begin_sweep()
    cold = resolver.resolve_pids(pids)
    assert len(cold) == 800 and len({i.identity.cgroup_path for i in cold.values()}) == 200
    costs = []
    for _ in range(30):
        clock.now += 1.0
        c0 = time.thread_time()
        resolver.begin_sweep()
        warm = resolver.resolve_pids(pids)
        costs.append(time.thread_time() - c0)
        assert warm == cold
    median_ms = sorted(costs)[len(costs) // 2] * 1e3
    print(f"resolver: {median_ms:.3f} ms CPU per cycle for 800 unchanged pids (median of 30)")
    assert median_ms < 1.0
