"""Progress files are read with the container process's file rights, typed before they are
opened, and their content never reaches an error, a log, /snapshot.json or the metrics
(issue 20, item 5).

A "container" here is a child process run by setpriv as uid 12345 (root "/", so paths are
host paths): the kernel checks what gpuwatch/core/containerfile.py reads against that uid, its
groups and its capabilities, exactly as for the child itself.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpuwatch.core import snapshot_doc
from gpuwatch.core.model import Snapshot
from gpuwatch.exporter.collector import SnapshotCollector
from gpuwatch.signals.progress import ProgressReadError, ProgressTracker, parse_progress_value, read_progress_file
from tests.conftest import need_binary, need_root
from tests.unit.test_progress_tracker import container, declared, usage

JOB_UID, OTHER_UID, SHARED_GID = 12345, 23456, 777
SECRET = b"424242 hunter2-SECRET\n"  # numeric first word: must not become a gauge either
IN_OPEN = 0x20


@pytest.fixture
def box() -> Iterator[Path]:
    """A world-searchable directory of files owned by the job, by another uid and by root."""
    need_root()
    path = Path(tempfile.mkdtemp(prefix="gpuwatch-rights-", dir="/tmp"))
    path.chmod(0o755)
    try:
        def put(name: str, data: bytes, uid: int, gid: int, mode: int) -> None:
            (path / name).write_bytes(data)
            os.chown(path / name, uid, gid)
            (path / name).chmod(mode)

        put("secret", SECRET, OTHER_UID, OTHER_UID, 0o600)
        put("rootsecret", SECRET, 0, 0, 0o600)
        put("own", b"0.5\n", JOB_UID, JOB_UID, 0o600)
        put("group", b"3\n", OTHER_UID, SHARED_GID, 0o640)
        put("garbage", b"hunter2-SECRET\n", JOB_UID, JOB_UID, 0o600)
        (path / "link").symlink_to(path / "secret")  # the job's progress file: a link to another uid's 0600 file
        (path / "rootlink").symlink_to(path / "rootsecret")
        (path / "hidden").mkdir(mode=0o700)
        os.chown(path / "hidden", OTHER_UID, OTHER_UID)
        (path / "hidden" / "v").write_bytes(b"7\n")
        (path / "hidden" / "v").chmod(0o644)
        os.mkfifo(path / "fifo", 0o666)
        os.mknod(path / "zero", 0o666 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers: a device
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def job() -> Iterator[int]:
    """pid of a process running as uid JOB_UID with supplementary group SHARED_GID."""
    need_root()
    setpriv = need_binary("setpriv", "util-linux")
    proc = subprocess.Popen([setpriv, f"--reuid={JOB_UID}", f"--regid={JOB_UID}", f"--groups={SHARED_GID}",
                             "sleep", "60"])
    try:
        for _ in range(200):  # until setpriv has exec'd sleep with the new ids
            status = Path(f"/proc/{proc.pid}/status").read_text()
            if f"Uid:\t{JOB_UID}" in status and "sleep" in status:
                break
            subprocess.run(["sleep", "0.01"], check=False)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def reason(pid: int, path: str | Path) -> ProgressReadError:
    with pytest.raises(ProgressReadError) as err:
        parse_progress_value(read_progress_file("/proc", pid, str(path)))
    assert b"hunter2" not in str(err.value).encode() and b"424242" not in str(err.value).encode()
    return err.value


def test_the_job_reads_what_it_may_and_nothing_more(box: Path, job: int) -> None:
    assert parse_progress_value(read_progress_file("/proc", job, str(box / "own"))).value == 0.5
    assert parse_progress_value(read_progress_file("/proc", job, str(box / "group"))).value == 3  # its group
    assert reason(job, box / "link").reason == "unreadable"  # another uid's 0600 file through a link
    assert reason(job, box / "secret").reason == "unreadable"
    assert reason(job, box / "rootlink").reason == "unreadable"  # root's: the agent's own rights are not used
    assert reason(job, box / "hidden" / "v").reason == "unreadable"  # a directory it may not search
    garbage = reason(job, box / "garbage")
    assert garbage.reason == "garbage"
    # a root process may read root's file: the rights are the process's, whatever they are
    assert parse_progress_value(read_progress_file("/proc", os.getpid(), str(box / "rootlink"))).value == 424242


def _inotify_opens(paths: list[Path]) -> tuple[int, list[int]]:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0
    return fd, [libc.inotify_add_watch(fd, os.fsencode(p), IN_OPEN) for p in paths]


def test_devices_fifos_and_procfs_are_refused_without_being_opened(box: Path, job: int) -> None:
    fd, _ = _inotify_opens([box / "fifo", box / "zero"])
    try:
        errors = [reason(pid, box / name) for pid in (job, os.getpid()) for name in ("fifo", "zero")]
        with pytest.raises(BlockingIOError):
            os.read(fd, 4096)  # no IN_OPEN event: neither file was opened, as the job or as root
    finally:
        os.close(fd)
    for err in errors:
        assert err.reason == "not_regular" and "not opened" in err.detail, err
    for pid in (job, os.getpid()):
        err = reason(pid, "/proc/1/environ")
        assert err.reason == "not_regular" and "procfs" in err.detail, err


def test_the_secret_never_reaches_snapshot_metrics_or_logs(box: Path, job: int,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    linked = declared(container("aaaa1111aaaa", namespace="ns1", pod="p1", name="trainer", pod_uid="u1"),
                      str(box / "link"))
    junk = declared(container("bbbb2222bbbb", namespace="ns1", pod="p2", name="scorer", pod_uid="u2"),
                    str(box / "garbage"))
    tracker = ProgressTracker("/proc")
    rows = [usage(linked, 1.0, pids=(job,)), usage(junk, 1.0, pids=(job,), gpu=1)]
    for t in range(3):
        progress = tracker.collect(rows, float(t))
    assert {p.path: p.value for p in progress} == {str(box / "link"): None, str(box / "garbage"): None}
    snap = Snapshot(timestamp_s=3.0, node="n", devices=(), containers=tuple(rows), progress=progress)
    doc = json.dumps(snapshot_doc.snapshot_to_dict(snap))
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SnapshotCollector(lambda: snap, clock=lambda: 3.0))
    metrics = generate_latest(registry).decode()
    for text in (doc, metrics, caplog.text, repr(progress)):
        assert "hunter2" not in text and "424242" not in text
    assert "unreadable" in doc and "garbage" in doc  # the reasons are there, the content is not
