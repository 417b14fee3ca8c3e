"""One gpuwatch agent per node: an exclusive flock on a lock file, taken before anything else.

The lock is per node, not per state file: what two agents would fight over -- the freezer
state of the node's cgroups, the BPF limit map and device gate on them, the NFD feature
file, the ports -- belongs to the node, whatever --state-file each was given. So the default
path is fixed (/run/gpuwatch/agent.lock: tmpfs, gone at reboot with every cgroup it
guards; the DaemonSet mounts /run/gpuwatch from the host, so an agent in a pod and one
started on the host see the same file). `--lock-file` overrides it only to run several
simulated nodes on one machine (tests, demos).

The holder writes its pid into the file. A second agent fails at once with
`AgentAlreadyRunning`, naming that pid, before it has touched anything (no recovery, no
thaw, no state-file write, no port). flock is released by the kernel when the holder dies,
so a crashed agent never leaves a stale lock; the file is not removed on exit (removing a
lock file races with the next agent opening it), only emptied.

The state file (the frozen-cgroup journal) is locked too (`StateFileLock`: a flock on
`<state-file>.lock`, taken right after the node lock): two agents with different
--lock-file (two simulated nodes) but the same --state-file would each rewrite the journal
from their own view and wipe the other's entries, so the second one exits at once with
`StateFileInUse`, naming the state file and the holder's pid, before touching anything. The
lock is on a file beside the journal, not the journal itself, because the journal is replaced
by rename (a flock on it would stay on the old inode).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path

from gpuwatch.core.errors import GpuwatchError

DEFAULT_LOCK_PATH = Path("/run/gpuwatch/agent.lock")
_PID_BYTES = 64


class AgentAlreadyRunning(GpuwatchError):
    """Another agent holds the node lock; this one must not start."""

    def __init__(self, path: Path, pid: int | None) -> None:
        who = f"pid {pid}" if pid is not None else "pid not yet written"
        find = (f"`ps -o pid,args -p {pid}` shows it; " if pid is not None else "") + (
            f"`cat {path}` prints its pid, `grep FLOCK /proc/locks` lists lock holders")
        super().__init__(
            f"another gpuwatch agent is already running on this node ({who}, holding {path}); "
            "this one exits without touching anything",
            fix=f"{find}; stop it first, or give a simulated second node its own --lock-file",
        )
        self.path = path
        self.pid = pid


class StateFileInUse(GpuwatchError):
    """Another agent journals into the same --state-file; this one must not start."""

    def __init__(self, state_path: Path, lock_path: Path, pid: int | None) -> None:
        who = f"pid {pid}" if pid is not None else "pid not yet written"
        super().__init__(
            f"another gpuwatch agent ({who}) uses the state file {state_path} (it holds {lock_path}); two agents "
            "on one journal would wipe each other's entries, so this one exits without touching anything",
            fix="give each agent its own --state-file (one per simulated node, beside its --lock-file), "
                "or stop the other agent first",
        )
        self.state_path = state_path
        self.pid = pid


def read_holder_pid(path: Path | str) -> int | None:
    """The pid written in a lock file, or None (missing, empty, not a number)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, _PID_BYTES).decode("ascii", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else None


class NodeLock:
    """The node lock; `acquire()` or AgentAlreadyRunning, `release()` on the way out."""

    def __init__(self, path: Path | str = DEFAULT_LOCK_PATH) -> None:
        self.path = Path(os.path.abspath(path))
        self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self) -> NodeLock:
        try:
            self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise GpuwatchError(
                f"cannot open the agent lock file {self.path}: {err.strerror or err}",
                fix="run the agent as root, or pass --lock-file PATH in a writable directory",
            ) from err
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise GpuwatchError(f"agent lock file {self.path} is not a regular file",
                                    fix="remove it or pass another --lock-file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise self._busy(read_holder_pid(self.path)) from None
                raise GpuwatchError(f"cannot lock {self.path}: {err.strerror}",
                                    fix="use a lock file on a local filesystem") from err
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _busy(self, pid: int | None) -> GpuwatchError:
        return AgentAlreadyRunning(self.path, pid)

    def release(self) -> None:
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)  # still held: nobody can have taken it meanwhile
        os.close(self._fd)  # closing the last descriptor releases the flock
        self._fd = -1

    def __enter__(self) -> NodeLock:
        return self.acquire()

    def __exit__(self, *_exc: object) -> None:
        self.release()


class StateFileLock(NodeLock):
    """The lock on one --state-file (`<state-file>.lock`); `acquire()` or StateFileInUse."""

    def __init__(self, state_path: Path | str) -> None:
        self.state_path = Path(os.path.abspath(state_path))
        super().__init__(self.state_path.with_name(self.state_path.name + ".lock"))

    def _busy(self, pid: int | None) -> GpuwatchError:
        return StateFileInUse(self.state_path, self.path, pid)

    def __enter__(self) -> StateFileLock:
        self.acquire()
        return self
