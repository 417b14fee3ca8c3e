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

`read_file_beneath()` reads a file whose symlinks may not lead out of its own directory (the
policy): resolved below that directory (openat2 RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS, or,
where openat2 is missing, the realpath checked to stay inside the directory's realpath),
opened O_PATH and typed with fstat before any open for reading (a FIFO or device is never
opened), then reopened through /proc/self/fd. A Kubernetes ConfigMap mount (policy.yaml ->
..data/policy.yaml, ..data -> ..<timestamp>, all inside the directory) resolves; a symlink to
/etc/shadow is refused before a byte of it is read.

`create_private()` opens a new file for writing with O_EXCL|O_NOFOLLOW and the given mode
(no umask surprises, no following a planted symlink).
"""

from __future__ import annotations

import ctypes
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
        return _read_capped(fd, name, max_bytes)
    finally:
        os.close(fd)


_SYS_OPENAT2 = 437  # the unified syscall table (Linux 5.6), every architecture
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
_openat2_works: bool | None = None  # None: not tried yet
_syscall_libc: ctypes.CDLL | None = None


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str, flags: int, resolve: int) -> int:
    """openat2(dir_fd, path, {flags, resolve}) (ctypes: the os module has no openat2); OSError
    on failure. Retried on EAGAIN: a rename raced with the lookup and the kernel asks to retry."""
    global _syscall_libc
    if _syscall_libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        _syscall_libc = libc
    how = _OpenHow(flags, 0, resolve)
    err = errno.EAGAIN
    for _ in range(3):
        fd = _syscall_libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd),
                                   ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
                                   ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err != errno.EAGAIN:
            break
    raise OSError(err, os.strerror(err), path)


def _openat2_beneath(dir_fd: int, name: str, flags: int) -> int:
    """openat2(dir_fd, name, {flags, resolve: BENEATH | NO_MAGICLINKS}); OSError on failure."""
    return openat2(dir_fd, name, flags, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)


def _outside(name: str, directory: str) -> RefusedFile:
    """The refusal for a path that leads out of its directory; names the target path (from
    realpath, for the operator) and never anything read from it."""
    target = os.path.realpath(name)
    return RefusedFile(name, f"resolves to {target}, outside its directory {directory} (symlinks may not leave "
                             "the file's directory; a ConfigMap's ..data link inside it is fine)")


def _opath_beneath(name: str, directory: str, dir_fd: int, resolver: str) -> int:
    """An O_PATH fd of `name`'s last component resolved below dir_fd."""
    global _openat2_works
    base = os.path.basename(name)
    if resolver == "openat2" or (resolver == "auto" and _openat2_works is not False):
        try:
            fd = _openat2_beneath(dir_fd, base, os.O_PATH | os.O_CLOEXEC)
        except OSError as err:
            if err.errno == errno.EXDEV:  # a symlink or ".." led out of the directory
                raise _outside(name, directory) from err
            if err.errno == errno.ELOOP:  # a /proc magic link, or a loop
                raise RefusedFile(name, "is a symbolic link loop or a /proc magic link (not followed)") from err
            if not (resolver == "auto" and err.errno in (errno.ENOSYS, errno.EPERM) and _openat2_works is None):
                raise
            _openat2_works = False  # no openat2 here (old kernel, seccomp): realpath check from now on
        else:
            _openat2_works = True
            return fd
    real_dir = os.path.realpath(directory)
    target = os.path.realpath(name)
    if os.path.dirname(target) != real_dir and not target.startswith(real_dir.rstrip("/") + "/"):
        raise _outside(name, directory)
    # O_NOFOLLOW: a last component swapped for a symlink since realpath is the link itself (typed below)
    return os.open(target, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)


def read_file_beneath(path: str | Path, max_bytes: int, *, resolver: str = "auto") -> bytes:
    """The bytes of a regular file of at most `max_bytes` whose path resolves inside its own
    directory (module docstring). `resolver`: "auto" (openat2 where the kernel has it, else
    the realpath check), "openat2" or "realpath" (tests). Raises OSError when it cannot be
    opened, RefusedFile when it leads outside its directory, is not a regular file or is too
    large. Never opens a FIFO or device, never reads more than `max_bytes + 1` bytes."""
    name = str(path)
    directory = os.path.dirname(os.path.abspath(name))
    dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        opath = _opath_beneath(name, directory, dir_fd, resolver)
    finally:
        os.close(dir_fd)
    try:
        checked = os.fstat(opath)
        if stat.S_ISLNK(checked.st_mode):
            raise RefusedFile(name, "is a symbolic link that changed while resolved (not followed)")
        if not stat.S_ISREG(checked.st_mode):
            raise RefusedFile(name, f"is {file_kind(checked.st_mode)}, not a regular file (not opened)")
        if checked.st_size > max_bytes:
            raise RefusedFile(name, f"is {checked.st_size} bytes, more than the {max_bytes}-byte limit")
        # the same inode, opened for reading now that its type is known
        fd = os.open(f"/proc/self/fd/{opath}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(opath)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (checked.st_dev, checked.st_ino):
            raise RefusedFile(name, "changed while opened")
        return _read_capped(fd, name, max_bytes)
    finally:
        os.close(fd)


def _read_capped(fd: int, name: str, max_bytes: int) -> bytes:
    """At most `max_bytes` from `fd`; a file that grows past them while read is refused."""
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


def create_private(path: str | Path, mode: int = 0o600) -> int:
    """A new file opened for writing (O_CREAT|O_EXCL|O_NOFOLLOW), with exactly `mode`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # exactly `mode`, whatever the umask
    except OSError:
        os.close(fd)
        raise
    return fd
