"""Re-issue a recorded ioctl trace on the simulated node's device nodes (`gpuwatch sim replay`).

One replaying process (this one) issues the trace's calls in order: opens of /dev/nvidiaX go
to <sim root>/dev/nvidiaX, fds are remapped, and each ioctl's parameter block and the blocks
it points to are rebuilt in this process's memory with the pointers patched to the new
buffers. Two ways to deliver the driver's answer:

* driver "none" (default): the *after* image (the driver's answer) is written into the
  buffers before the syscall, which the sim's /dev/null-like nodes ignore; the probes, which
  read at syscall exit, see the answer — but so would a probe that wrongly read at entry.
* driver "fuse": the replayer enters its own mount namespace and mounts a user-space driver
  (gpuwatch/sim/fusedev.py) over <sim root>/dev; the ioctl argument's block is built from the
  *before* image and the driver writes the recorded *after* image into it during the call,
  as the kernel module does (status, chosen handles, VID_HEAP sizes arrive at exit only).
  Blocks the argument points to still carry their after image beforehand (FUSE can copy back
  only the argument's own block). The call returns the recorded result.

An RM_ALLOC whose pAllocParms block the trace does not carry (a trace made before the
recorder sized those blocks by class: real libcuda sends paramsSize 0) gets a zero-filled block
of the class's size (layout.RM_ALLOC_PARAMS_BYTES), never the recorded address, which in this
process points at whatever happens to be mapped there; one line on stderr says so, since the
probes then decode those allocations as 0 bytes.

mmaps are not replayed (no probe decodes them). A checkpoint hands control to a callback,
which can pause while a test reads the probe maps and compares them with the recorded NVML
numbers.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from gpuwatch.core.errors import SimError
from gpuwatch.probes.layout import RM_ALLOC_PARAMS_BYTES
from gpuwatch.sim import fusedev
from gpuwatch.sim.tracefile import (
    DEVICE_PATH_PREFIX,
    IOCTL_XFER_CMD_NR,
    NV_IOCTL_MAGIC,
    RM_ALLOC_PARAMS_AT,
    XFER_PTR_AT,
    Block,
    Checkpoint,
    Close,
    Dup,
    Exit,
    Ioctl,
    Open,
    Trace,
    rm_alloc_of,
)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
_libc.ioctl.restype = ctypes.c_int

CheckpointHook = Callable[[Checkpoint], None]
DRIVERS = ("none", "fuse")


@dataclass
class ReplayReport:
    """What one replay issued."""

    opens: int = 0
    ioctls: int = 0
    checkpoints: int = 0
    exit_status: int | None = None


def device_node(dev_dir: Path, recorded_path: str) -> Path:
    """/dev/nvidiactl -> <dev_dir>/nvidiactl (the sim's nodes carry the real names)."""
    return dev_dir / recorded_path.removeprefix("/dev/")


def check_nodes(trace: Trace, dev_dir: Path) -> None:
    """Every node the trace opens must exist on the simulated node (before anything runs)."""
    missing = [str(device_node(dev_dir, p)) for p in trace.device_paths if not device_node(dev_dir, p).exists()]
    if missing:
        gpus = len(trace.header.get("gpus", []))
        raise SimError(f"the simulated node lacks device nodes the trace opens: {', '.join(missing)}",
                       fix=f"run `gpuwatch sim up --devices {max(gpus, 1)}` (or pass --sim-root of a node "
                           "with those nodes)")


def _materialize(block: Block, keep: list[ctypes.Array[ctypes.c_char]], image: str = "after") -> int:
    """Build `block` in memory (the argument's own block from `image`, the blocks it points to
    from their after image, pointers patched in); returns its address. Every buffer is appended
    to `keep` so it lives until the call is done."""
    data = block.before if image == "before" else block.after
    buf = ctypes.create_string_buffer(data, max(len(data), 8))
    keep.append(buf)
    for at, child in block.nested:
        struct.pack_into("<Q", buf, at, _materialize(child, keep))
    return ctypes.addressof(buf)


def _patched_after(block: Block, built: ctypes.Array[ctypes.c_char]) -> bytes:
    """The argument's after image with the nested pointers of the block already built."""
    answer = bytearray(block.after)
    for at, _child in block.nested:
        answer[at:at + 8] = built.raw[at:at + 8]
    return bytes(answer)


def _zero_filled_alloc_params(nr: int, block: Block) -> tuple[Block, int]:
    """`block` (the parameter struct of escape `nr`) with a zero-filled pAllocParms block
    where it is an RM_ALLOC that passed a pointer but carries no captured block, sized as the
    RM sizes it (by class; an unknown class by its paramsSize). Returns the block and how
    many bytes were filled in (-1: nothing to fill)."""
    alloc = rm_alloc_of(nr, block)
    if alloc is not None:
        if alloc.params is not None or alloc.params_address == 0:
            return block, -1
        size_bytes = RM_ALLOC_PARAMS_BYTES.get(alloc.hclass, alloc.params_size)
        zeros = Block(after=bytes(size_bytes), before=bytes(size_bytes))
        return replace(block, nested=(*block.nested, (RM_ALLOC_PARAMS_AT, zeros))), size_bytes
    if nr == IOCTL_XFER_CMD_NR and len(block.before) >= 4:
        inner_nr = struct.unpack_from("<I", block.before, 0)[0] & 0xFF
        nested = dict(block.nested)
        if XFER_PTR_AT in nested:
            inner, filled = _zero_filled_alloc_params(inner_nr, nested[XFER_PTR_AT])
            if filled >= 0:
                nested[XFER_PTR_AT] = inner
                return replace(block, nested=tuple(nested.items())), filled
    return block, -1


def fill_missing_alloc_params(trace: Trace) -> tuple[dict[int, Block], int]:
    """The parameter blocks to issue instead of the recorded ones (by event line) so that no
    RM_ALLOC points at an address of the recorded process, and how many of them lost bytes
    the RM would have read (filled with zeros: the trace carries no allocation sizes)."""
    blocks: dict[int, Block] = {}
    lost = 0
    for event in trace.events:
        if isinstance(event, Ioctl) and (event.cmd >> 8) & 0xFF == NV_IOCTL_MAGIC:
            block, filled = _zero_filled_alloc_params(event.cmd & 0xFF, event.params)
            if filled >= 0:
                blocks[event.line] = block
                lost += filled > 0
    return blocks, lost


class Replayer:
    """Issues a checked Trace on the device nodes under `dev_dir`."""

    def __init__(self, dev_dir: Path, on_checkpoint: CheckpointHook | None = None, driver: str = "none",
                 stderr: TextIO | None = None) -> None:
        if driver not in DRIVERS:
            raise SimError(f"unknown replay driver {driver!r}", fix=f"use one of: {', '.join(DRIVERS)}")
        self.dev_dir = dev_dir
        self.on_checkpoint = on_checkpoint
        self.driver = driver
        self._fds: dict[int, int] = {}  # recorded fd -> our fd
        self._answer: tuple[int, bytes] | None = None  # what the fuse driver writes back next
        self._params: dict[int, Block] = {}  # event line -> the block issued instead (see fill_missing_alloc_params)
        self._stderr = stderr

    def _note_missing_sizes(self, trace: Trace) -> None:
        self._params, lost = fill_missing_alloc_params(trace)
        if lost:
            print(f"{trace.path}: the trace carries no allocation sizes ({lost} RM_ALLOC parameter blocks were "
                  "not recorded: recorded by a recorder that followed paramsSize, which real libcuda sends "
                  "as 0); they are replayed as zeros, so the probes decode those allocations as 0 bytes",
                  file=self._stderr or sys.stderr, flush=True)

    def replay(self, trace: Trace) -> ReplayReport:
        check_nodes(trace, self.dev_dir)
        self._note_missing_sizes(trace)
        if self.driver != "fuse":
            return self._replay(trace)
        why = fusedev.available()
        if why:
            raise SimError(f"--driver fuse is not available here: {why}", fix="run as root, or use --driver none")
        try:
            fusedev.enter_private_mount_namespace()
        except OSError as err:
            raise SimError(f"--driver fuse: {err}", fix="run the replay as root from a single-threaded "
                                                         "process, or use --driver none") from err
        names = sorted(p.name for p in self.dev_dir.iterdir())
        with fusedev.FuseDriver(self.dev_dir, names, self._driver_answer) as driver:
            try:
                return self._replay(trace)
            finally:
                self.close_all()  # before the driver goes: a close sends it FLUSH/RELEASE
                if driver.errors:
                    raise SimError(f"the replay driver failed: {driver.errors[0]}")

    def _driver_answer(self, name: str, cmd: int, block: bytes) -> tuple[int, bytes]:
        if self._answer is None:  # a call the replayer did not issue: answer like an empty driver
            return -25, block  # ENOTTY
        return self._answer

    def _replay(self, trace: Trace) -> ReplayReport:
        report = ReplayReport()
        for event in trace.events:
            if isinstance(event, Open):
                if event.fd >= 0:
                    self._replace(event.fd, self._open(event.path))
                    report.opens += 1
            elif isinstance(event, Close):
                os.close(self._fds.pop(event.fd))
            elif isinstance(event, Dup):
                self._replace(event.newfd, os.dup(self._fds[event.fd]))
            elif isinstance(event, Ioctl):
                self._ioctl(event)
                report.ioctls += 1
            elif isinstance(event, Checkpoint):
                report.checkpoints += 1
                if self.on_checkpoint is not None:
                    self.on_checkpoint(event)
            elif isinstance(event, Exit):
                report.exit_status = event.status
                break
        return report

    def close_all(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _open(self, recorded_path: str) -> int:
        assert recorded_path.startswith(DEVICE_PATH_PREFIX)
        node = device_node(self.dev_dir, recorded_path)
        try:
            return os.open(node, os.O_RDWR | os.O_CLOEXEC)  # as libcuda opens them
        except OSError as err:
            raise SimError(f"cannot open {node}: {err.strerror}", fix="run the replay as root on a node "
                                                                     "made by `gpuwatch sim up`") from err

    def _replace(self, recorded_fd: int, fd: int) -> None:
        old = self._fds.pop(recorded_fd, None)
        if old is not None:  # dup2 onto a tracked fd, or an fd number reused after a close
            os.close(old)
        self._fds[recorded_fd] = fd

    def _ioctl(self, event: Ioctl) -> None:
        keep: list[ctypes.Array[ctypes.c_char]] = []
        params = self._params.get(event.line, event.params)
        if self.driver == "fuse":
            address = _materialize(params, keep, image="before")
            self._answer = (event.result, _patched_after(params, keep[0]))
            try:
                _libc.ioctl(self._fds[event.fd], event.cmd, address)  # the driver answers during the call
            finally:
                self._answer = None
        else:
            address = _materialize(params, keep)
            _libc.ioctl(self._fds[event.fd], event.cmd, address)  # result ignored: no driver answers
        del keep
