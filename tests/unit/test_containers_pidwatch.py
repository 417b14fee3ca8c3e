"""PidWatch on real child processes (no root): exits reported by one epoll wait, the kept
/proc/<pid>/cgroup re-read, descriptors released; no watch over a fixture tree."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gpuwatch.containers.pidwatch import PidWatch, open_pid_watch


@pytest.fixture
def watch() -> PidWatch:
    w = open_pid_watch("/proc")
    if w is None:
        pytest.skip("pidfd_open unavailable (Linux < 5.3)")
    return w


def test_exit_is_reported_once_and_closes_the_handle(watch: PidWatch) -> None:
    fds_before = len(os.listdir("/proc/self/fd"))
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        handles = [watch.watch(p.pid) for p in procs]
        assert all(h is not None for h in handles) and len(watch) == 3
        assert len(os.listdir("/proc/self/fd")) == fds_before + 6
        assert watch.exited() == []
        procs[1].kill()
        procs[1].wait()
        assert watch.exited() == [procs[1].pid]
        assert watch.exited() == []  # once
        assert len(watch) == 2 and len(os.listdir("/proc/self/fd")) == fds_before + 4
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert sorted(watch.exited()) == sorted([procs[0].pid, procs[2].pid])
    assert len(os.listdir("/proc/self/fd")) == fds_before
    watch.close_all()


def test_zombie_counts_as_exited(watch: PidWatch) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    handle = watch.watch(proc.pid)
    assert handle is not None and watch.alive(handle)
    proc.kill()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie
    assert not watch.alive(handle)
    assert watch.exited() == [proc.pid]
    proc.wait()
    watch.close_all()


def test_kept_cgroup_file_reads_the_live_process_and_fails_once_it_is_gone(watch: PidWatch) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    handle = watch.watch(proc.pid)
    assert handle is not None
    text = watch.read_cgroup(handle)
    assert text is not None and text == Path(f"/proc/{proc.pid}/cgroup").read_text()
    assert watch.read_cgroup(handle) == text  # re-read from the start each time
    proc.kill()
    proc.wait()
    assert watch.read_cgroup(handle) is None
    watch.close_all()


def test_gone_pid_is_not_watched(watch: PidWatch) -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert watch.watch(proc.pid) is None
    assert len(watch) == 0
    watch.close_all()


def test_no_watch_over_a_fixture_tree(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    assert open_pid_watch(str(tmp_path)) is None
    (tmp_path / "self").rmdir()
    (tmp_path / "self").symlink_to("1")  # a procfs of another pid namespace: its own pids
    assert open_pid_watch(str(tmp_path)) is None
