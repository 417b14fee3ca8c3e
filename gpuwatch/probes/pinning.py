"""Optional pinning of the probe maps in bpffs, so kernel counters survive an agent restart.

Programs and attachments always die with the agent (its fds); the maps can outlive it when
pinned. On the next start, before anything is attached, `adopt_and_pin` copies every pinned
map of the previous run into the freshly loaded maps, releases the memory of processes that
exited while no agent was running (their per-process totals are subtracted from their
cgroup, exactly as the exit probe would have), and pins the new maps in place of the old.
Events during the gap are not seen: allocations made then are missing from the totals.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gpuwatch.core.errors import ProbesUnavailable
from gpuwatch.probes import bpfsys, layout

BPFFS = Path("/sys/fs/bpf")
PERSISTENT_MAPS = ("gw_stats", "gw_tgids", "gw_fds", "gw_ioctls", "gw_uvm_ioctls", "gw_mem", "gw_rm",
                   "gw_clients", "gw_gpu_minor", "gw_gpu_instance", "gw_cuda", "gw_limits", "gw_launches")


@dataclass
class AdoptReport:
    adopted_entries: dict[str, int] = field(default_factory=dict)
    released_tgids: int = 0


def _on_bpffs(path: Path, mountinfo: str) -> bool:
    resolved = str(path.resolve())
    for line in mountinfo.splitlines():
        parts = line.split()
        sep = parts.index("-")
        mountpoint, fstype = parts[4], parts[sep + 1]
        if fstype == "bpf" and (resolved == mountpoint or resolved.startswith(mountpoint.rstrip("/") + "/")):
            return True
    return False


def ensure_bpffs(pin_dir: str) -> None:
    """Make sure pin_dir lies on a bpf filesystem (mounting /sys/fs/bpf when it is missing)."""
    path = Path(pin_dir)
    if _on_bpffs(path, Path("/proc/self/mountinfo").read_text()):
        return
    if BPFFS not in (path, *path.parents):
        raise ProbesUnavailable(f"pin directory {pin_dir} is not on a bpf filesystem",
                                fix="use a directory under /sys/fs/bpf")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"bpf", str(BPFFS).encode(), b"bpf", 0, None) != 0:
        err = ctypes.get_errno()
        raise ProbesUnavailable(f"cannot mount bpffs at {BPFFS}: {os.strerror(err)}",
                                fix="mount -t bpf bpf /sys/fs/bpf")


def _release_exited(maps: dict[str, bpfsys.BpfMap], proc_root: Path) -> int:
    """Subtract the totals of processes that exited while no probe ran, drop their state."""
    tgids, mem = maps["gw_tgids"], maps["gw_mem"]
    released = 0
    for key, value in list(tgids.items()):
        tgid = struct.unpack("<I", key)[0]
        if (proc_root / str(tgid)).exists():
            continue
        st = layout.GwTgidState.from_buffer_copy(value)
        slots = [(d, st.rm_bytes[d]) for d in range(layout.GW_DEV_SLOTS)] + [(layout.GW_DEV_CUDA, st.cuda_bytes)]
        for device, nbytes in slots:
            if nbytes == 0:
                continue
            mkey = bytes(layout.GwMemKey(cgroup_id=st.cgroup_id, device=device))
            raw = mem.lookup(mkey)
            if raw is None:
                continue
            mv = layout.GwMemVal.from_buffer_copy(raw)
            mv.live_bytes -= nbytes
            mem.update(mkey, bytes(mv))
        tgids.delete(key)
        released += 1
    return released


def adopt_and_pin(maps: dict[str, bpfsys.BpfMap], pin_dir: str, proc_root: Path = Path("/proc")) -> AdoptReport:
    """Copy the previous run's pinned maps into `maps` (call before attaching), then pin."""
    ensure_bpffs(pin_dir)
    Path(pin_dir).mkdir(parents=True, exist_ok=True)
    report = AdoptReport()
    for name in PERSISTENT_MAPS:
        new = maps.get(name)
        if new is None:
            continue
        path = os.path.join(pin_dir, name)
        if os.path.exists(path):
            old_fd = bpfsys.obj_get(path)
            try:
                old = bpfsys.BpfMap(old_fd, name)
                same = (old.info.type, old.key_size, old.info.value_size) == \
                    (new.info.type, new.key_size, new.info.value_size)
                if same:
                    count = 0
                    for key, value in old.items():
                        new.update(key, value)
                        count += 1
                    report.adopted_entries[name] = count
            finally:
                os.close(old_fd)
            os.unlink(path)
        bpfsys.obj_pin(new.fd, path)
    report.released_tgids = _release_exited(maps, proc_root)
    return report


def unpin(pin_dir: str) -> None:
    """Remove the pinned maps (and the directory): the kernel frees them once unused."""
    for name in PERSISTENT_MAPS:
        try:
            os.unlink(os.path.join(pin_dir, name))
        except FileNotFoundError:
            continue
    shutil.rmtree(pin_dir, ignore_errors=True)
