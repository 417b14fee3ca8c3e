"""Reading and writing the agent's own files so that a bad file can neither hang nor flood it.

`read_regular_file()` is how the agent reads files an operator (or an attacker with write
access to a directory on the path) controls: the policy and the frozen-state journal.

* Symlinks are resolved first (a Kubernetes ConfigMap mount is a chain of symlinks), then
  the resolved path is opened with O_NOFOLLOW (a symlink swapped in since is refused) and
  O_NONBLOCK (opening a FIFO never waits for a writer).
* Only a regular file is read: a FIFO, a socket, a device (/dev/zero behind a symlink) or a
  directory is refused with a message naming what it is.
* A size cap is checked on the open file (fstat) before reading and again while reading
  (a file that grows, or a /proc-style file that reports size 0, stops at the cap).

`create_private()` opens a new file for writing with O_EXCL|O_NOFOLLOW and the given mode
(no umask surprises, no following a planted symlink).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

MIB = 1 << 20
_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


class RefusedFile(OSError):
    """The file exists but is not something the agent will read (kind, size, symlink)."""

    def __init__(self, path: str | Path, why: str) -> None:
        super().__init__(errno.EINVAL, why, str(path))
        self.why = why

    def __str__(self) -> str:
        return f"{self.filename}: {self.why}"


def file_kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def read_regular_file(path: str | Path, max_bytes: int, *, follow_symlinks: bool = True) -> bytes:
    """The bytes of a regular file of at most `max_bytes`.

    Raises FileNotFoundError/PermissionError (OSError) when it cannot be opened and
    RefusedFile when it is not a regular file or is larger than `max_bytes`. Never blocks
    on a FIFO and never reads more than `max_bytes + 1` bytes."""
    name = str(path)
    target = os.path.realpath(name) if follow_symlinks else name
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(target, flags)
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW on a symlink
            raise RefusedFile(name, "is a symbolic link (not followed)") from err
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            via = f" ({target})" if target != name else ""
            raise RefusedFile(name, f"is {file_kind(st.st_mode)}{via}, not a regular file")
        if st.st_size > max_bytes:
            raise RefusedFile(name, f"is {st.st_size} bytes, more than the {max_bytes}-byte limit")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, min(1 << 16, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise RefusedFile(name, f"grew past the {max_bytes}-byte limit while being read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def create_private(path: str | Path, mode: int = 0o600) -> int:
    """A new file opened for writing (O_CREAT|O_EXCL|O_NOFOLLOW), with exactly `mode`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # exactly `mode`, whatever the umask
    except OSError:
        os.close(fd)
        raise
    return fd
