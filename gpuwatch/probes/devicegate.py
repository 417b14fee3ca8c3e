"""BpfDeviceGate: device isolation with a cgroup device BPF program (the enforcer's DeviceGate).

`allow_only(cgroup_id, (0,))` lets the processes of that cgroup (and of cgroups below it)
open only GPU node 0 among the GPU nodes `<prefix>N`; opening another GPU's node fails with
EPERM in the kernel, before the driver sees it. Control nodes and every other device are
left to the runtime's own rules. bpf/devicegate.bpf.c holds the program and the verdict.

Mechanics, reusing the probes' machinery: bcc_loader compiles and loads the program in its
short-lived child (unit "devicegate"), the fds come back over the socket; the agent fills
two maps (GPU node numbers -> index, gated cgroup id -> allowed mask) and attaches the
program to each gated cgroup's v2 directory with a BPF link (bpfsys.attach_cgroup_link:
always BPF_F_ALLOW_MULTI, so it composes with the device program runc/crun attach on pure
v2 hosts and with the v1 devices controller on hybrid ones). A link lives only as long as
its fd: clear()/close() close it, and if the agent dies in any other way the kernel closes
it — no program is ever left attached behind the agent.
"""

from __future__ import annotations

import atexit
import logging
import os
import struct
import threading
import time

from gpuwatch.containers.cgroupfs import CgroupIdIndex, cgroup_dir, discover_mounts
from gpuwatch.core.errors import EnforcementError, ProbesUnavailable
from gpuwatch.probes import bcc_loader, bpfsys, layout
from gpuwatch.probes.devnodes import DevNum, GpuNodes, resolve_gpu_nodes

log = logging.getLogger(__name__)


def _node_key(nums: DevNum) -> bytes:
    return bytes(layout.GwGateNodeKey(major=nums[0], minor=nums[1]))


