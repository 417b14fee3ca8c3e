"""Kept handles on live processes, so a cached identity is revalidated without touching /proc.

Per watched process two file descriptors are kept:
* a pidfd (pidfd_open), registered in one epoll set: the kernel marks it readable when that
  very process exits (zombies included). One `epoll_wait(0)` per sample cycle therefore
  says which cached pids died, whatever their number; a pid reused by a new process is
  never mistaken for the old one, because the old one's pidfd has fired first.
* the process's /proc/<pid>/cgroup, opened once. `pread(fd, 0)` regenerates the file from
  the live task (one syscall, no path lookup), and fails with ESRCH once that process is
  gone, so a periodic re-read notices a move to another cgroup (cgroup.procs, `runc exec`
  joining a container) for the process the fd was opened for and no other.

Only usable when `proc_root` is the procfs of our own pid namespace (pidfd_open takes pids
as we see them): the real /proc, or a host /proc mounted in a hostPID container. Fixture
trees and foreign namespaces get `None` from `open_pid_watch`, and the resolver falls back
to stat-based revalidation. Not thread-safe; one sampling loop owns it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import select
import weakref
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("gpuwatch.containers")

_READ_BYTES = 8192  # a hybrid host's /proc/<pid>/cgroup with every v1 controller: ~1-2 KiB


@dataclass
class ProcessHandle:
    """The kept descriptors of one watched process."""

    pid: int
    pidfd: int
    cgroup_fd: int


class PidWatch:
    """pidfds in one epoll set (exits) + kept /proc/<pid>/cgroup fds (moves)."""

    def __init__(self, proc_root: str) -> None:
        self.proc_root = proc_root.rstrip("/") or "/"
        self._epoll = select.epoll()
        self._by_pidfd: dict[int, ProcessHandle] = {}
        self._raised_limit = False
        self._fd_limit_logged = False
        # Descriptors are released when the owner forgets to close() (GC of the watch).
        self._finalizer = weakref.finalize(self, _close_all, self._epoll, self._by_pidfd)

    def __len__(self) -> int:
        return len(self._by_pidfd)

    def watch(self, pid: int) -> ProcessHandle | None:
        """Open the handles of the process that has `pid` now; None when it is gone or no
        descriptor is left (the caller then revalidates that pid the old way)."""
        try:
            pidfd = self._open(lambda: os.pidfd_open(pid))
        except OSError:
            return None
        try:
            cgroup_fd = self._open(lambda: os.open(f"{self.proc_root}/{pid}/cgroup", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            os.close(pidfd)
            return None
        handle = ProcessHandle(pid, pidfd, cgroup_fd)
        try:
            self._epoll.register(pidfd, select.EPOLLIN)
        except OSError:
            _close_handle(handle)
            return None
        self._by_pidfd[pidfd] = handle
        return handle

    def watching(self, handle: ProcessHandle) -> bool:
        """Whether this handle is still open here (not closed by exited() or close())."""
        return self._by_pidfd.get(handle.pidfd) is handle

    def alive(self, handle: ProcessHandle) -> bool:
        """Whether the watched process has not exited (its pidfd is not readable yet)."""
        poller = select.poll()
        poller.register(handle.pidfd, select.POLLIN)
        return not poller.poll(0)

    def exited(self) -> list[int]:
        """Pids of watched processes that exited since the last call; their handles are closed.

        One epoll_wait(0), plus one per 1,024 exits."""
        gone: list[int] = []
        while True:
            events = self._epoll.poll(0, 1024)
            for pidfd, _ in events:
                handle = self._by_pidfd.get(pidfd)
                if handle is not None:
                    gone.append(handle.pid)
                    self.close(handle)
                else:  # not ours any more (closed meanwhile): never let it fire again
                    with contextlib.suppress(OSError):
                        self._epoll.unregister(pidfd)
            if len(events) < 1024:
                return gone

    def read_cgroup(self, handle: ProcessHandle) -> str | None:
        """The process's /proc/<pid>/cgroup now, or None when it has exited."""
        try:
            return os.pread(handle.cgroup_fd, _READ_BYTES, 0).decode("utf-8", "replace")
        except OSError:
            return None

    def close(self, handle: ProcessHandle) -> None:
        """Stop watching one process (idempotent)."""
        if self._by_pidfd.pop(handle.pidfd, None) is None:
            return
        with contextlib.suppress(OSError):
            self._epoll.unregister(handle.pidfd)
        _close_handle(handle)

    def close_all(self) -> None:
        self._finalizer()

    def _open(self, opener: Callable[[], int]) -> int:
        """Run an fd-returning call; on EMFILE raise the soft fd limit to the hard one once."""
        try:
            fd: int = opener()
            return fd
        except OSError as err:
            if err.errno != errno.EMFILE or self._raised_limit:
                if err.errno == errno.EMFILE and not self._fd_limit_logged:
                    self._fd_limit_logged = True
                    log.warning("out of file descriptors for process handles (%d watched): further "
                                "pids are revalidated with a stat each cycle (more CPU); raise "
                                "RLIMIT_NOFILE (LimitNOFILE=) to avoid it", len(self._by_pidfd))
                raise
            self._raised_limit = True
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if hard == resource.RLIM_INFINITY or hard > soft:
                try:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                except (OSError, ValueError):
                    raise err from None
                log.info("raised the open-file limit from %d to %s for process handles", soft, hard)
            fd = opener()
            return fd


def _close_handle(handle: ProcessHandle) -> None:
    for fd in (handle.pidfd, handle.cgroup_fd):
        with contextlib.suppress(OSError):
            os.close(fd)


def _close_all(epoll: select.epoll, handles: dict[int, ProcessHandle]) -> None:
    for handle in handles.values():
        _close_handle(handle)
    handles.clear()
    epoll.close()


def open_pid_watch(proc_root: str) -> PidWatch | None:
    """A PidWatch when `proc_root` is the procfs of our pid namespace and pidfds work, else None."""
    root = proc_root.rstrip("/") or "/"
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        if os.readlink(f"{root}/self") != str(os.getpid()):
            return None  # a fixture tree, or the procfs of another pid namespace
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return None  # no /proc/self link, or a kernel without pidfd_open (< 5.3)
    return PidWatch(root)
