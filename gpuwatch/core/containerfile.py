"""Read a small file inside a container as the container's process would be allowed to.

The agent is root; a container is not. Everything the agent reads through
/proc/<pid>/root (a job's progress file today) is therefore read here, and only here, so
that a path a tenant controls can neither lead the agent out of the container nor make it
read what the tenant could not read itself:

* **resolved inside the process's root**: openat2(2) RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
  below an fd on /proc/<pid>/root -- absolute symlinks and ".." stop at the container's
  root, /proc magic links are refused. Without openat2 (kernel < 5.6, seccomp) every
  component is opened O_PATH | O_NOFOLLOW one at a time and any symlink is refused;
* **typed before it is opened**: the path is opened O_PATH first (no driver open, no side
  effect: a watchdog device is not armed, a FIFO does not block), fstat'ed and fstatfs'ed on
  that fd, and only a regular file on an ordinary filesystem goes on -- devices, FIFOs,
  sockets, directories and files of kernel filesystems (procfs: /proc/1/environ, sysfs,
  debugfs, cgroupfs, ...) are refused. The read then reopens that same inode through
  /proc/self/fd/<n>, so what is read is what was checked;
* **with the process's file rights**: resolution, reopen and read run on a short-lived
  helper thread that first takes the process's fsuid, fsgid and supplementary groups
  (from /proc/<pid>/status: Uid/Gid 4th field, Groups) and lowers its effective
  capabilities to the process's CapEff. The kernel itself then checks every directory on
  the way and the file's mode bits and ACLs exactly as for the process;
* **bounded**: at most `max_bytes` + 1 bytes; O_NONBLOCK; a helper that does not answer
  within `timeout_s` is abandoned (it holds only the process's rights).

Why a helper thread (not a mirror of the permission checks, not a forked helper): Linux
credentials are per thread; the raw setgroups syscall, setfsuid/setfsgid and capset change
only the calling thread, and the thread's credentials vanish with it, so nothing has to be
restored and no other agent thread ever runs with them. A mirror in user space would miss
ACLs, LSMs and the search permission of every directory on the way (openat2 resolves them
in one call); a forked helper would copy a multi-threaded agent (unsafe after fork, and
tens of MiB of page tables per read). glibc's setgroups() is NOT used: it changes every
thread of the process (its setxid broadcast); the raw syscall is.

Errors are `ContainerFileError(reason, detail)`: the detail names the path and the problem,
never the file's content. Not root (unit tests on fixture trees), the kernel already limits
the agent to its own rights, and a file is read only for a process of the agent's own fsuid.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from gpuwatch.core.errors import ReasonError
from gpuwatch.core.safeio import RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, openat2

REASONS = (
    "pid_gone",  # the process is gone (its /proc/<pid> could not be opened)
    "missing",  # no such file (or a directory on the way is not one)
    "unreadable",  # the process may not read it (EACCES), or another I/O error
    "symlink",  # a link that may not be followed (magic link; any symlink without openat2)
    "not_regular",  # a FIFO, device, socket, directory or a kernel filesystem's file
    "too_large",  # more than max_bytes
    "rights",  # the process's rights could not be taken: refused rather than read as root
)

_SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159, "riscv64": 159}  # the raw, per-thread syscall
_CAP_VERSION_3 = 0x20080522
_QUERY = 0xFFFFFFFF  # setfsuid(-1) fails and returns the current fsuid
# f_type of kernel filesystems whose "regular files" are not data (statfs(2) magic numbers)
KERNEL_FS_MAGIC = {
    0x9FA0: "procfs", 0x62656572: "sysfs", 0x64626720: "debugfs", 0x74726163: "tracefs",
    0x73636673: "securityfs", 0x27E0EB: "cgroupfs", 0x63677270: "cgroup2", 0xCAFE4A11: "bpffs",
    0x62656570: "configfs", 0xDE5E81E4: "efivarfs", 0x6165676C: "pstore", 0x1CD1: "devpts",
    0xF97CFF8C: "selinuxfs", 0x43415D53: "smackfs", 0x42494E4D: "binfmt_misc", 0x65735543: "fusectl",
    0x6E736673: "nsfs",
}
DEFAULT_TIMEOUT_S = 5.0
T = TypeVar("T")


class ContainerFileError(ReasonError):
    """A file inside a container could not be used; `reason` is one of REASONS. The message
    names the path and the problem, never the file's content."""


