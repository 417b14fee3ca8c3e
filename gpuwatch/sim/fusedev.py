"""A device "driver" in user space: a FUSE file system whose files answer ioctls during the call.

Used by `gpuwatch sim replay --driver fuse` and by tests/system/test_probes_exit_time.py.

The simulated node's device nodes are /dev/null's numbers: an ioctl on them changes nothing, so
the sim writes the driver's answer into the parameters *before* the syscall and a probe that
reads at syscall entry cannot be told from one that reads at exit. A real NVIDIA driver writes
its answer (status, new handles, the rounded size) *during* the syscall. FUSE gives us that: an
ioctl on a FUSE file is sent to this process, and the kernel copies our answer back into the
caller's parameter block before the syscall returns (FUSE's "restricted" ioctls: _IOC_DIR and
_IOC_SIZE of the command say what is copied in and out, as NVIDIA's encoding does). Only the
block the ioctl argument points to can be answered this way (not blocks it points to in turn:
that needs CUSE, which this kernel lacks).

The protocol subset spoken here is the stable FUSE kernel ABI (include/uapi/linux/fuse.h):
INIT, LOOKUP, GETATTR, OPEN, IOCTL, FLUSH, RELEASE; everything else gets ENOSYS.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import struct
import threading
from collections.abc import Callable
from pathlib import Path

IoctlHandler = Callable[[str, int, bytes], tuple[int, bytes]]
"""(file name, ioctl cmd, the caller's parameter block) -> (ioctl result, the block to copy back)."""

_IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen pad
_OUT_HEADER = struct.Struct("<IiQ")  # len error unique
# ino size blocks atime mtime ctime atimensec mtimensec ctimensec mode nlink uid gid rdev blksize flags
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
_INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")
_IOCTL_IN = struct.Struct("<QIIQII")  # fh flags cmd arg in_size out_size
_IOCTL_OUT = struct.Struct("<iIII")  # result flags in_iovs out_iovs

_LOOKUP, _FORGET, _GETATTR, _OPEN, _RELEASE, _FLUSH, _INIT = 1, 2, 3, 14, 18, 25, 26
_INTERRUPT, _DESTROY, _IOCTL, _BATCH_FORGET = 36, 38, 39, 42
_NO_REPLY = {_FORGET, _BATCH_FORGET, _INTERRUPT}
_ROOT_NODE = 1
_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18


def available() -> str | None:
    """None when FUSE can be mounted here, else why not (for a skip reason)."""
    if os.geteuid() != 0:
        return "mounting FUSE needs root"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    if "fuse" not in Path("/proc/filesystems").read_text().split():
        return "the kernel has no fuse file system"
    return None


def enter_private_mount_namespace() -> None:
    """Give this process its own mount namespace (mounts stay private), so a FuseDriver mounted
    over the simulated node's dev/ hides the sim's nodes from nobody else and vanishes with the
    process. Call it while the process is still single-threaded (unshare of CLONE_NEWNS also
    unshares the file-system context, which the kernel refuses for a threaded process)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"making mounts private: {os.strerror(err)}")


class FuseDriver:
    """Serve `names` as files under `mountpoint`; `handler` answers every ioctl on them."""

    def __init__(self, mountpoint: Path, names: list[str], handler: IoctlHandler) -> None:
        self.mountpoint = mountpoint
        self._nodes = {name: _ROOT_NODE + 1 + i for i, name in enumerate(names)}
        self._names = {node: name for name, node in self._nodes.items()}
        self._handler = handler
        self._fd = -1
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    def __enter__(self) -> FuseDriver:
        self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        libc = ctypes.CDLL(None, use_errno=True)
        options = f"fd={self._fd},rootmode=40000,user_id=0,group_id=0".encode()
        if libc.mount(b"gpuwatch-test-driver", str(self.mountpoint).encode(), b"fuse",
                      _MS_NOSUID | _MS_NODEV, options) != 0:
            err = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(err, f"mount fuse on {self.mountpoint}: {os.strerror(err)}")
        self._thread = threading.Thread(target=self._serve, name="fuse-driver", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.umount2(str(self.mountpoint).encode(), _MNT_DETACH)
        if self._thread is not None:
            self._thread.join(5)
        os.close(self._fd)

    # -- the request loop ----------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            try:
                request = os.read(self._fd, 1 << 20)
            except OSError as e:
                if e.errno in (errno.EINTR, errno.ENOENT):  # interrupted / request gone
                    continue
                return  # ENODEV: unmounted
            header = _IN_HEADER.unpack_from(request)
            opcode, unique, node = header[1], header[2], header[3]
            if opcode in _NO_REPLY:
                continue
            body = request[_IN_HEADER.size:header[0]]
            try:
                error, reply = self._answer(opcode, node, body)
            except Exception as e:  # a bug here must show in the test, not hang the caller
                self.errors.append(f"opcode {opcode}: {e!r}")
                error, reply = -errno.EIO, b""
            out = _OUT_HEADER.pack(_OUT_HEADER.size + len(reply), error, unique) + reply
            with contextlib.suppress(OSError):  # the caller was interrupted: the request is gone
                os.write(self._fd, out)
            if opcode == _DESTROY:
                return

    def _answer(self, opcode: int, node: int, body: bytes) -> tuple[int, bytes]:
        if opcode == _INIT:
            _major, minor = struct.unpack_from("<II", body)
            return 0, _INIT_OUT.pack(7, min(minor, 31), 0, 0, 1, 1, 1 << 16, 1, 32, 0, 0, 0, 0)
        if opcode == _LOOKUP:
            name = body.split(b"\0", 1)[0].decode()
            if node != _ROOT_NODE or name not in self._nodes:
                return -errno.ENOENT, b""
            child = self._nodes[name]
            return 0, struct.pack("<QQQQII", child, 0, 0, 0, 0, 0) + self._attr(child)
        if opcode == _GETATTR:
            return 0, struct.pack("<QII", 0, 0, 0) + self._attr(node)
        if opcode == _OPEN:
            return 0, struct.pack("<QIi", node, 0, 0)
        if opcode in (_FLUSH, _RELEASE, _DESTROY):
            return 0, b""
        if opcode == _IOCTL:
            fh, _flags, cmd, _arg, in_size, out_size = _IOCTL_IN.unpack_from(body)
            block = body[_IOCTL_IN.size:_IOCTL_IN.size + in_size]
            result, answer = self._handler(self._names.get(int(fh), "?"), cmd, block)
            answer = answer[:out_size]
            return 0, _IOCTL_OUT.pack(result, 0, 0, 0) + answer
        return -errno.ENOSYS, b""

    def _attr(self, node: int) -> bytes:
        mode = (stat.S_IFDIR | 0o755) if node == _ROOT_NODE else (stat.S_IFREG | 0o666)
        return _ATTR.pack(node, 0, 0, 0, 0, 0, 0, 0, 0, mode, 2 if node == _ROOT_NODE else 1,
                          0, 0, 0, 4096, 0)