class BpfDeviceGate:
    """DeviceGate over a cgroup device program; one link per gated cgroup."""

    def __init__(self, device_prefix: str = "/dev/nvidia", cgroup_root: str | None = None) -> None:
        self.device_prefix = device_prefix
        self.cgroup_root = cgroup_root
        self.load_s = 0.0
        self._objs: bcc_loader.LoadedObjects | None = None
        self._nodes_map: bpfsys.BpfMap | None = None
        self._allow_map: bpfsys.BpfMap | None = None
        self._nodes: dict[int, DevNum] = {}
        self._links: dict[int, int] = {}  # cgroup id -> link fd
        self._index: CgroupIdIndex | None = None
        self._reported: set[str] = set()
        self._lock = threading.RLock()

    # ---- lifecycle ------------------------------------------------------------------------
    def load(self) -> None:
        """Compile and load the program (idempotent). ProbesUnavailable says what is off."""
        with self._lock:
            if self._objs is not None:
                return
            if os.geteuid() != 0:
                raise ProbesUnavailable("device isolation off: not running as root",
                                        fix="run the agent as root (CAP_BPF + CAP_SYS_ADMIN)")
            root = self.cgroup_root or discover_mounts().unified
            if root is None:
                raise ProbesUnavailable("device isolation off: no cgroup v2 hierarchy is mounted",
                                        fix="mount cgroup2 (e.g. at /sys/fs/cgroup/unified on hybrid hosts)")
            t0 = time.monotonic()
            objs = bcc_loader.load_programs(bcc_loader.LoadRequest(unit=bcc_loader.DEVICE_GATE_UNIT))
            try:
                self._nodes_map = bpfsys.BpfMap(objs.maps["gw_gate_nodes"], "gw_gate_nodes")
                self._allow_map = bpfsys.BpfMap(objs.maps["gw_gate_allow"], "gw_gate_allow")
                if bcc_loader.DEVICE_GATE_PROGRAM not in objs.progs:
                    raise KeyError(bcc_loader.DEVICE_GATE_PROGRAM)
            except (OSError, KeyError) as err:
                objs.close()
                raise ProbesUnavailable(f"device isolation off: the loader returned unusable objects ({err})",
                                        fix="run `gpuwatch doctor`") from err
            self._objs = objs
            self._index = CgroupIdIndex(root, time.monotonic, rescan_min_interval_s=0.0)
            self.load_s = time.monotonic() - t0
            atexit.register(self.close)

    def close(self) -> None:
        """Detach from every cgroup and unload. Safe to call any number of times."""
        with self._lock:
            for cgroup_id in list(self._links):
                self._detach(cgroup_id)
            self._nodes_map = self._allow_map = None
            self._nodes.clear()
            if self._objs is not None:
                self._objs.close()
                self._objs = None
            atexit.unregister(self.close)

    @property
    def loaded(self) -> bool:
        return self._objs is not None

    def gated(self) -> tuple[int, ...]:
        """Cgroup ids the program is attached to now."""
        with self._lock:
            return tuple(sorted(self._links))

    def prog_id(self) -> int | None:
        """Kernel id of the loaded program (tests check it is attached / gone)."""
        with self._lock:
            if self._objs is None:
                return None
            return bpfsys.prog_id(self._objs.progs[bcc_loader.DEVICE_GATE_PROGRAM])

    # ---- DeviceGate -----------------------------------------------------------------------
    def allow_only(self, cgroup_id: int, gpu_indices: tuple[int, ...]) -> None:
        """Let cgroup `cgroup_id` open only the GPU nodes of `gpu_indices` (others: EPERM).
        EnforcementError when the cgroup is gone or the kernel refuses the attachment."""
        self.load()
        with self._lock:
            assert self._allow_map is not None
            self._refresh_nodes()
            mask = 0
            for index in gpu_indices:
                if 0 <= index < layout.GW_GATE_MAX_GPUS:
                    mask |= 1 << index
            key = struct.pack("<Q", cgroup_id)
            self._allow_map.update(key, bytes(layout.GwGateAllow(gpu_mask=mask)))
            if cgroup_id in self._links:
                return
            try:
                self._links[cgroup_id] = self._attach(cgroup_id)
            except EnforcementError:
                self._allow_map.delete(key)
                raise
            log.info("device gate: cgroup %d may open GPU nodes %s of %s", cgroup_id,
                     list(gpu_indices), sorted(self._nodes))

    def clear(self, cgroup_id: int) -> None:
        """Lift the gate from a cgroup (detach its link, forget its mask)."""
        with self._lock:
            self._detach(cgroup_id)

    # ---- internals ------------------------------------------------------------------------
    def _detach(self, cgroup_id: int) -> None:
        link = self._links.pop(cgroup_id, None)
        if link is not None:
            bpfsys.close_all([link])
        if self._allow_map is not None:
            self._allow_map.delete(struct.pack("<Q", cgroup_id))

    def _attach(self, cgroup_id: int) -> int:
        assert self._index is not None and self._objs is not None
        path = self._index.path_for_id(cgroup_id)
        if path is None or self._index.unified_root is None:
            raise EnforcementError(f"device gate: no cgroup v2 directory has id {cgroup_id} (container gone?)",
                                   fix="nothing to do if the container exited; else check the v2 mount")
        directory = cgroup_dir(self._index.unified_root, path)
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as err:
            raise EnforcementError(f"device gate: cannot open cgroup {directory}: {err}",
                                   fix="nothing to do if the container exited") from err
        try:
            if os.fstat(fd).st_ino != cgroup_id:
                raise EnforcementError(f"device gate: cgroup {directory} was recreated (id changed)",
                                       fix="none needed: the next snapshot gates the new cgroup")
            prog_fd = self._objs.progs[bcc_loader.DEVICE_GATE_PROGRAM]
            try:
                return bpfsys.attach_cgroup_link(prog_fd, fd, bpfsys.BPF_CGROUP_DEVICE)
            except OSError as err:
                raise EnforcementError(f"device gate: the kernel refused to attach to {directory}: {err}",
                                       fix="the kernel needs CONFIG_CGROUP_BPF and BPF links (>= 5.7)") from err
        finally:
            os.close(fd)

    def _refresh_nodes(self) -> None:
        """Re-stat the GPU nodes and bring gw_gate_nodes in line (a node may have appeared)."""
        assert self._nodes_map is not None
        found: GpuNodes = resolve_gpu_nodes(self.device_prefix)
        for index, why in sorted(found.ungated.items()):
            if why not in self._reported:
                self._reported.add(why)
                log.warning("device gate cannot judge GPU %d (it stays allowed): %s", index, why)
        if found.numbers == self._nodes:
            return
        for index, nums in self._nodes.items():
            if found.numbers.get(index) != nums:
                self._nodes_map.delete(_node_key(nums))
        for index, nums in found.numbers.items():
            self._nodes_map.update(_node_key(nums), bytes(layout.GwGateNode(index=index)))
        self._nodes = dict(found.numbers)