@dataclass(frozen=True)
class FileRights:
    """What the kernel checks file access against for one process."""

    fsuid: int
    fsgid: int
    groups: tuple[int, ...] = ()
    cap_effective: int = 0


def parse_rights(status: str) -> FileRights | None:
    """FileRights from /proc/<pid>/status text (Uid/Gid 4th field, Groups, CapEff); None
    without Uid or Gid. A missing Groups or CapEff line means none (fewer rights, not more)."""
    fields: dict[str, list[str]] = {}
    for line in status.splitlines():
        key, sep, rest = line.partition(":")
        if sep and key in ("Uid", "Gid", "Groups", "CapEff"):
            fields[key] = rest.split()
    try:
        uid, gid = int(fields["Uid"][3]), int(fields["Gid"][3])
        groups = tuple(int(g) for g in fields.get("Groups", []))
        caps = int(fields["CapEff"][0], 16) if fields.get("CapEff") else 0
    except (KeyError, IndexError, ValueError):
        return None
    return FileRights(uid, gid, groups, caps)


# ---- kernel calls (ctypes: the os module has no setfsuid, capset; openat2 is safeio's) -------


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_libc_handle: ctypes.CDLL | None = None
_openat2_works: bool | None = None  # None: not tried yet


def _libc() -> ctypes.CDLL:
    global _libc_handle
    if _libc_handle is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.syscall.restype = ctypes.c_long
        lib.setfsuid.restype = ctypes.c_int
        lib.setfsgid.restype = ctypes.c_int
        _libc_handle = lib
    return _libc_handle


def _openat2(dir_fd: int, path: str, flags: int) -> int:
    """openat2(dir_fd, path, {flags, resolve: IN_ROOT | NO_MAGICLINKS}); OSError on failure."""
    return openat2(dir_fd, path, flags, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)


def _fs_magic(fd: int) -> int | None:
    """statfs f_type of the filesystem holding fd (the first word of struct statfs on every
    64-bit Linux ABI); None if fstatfs failed."""
    buf = ctypes.create_string_buffer(256)
    if _libc().fstatfs(ctypes.c_int(fd), buf) != 0:
        return None
    return int(ctypes.c_ulong.from_buffer(buf).value) & 0xFFFFFFFF


def take_rights(rights: FileRights) -> None:
    """Give the CALLING THREAD the file rights of `rights` (groups, fsgid, fsuid, effective
    capabilities lowered to the process's). Only for a thread that ends after its read.
    Raises ContainerFileError("rights") when any step fails: refusing beats reading as root."""
    libc = _libc()
    number = _SYS_SETGROUPS.get(platform.machine())
    if number is None:
        raise ContainerFileError("rights", f"no per-thread setgroups syscall known for {platform.machine()}")
    gids = (ctypes.c_uint32 * max(len(rights.groups), 1))(*rights.groups)
    if libc.syscall(ctypes.c_long(number), ctypes.c_size_t(len(rights.groups)), gids) != 0:
        raise ContainerFileError("rights", f"setgroups: {os.strerror(ctypes.get_errno())}")
    libc.setfsgid(ctypes.c_uint32(rights.fsgid))
    if libc.setfsgid(ctypes.c_uint32(_QUERY)) != rights.fsgid:
        raise ContainerFileError("rights", f"setfsgid({rights.fsgid}) did not take")
    libc.setfsuid(ctypes.c_uint32(rights.fsuid))
    if libc.setfsuid(ctypes.c_uint32(_QUERY)) != rights.fsuid:
        raise ContainerFileError("rights", f"setfsuid({rights.fsuid}) did not take")
    header, data = _CapHeader(_CAP_VERSION_3, 0), (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise ContainerFileError("rights", f"capget: {os.strerror(ctypes.get_errno())}")
    data[0].effective &= rights.cap_effective & 0xFFFFFFFF
    data[1].effective &= (rights.cap_effective >> 32) & 0xFFFFFFFF
    if libc.capset(ctypes.byref(header), data) != 0:
        raise ContainerFileError("rights", f"capset: {os.strerror(ctypes.get_errno())}")


def _with_rights(rights: FileRights, work: Callable[[], T], timeout_s: float, path: str,
                 done: Callable[[], None]) -> T:
    """work() on a fresh thread holding `rights` (root), or here when the agent is not root;
    done() runs when work has finished, on whichever thread ran it (a helper abandoned after
    timeout_s still owns what done() releases)."""
    if os.geteuid() != 0:
        try:
            if rights.fsuid != os.geteuid():
                raise ContainerFileError("rights", f"{path}: not root, so only files of processes of uid "
                                                   f"{os.geteuid()} are read (this one has fsuid {rights.fsuid})")
            return work()
        finally:
            done()
    box: list[tuple[bool, object]] = []

    def body() -> None:
        try:
            take_rights(rights)
            box.append((True, work()))
        except BaseException as err:  # handed to the caller's thread as is
            box.append((False, err))
        finally:
            done()

    helper = threading.Thread(target=body, name="gpuwatch-container-file", daemon=True)
    helper.start()
    helper.join(timeout_s)
    if not box:
        raise ContainerFileError("unreadable", f"{path}: no answer within {timeout_s:g} s (a hung filesystem?)")
    ok, value = box[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]


# ---- resolution ------------------------------------------------------------------------------


def _walk(root_fd: int, relative: str) -> int:
    """O_PATH fd of `relative` below root_fd, one O_NOFOLLOW component at a time (the final
    one too: a symlink there comes back as the link itself, refused by the caller)."""
    parts = [p for p in relative.split("/") if p]
    current = os.dup(root_fd)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC | (0 if last else os.O_DIRECTORY)
            try:
                nxt = os.open(part, flags, dir_fd=current)
            except OSError as err:
                if err.errno == errno.ENOTDIR and _is_symlink(part, current):
                    raise OSError(errno.ELOOP, "a symlink (refused without openat2)", relative) from err
                raise
            os.close(current)
            current = nxt
        result, current = current, -1
        return result
    finally:
        if current >= 0:
            os.close(current)


def _is_symlink(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_path(root_fd: int, path: str, resolver: str) -> int:
    """An O_PATH fd of `path` resolved in root_fd (openat2, or the walk without it)."""
    global _openat2_works
    relative = path.lstrip("/") or "."
    if resolver == "openat2" or (resolver == "auto" and _openat2_works is not False):
        try:
            fd = _openat2(root_fd, relative, os.O_PATH | os.O_CLOEXEC)
        except OSError as err:
            if resolver == "auto" and err.errno in (errno.ENOSYS, errno.EPERM) and _openat2_works is None:
                _openat2_works = False  # no openat2 here (old kernel, seccomp): walk from now on
            else:
                raise
        else:
            _openat2_works = True
            return fd
    return _walk(root_fd, relative)


_ERRNO_REASONS = {
    errno.ENOENT: "missing",
    errno.ENOTDIR: "missing",
    errno.ELOOP: "symlink",
    errno.EXDEV: "symlink",
    errno.EACCES: "unreadable",
    errno.EPERM: "unreadable",
}


def _checked(fd: int, path: str, max_bytes: int) -> os.stat_result:
    """The O_PATH fd's stat when it is a regular file of an ordinary filesystem within
    max_bytes; ContainerFileError otherwise. Nothing has been opened for reading yet."""
    st = os.fstat(fd)
    if stat.S_ISLNK(st.st_mode):
        raise ContainerFileError("symlink", f"{path} is a symlink (refused without openat2)")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device file"
                if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
        raise ContainerFileError("not_regular", f"{path} is {kind}, not a regular file (not opened)")
    magic = _fs_magic(fd)
    if magic is None or magic in KERNEL_FS_MAGIC:
        where = KERNEL_FS_MAGIC.get(magic or 0, "a filesystem whose type could not be read")
        raise ContainerFileError("not_regular", f"{path} is on {where}, not a file of the container's data")
    if st.st_size > max_bytes:
        raise ContainerFileError("too_large", f"{path} has {st.st_size} bytes (at most {max_bytes})")
    return st


def _read_fd(fd: int, path: str, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size <= max_bytes:  # a file that grows while read stops at the cap, too
        chunk = os.read(fd, max_bytes + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > max_bytes:
        raise ContainerFileError("too_large", f"{path} has more than {max_bytes} bytes")
    return b"".join(chunks)


def _read_as_process(root_fd: int, path: str, max_bytes: int, resolver: str) -> bytes:
    """Runs with the process's rights: resolve O_PATH, check the type, reopen, read."""
    try:
        opath = _open_path(root_fd, path, resolver)
    except OSError as err:
        raise ContainerFileError(_ERRNO_REASONS.get(err.errno or 0, "unreadable"), f"{path}: {err.strerror}") from err
    try:
        checked = _checked(opath, path, max_bytes)
        try:  # the same inode, opened for reading now that its type is known
            fd = os.open(f"/proc/self/fd/{opath}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError as err:
            raise ContainerFileError(_ERRNO_REASONS.get(err.errno or 0, "unreadable"),
                                     f"{path}: {err.strerror}") from err
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (checked.st_dev, checked.st_ino):
                raise ContainerFileError("unreadable", f"{path}: changed while opened")
            return _read_fd(fd, path, max_bytes)
        except OSError as err:
            raise ContainerFileError("unreadable", f"{path}: {err.strerror}") from err
        finally:
            os.close(fd)
    finally:
        os.close(opath)


def read_container_file(proc_root: str, pid: int, path: str, max_bytes: int, resolver: str = "auto",
                        timeout_s: float = DEFAULT_TIMEOUT_S) -> bytes:
    """The bytes of `path` as process `pid` sees it and may read it (module docstring).
    `resolver`: "auto" (openat2 where the kernel has it, else the O_NOFOLLOW walk),
    "openat2" or "walk" (tests). Raises ContainerFileError."""
    try:
        pid_fd = os.open(os.path.join(proc_root, str(pid)), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise ContainerFileError("pid_gone", f"process {pid}: {err.strerror}") from err
    root_fd = -1
    try:
        # one /proc/<pid> fd for both: a reused pid cannot mix one process's root with another's rights
        root_fd = os.open("root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=pid_fd)
        with open(os.open("status", os.O_RDONLY | os.O_CLOEXEC, dir_fd=pid_fd), encoding="ascii",
                  errors="replace") as handle:
            rights = parse_rights(handle.read(16384))
    except OSError as err:
        if root_fd >= 0:
            os.close(root_fd)
        raise ContainerFileError("pid_gone", f"process {pid}: {err.strerror}") from err
    finally:
        os.close(pid_fd)
    if rights is None:
        os.close(root_fd)
        raise ContainerFileError("rights", f"process {pid}: no Uid/Gid in its status")
    return _with_rights(rights, lambda: _read_as_process(root_fd, path, max_bytes, resolver), timeout_s, path,
                        lambda: os.close(root_fd))

__all__ = [
    "KERNEL_FS_MAGIC",
    "REASONS",
    "ContainerFileError",
    "FileRights",
    "parse_rights",
    "read_container_file",
    "take_rights",
]
