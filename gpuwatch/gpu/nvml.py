"""NVML implementation of the GPU backend -- the only module that imports pynvml.

How it reads (modelled on nvitop's NVML handling):
* `nvmlInit` once per backend; static per-device fields (name, uuid, PCI bus id, minor
  number, power limit, MIG layout, which memory-info version works) are read once and
  cached. A sweep then makes a fixed number of NVML calls per *device* -- never per
  process: memory, utilisation, temperature, power, the compute and graphics process
  lists, and one `nvmlDeviceGetProcessUtilization` with the last-seen timestamp.
* Every field is read independently: an NVML error turns that one field into ``None``
  (N/A) and is counted in `errors_total` / named in `GpuSweep.errors`. A field that
  answers NOT_SUPPORTED is a capability the GPU lacks (MIG mode on a non-MIG GPU): N/A,
  not counted, and not asked again (`unsupported_fields()` lists them).
* Errors that mean "no NVML at all" (uninitialised, driver not loaded, library/driver
  mismatch, the device count changed or cannot be read) raise `NvmlCallFailed` so the
  sampler marks the GPU backend down and recreates the backend later.
* Kernel time: `nvmlDeviceGetProcessUtilization` with the last-seen timestamp returns the
  samples since the last read; each stands for the period it covers (gpu/samples.py), so a
  process's GPU seconds are what its samples cover, never its average share x the interval.
  `NVML_ERROR_NOT_FOUND` means "no new samples": the previous *share* is held for
  `util_hold_s`, and no seconds are charged.
* Health inputs: per sweep, the Xid codes drained from the event set, GPU_IS_LOST, the
  volatile uncorrectable ECC count and the row-remapping failure flag (two calls per
  GPU); the CUDA compute capability is static.
* DCGM's default fields (`DeviceFields`, issue 19), per physical GPU per sweep: one batched
  `nvmlDeviceGetFieldValues` (memory temperature, total energy, PCIe replays and TX/RX bytes,
  NVLink data TX/RX), the SM and memory clocks and the encoder/decoder utilisation (NVML has
  no field ids for those four); the remapped-row counts come from the health call above. A
  field the GPU lacks is dropped from the batch after its first NOT_SUPPORTED, as any field is.
* Topology (`GpuSweep.topology`) is read once per backend: PCIe common ancestor of every
  pair of physical GPUs, and their NVLinks (direct, or through NVSwitches). A failure
  there costs the topology detail, never the backend.

The simulated node: pass `library_path` (or set GPUWATCH_NVML_LIBRARY) to the fake
`libnvidia-ml.so.1`; it is loaded with RTLD_GLOBAL before `nvmlInit`, so pynvml's
`CDLL("libnvidia-ml.so.1")` resolves to it (same soname). A process can hold only one
NVML library: the first one pynvml loaded stays for the life of the process.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pynvml

from gpuwatch.core.errors import NvmlCallFailed, NvmlUnavailable
from gpuwatch.core.model import (
    DeviceFields,
    DeviceInfo,
    GpuLink,
    GpuProcess,
    GpuSweep,
    GpuTopology,
    ProcessKind,
    TopologyLevel,
)
from gpuwatch.gpu.samples import SampleTimeline, integrate

ENV_LIBRARY = "GPUWATCH_NVML_LIBRARY"
SIM_NAME_PREFIX = "gpuwatch-sim"

# Return codes after which no further sweep can succeed with this handle set.
_FATAL_CODES = frozenset(
    code
    for code in (
        getattr(pynvml, "NVML_ERROR_UNINITIALIZED", None),
        getattr(pynvml, "NVML_ERROR_DRIVER_NOT_LOADED", None),
        getattr(pynvml, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", None),
        getattr(pynvml, "NVML_ERROR_LIBRARY_NOT_FOUND", None),
    )
    if code is not None
)
_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
_NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
_TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
_INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
_NVLINK_LINKS = 18  # NVML_NVLINK_MAX_LINKS of the drivers this targets (535-570; pynvml may say more)
_NVLINK_GPU = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
_NVLINK_SWITCH = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
_VALUE_NOT_AVAILABLE = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value

# The batched fields: (DeviceFields attribute, NVML field id, scale to the attribute's unit).
# NVLink throughput is asked with scopeId 0, the device total as NVIDIA's samples read it.
_BATCHED_FIELDS: tuple[tuple[str, int, float], ...] = (
    ("memory_temperature_celsius", pynvml.NVML_FI_DEV_MEMORY_TEMP, 1.0),
    ("energy_joules_total", pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, 1e-3),  # mJ
    ("pcie_replays_total", pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER, 1.0),
    ("pcie_transmitted_bytes_total", pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 1.0),
    ("pcie_received_bytes_total", pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 1.0),
    ("nvlink_transmitted_bytes_total", pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 1024.0),  # KiB
    ("nvlink_received_bytes_total", pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 1024.0),
)
_INT_FIELDS = frozenset(("pcie_replays_total", "pcie_transmitted_bytes_total", "pcie_received_bytes_total",
                         "nvlink_transmitted_bytes_total", "nvlink_received_bytes_total"))

# Xid codes after which the GPU needs a reset (NVIDIA's Xid catalogue): double-bit ECC,
# fell off the bus, contained/uncontained ECC errors, GSP errors. A device that saw one
# is unhealthy until it comes back from being lost (a reset) or the agent restarts.
_FATAL_XIDS = frozenset({48, 79, 94, 95, 119, 120})

_NVML_MISSING_FIX = (
    "install the NVIDIA driver so that `nvidia-smi` works (the agent must see "
    "libnvidia-ml.so.1); on a host without GPUs run the simulated node (`gpuwatch sim up`) "
    "and pass --nvml-library or set GPUWATCH_NVML_LIBRARY to its libnvidia-ml.so.1"
)

# Libraries preloaded for pynvml; kept referenced so they are never unloaded.
_PRELOADED: dict[str, ctypes.CDLL] = {}

T = TypeVar("T")


def preload_library(path: str) -> None:
    """Load `path` RTLD_GLOBAL so pynvml's `CDLL("libnvidia-ml.so.1")` resolves to it."""
    if path in _PRELOADED:
        return
    if not os.path.exists(path):
        raise NvmlUnavailable(f"NVML library {path} does not exist",
                              fix="build/start the simulated node (`gpuwatch sim up`) or fix the path")
    try:
        _PRELOADED[path] = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise NvmlUnavailable(f"cannot load NVML library {path}: {err}",
                              fix="pass a libnvidia-ml.so.1 built for this machine") from err


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


@dataclass
class _Device:
    """Static facts about one device (or MIG instance) plus per-device read state."""

    handle: Any
    index: int
    uuid: str
    name: str
    pci_bus_id: str | None
    minor_number: int | None
    power_limit_watts: float | None
    memory_total_bytes: int | None = None
    mig_index: int | None = None
    parent_uuid: str | None = None
    mig_enabled: bool = False  # a parent whose processes live on its MIG instances
    memory_v2: bool = True
    unsupported: set[str] = field(default_factory=set)
    util_timeline: SampleTimeline = field(default_factory=SampleTimeline)  # process-utilisation samples read
    util_call_cpu_s: float = 0.0  # CPU one nvmlDeviceGetProcessUtilization costs here (moving average)
    next_util_read_s: float = 0.0  # clock time from which the next sweep reads the samples
    held_util: dict[int, tuple[float, float]] = field(default_factory=dict)  # pid -> (ratio, seen_s)
    buffers: dict[str, tuple[int, Any]] = field(default_factory=dict)  # NVML function -> (capacity, array)
    process_objects: dict[tuple[Any, ...], GpuProcess] = field(default_factory=dict)
    xid_errors_total: int = 0
    xid_events: list[int] = field(default_factory=list)  # Xid codes drained in the current sweep
    last_xid: int = 0  # the last Xid code drained since the backend started (0: none)
    compute_capability: tuple[int, int] | None = None
    fatal_xid: bool = False
    lost: bool = False  # GPU_IS_LOST seen in the current sweep
    lost_reported: bool = False  # the loss was already counted as an error

    @property
    def is_mig(self) -> bool:
        return self.mig_index is not None


DEFAULT_UTIL_CPU_BUDGET_RATIO = 0.003  # of one core, for all GPUs' process-sample reads together
MAX_UTIL_READ_GAP_S = 6.0  # half the driver's 72-sample ring at 1/6 s: no sample is lost


class NvmlBackend:
    """GpuBackend over NVML (pynvml). One instance per nvmlInit/nvmlShutdown pair."""

    def __init__(self, library_path: str | None = None, util_hold_s: float = 3.0,
                 clock: Callable[[], float] = time.monotonic,
                 util_cpu_budget_ratio: float = DEFAULT_UTIL_CPU_BUDGET_RATIO,
                 cpu_clock: Callable[[], float] = time.thread_time, read_fields: bool = True) -> None:
        """`read_fields=False` leaves DCGM's default fields unread (DeviceInfo.fields None): the
        baseline bench_pipeline measures their cost against."""
        self._clock = clock
        self._read_fields = read_fields
        self._cpu_clock = cpu_clock
        self._util_hold_s = util_hold_s
        self._util_cpu_budget_ratio = util_cpu_budget_ratio
        self.errors_total = 0
        self._sweep_errors: list[str] = []
        path = library_path or os.environ.get(ENV_LIBRARY) or None
        if path:
            preload_library(path)
        self.library_path = path
        self._init_nvml()
        self._closed = False
        try:
            self.driver_version = self._optional("driver_version", pynvml.nvmlSystemGetDriverVersion)
            self.cuda_driver_version = self._optional("cuda_driver_version",
                                                      pynvml.nvmlSystemGetCudaDriverVersion)
            self._device_count = self._whole(pynvml.nvmlDeviceGetCount, "nvmlDeviceGetCount")
            self._devices = self._enumerate(self._device_count)
            self._event_set = self._register_xid_events()
        except BaseException:
            self.close()
            raise
        self.topology = self._read_topology()
        self.simulated = any(d.name.startswith(SIM_NAME_PREFIX) for d in self._devices)

    # ---- lifecycle ------------------------------------------------------------------

    @staticmethod
    def _init_nvml() -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound as err:
            raise NvmlUnavailable("NVML (libnvidia-ml.so.1) not found: no NVIDIA driver on this host",
                                  fix=_NVML_MISSING_FIX) from err
        except pynvml.NVMLError_DriverNotLoaded as err:
            raise NvmlUnavailable("the NVIDIA kernel driver is not loaded",
                                  fix="load it (`modprobe nvidia`) and check `dmesg`; "
                                      + _NVML_MISSING_FIX) from err
        except pynvml.NVMLError_NoPermission as err:
            raise NvmlUnavailable("no permission to initialise NVML",
                                  fix="run as root or give the agent access to /dev/nvidia*") from err
        except pynvml.NVMLError as err:
            raise NvmlUnavailable(f"nvmlInit failed: {err}", fix=_NVML_MISSING_FIX) from err

    def close(self) -> None:
        """nvmlShutdown (once). Errors are counted, never raised: the driver may be gone."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        event_set = getattr(self, "_event_set", None)
        if event_set is not None:
            try:
                pynvml.nvmlEventSetFree(event_set)
            except pynvml.NVMLError:
                self.errors_total += 1
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            self.errors_total += 1

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- error helpers --------------------------------------------------------------

    def _whole(self, fn: Callable[..., T], what: str, *args: object) -> T:
        """A call without which no sweep is possible: any NVML error raises."""
        try:
            return fn(*args)
        except pynvml.NVMLError as err:
            raise NvmlCallFailed(f"NVML {what} failed: {err}",
                                 fix="check the NVIDIA driver (`nvidia-smi`) or the simulated node "
                                     "(`gpuwatch sim status`); the agent retries") from err

    def _note(self, message: str) -> None:
        self.errors_total += 1
        self._sweep_errors.append(message)

    def _optional(self, what: str, fn: Callable[..., T], *args: object) -> T | None:
        """A node-level call that may fail: N/A plus a counted error."""
        try:
            return fn(*args)
        except pynvml.NVMLError as err:
            if err.value in _FATAL_CODES:
                raise NvmlCallFailed(f"NVML {what} failed: {err}", fix="check the NVIDIA driver") from err
            self._note(f"{what}: {err}")
            return None

    def _field(self, dev: _Device, what: str, fn: Callable[..., T], *args: object) -> T | None:
        """Read one device field; any NVML error -> None (N/A) and a counted error."""
        if what in dev.unsupported or dev.lost:
            return None
        try:
            return fn(*args)
        except pynvml.NVMLError as err:
            code = err.value
            if code in _FATAL_CODES:
                raise NvmlCallFailed(f"NVML {what} on GPU {dev.index} failed: {err}",
                                     fix="check the NVIDIA driver; the agent retries") from err
            if code in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
                dev.unsupported.add(what)  # a capability this GPU lacks, not an error: ask no more
                return None
            if code == _GPU_IS_LOST:
                dev.lost = True
                if dev.lost_reported:  # counted once per loss, not once per sweep
                    return None
                dev.lost_reported = True
            self._note(f"GPU {dev.index} ({dev.uuid}) {what}: {err}")
            return None

    # ---- enumeration (static, once) -------------------------------------------------

    def _enumerate(self, count: int) -> list[_Device]:
        devices: list[_Device] = []
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            except pynvml.NVMLError as err:
                if err.value != _GPU_IS_LOST:
                    raise NvmlCallFailed(f"NVML nvmlDeviceGetHandleByIndex({index}) failed: {err}",
                                         fix="check the NVIDIA driver (`nvidia-smi`)") from err
                self._note(f"GPU {index}: {err}")
                devices.append(_Device(handle=None, index=index, uuid=f"lost-gpu-{index}", name="unknown",
                                       pci_bus_id=None, minor_number=None, power_limit_watts=None,
                                       lost=True, lost_reported=True))
                continue
            dev = self._static_device(handle, index)
            devices.append(dev)
            mode = self._field(dev, "mig_mode", pynvml.nvmlDeviceGetMigMode, handle)
            if mode is not None and mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
                dev.mig_enabled = True
                devices.extend(self._enumerate_mig(dev))
        return devices

    def _static_device(self, handle: Any, index: int, mig_index: int | None = None,
                       parent_uuid: str | None = None) -> _Device:
        uuid = _text(self._whole(pynvml.nvmlDeviceGetUUID, "nvmlDeviceGetUUID", handle))
        dev = _Device(handle=handle, index=index, uuid=uuid, name="", pci_bus_id=None,
                      minor_number=None, power_limit_watts=None, mig_index=mig_index,
                      parent_uuid=parent_uuid)
        name = self._field(dev, "name", pynvml.nvmlDeviceGetName, handle)
        dev.name = _text(name) if name is not None else "unknown"
        if mig_index is None:
            pci = self._field(dev, "pci_info", pynvml.nvmlDeviceGetPciInfo, handle)
            dev.pci_bus_id = _text(pci.busId) if pci is not None else None
            dev.minor_number = self._field(dev, "minor_number", pynvml.nvmlDeviceGetMinorNumber, handle)
            limit_mw = self._field(dev, "power_limit", pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            dev.power_limit_watts = limit_mw / 1000.0 if limit_mw is not None else None
            cc = self._field(dev, "compute_capability", pynvml.nvmlDeviceGetCudaComputeCapability, handle)
            dev.compute_capability = (int(cc[0]), int(cc[1])) if cc is not None else None
        return dev

    def _enumerate_mig(self, parent: _Device) -> list[_Device]:
        count = self._field(parent, "mig_count", pynvml.nvmlDeviceGetMaxMigDeviceCount, parent.handle) or 0
        found: list[_Device] = []
        for slot in range(count):
            try:
                handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent.handle, slot)
            except pynvml.NVMLError as err:
                if err.value != _NOT_FOUND:  # NOT_FOUND: no instance in this slot
                    self._note(f"GPU {parent.index} MIG slot {slot}: {err}")
                continue
            mig = self._static_device(handle, parent.index, mig_index=slot, parent_uuid=parent.uuid)
            mig.pci_bus_id = parent.pci_bus_id
            mig.minor_number = parent.minor_number
            mig.compute_capability = parent.compute_capability
            found.append(mig)
        return found

    def _register_xid_events(self) -> Any:
        """Listen for Xid errors (health). Unsupported -> no event set, health from 'lost' only."""
        try:
            event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as err:
            self._note(f"xid events: {err}")
            return None
        registered = False
        for dev in self._devices:
            if dev.is_mig:
                continue
            try:
                pynvml.nvmlDeviceRegisterEvents(dev.handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
                registered = True
            except pynvml.NVMLError as err:
                self._note(f"GPU {dev.index} xid events: {err}")
        if not registered:
            try:
                pynvml.nvmlEventSetFree(event_set)
            except pynvml.NVMLError:
                self.errors_total += 1
            return None
        return event_set

    # ---- topology (static, once) -------------------------------------------------------

    def _read_topology(self) -> GpuTopology:
        """PCIe common ancestors and NVLinks of every ordered pair of physical GPUs.

        Never raises: an NVML error costs the detail it was asking for (level None, no
        links), counted in `errors_total`."""
        physical = [d for d in self._devices if not d.is_mig]
        try:
            levels = self._topology_levels(physical)
            supported, direct, switch_links = self._nvlinks(physical)
        except pynvml.NVMLError as err:  # a fatal code mid-way: keep the backend, drop the detail
            self._note(f"topology: {err}")
            return GpuTopology()
        nvswitch = any(switch_links.values())
        links = []
        for a in physical:
            for b in physical:
                if a is b:
                    continue
                count = direct.get((a.index, b.index), 0)
                if nvswitch:
                    count += min(switch_links.get(a.index, 0), switch_links.get(b.index, 0))
                links.append(GpuLink(gpu_index=a.index, peer_index=b.index,
                                     level=levels.get((a.index, b.index)), nvlinks=count))
        return GpuTopology(links=tuple(links), nvswitch=nvswitch, nvlink_supported=supported)

    def _topology_levels(self, physical: list[_Device]) -> dict[tuple[int, int], TopologyLevel | None]:
        levels: dict[tuple[int, int], TopologyLevel | None] = {}
        for n, a in enumerate(physical):
            for b in physical[n + 1:]:
                level: TopologyLevel | None = None
                if a.handle is not None and b.handle is not None:
                    try:
                        level = TopologyLevel(pynvml.nvmlDeviceGetTopologyCommonAncestor(a.handle, b.handle))
                    except pynvml.NVMLError as err:
                        self._note(f"GPU {a.index}-{b.index} topology: {err}")
                    except ValueError:  # a level this NVML knows and we do not: say nothing
                        level = None
                levels[(a.index, b.index)] = levels[(b.index, a.index)] = level
        return levels

    def _nvlinks(self, physical: list[_Device]
                 ) -> tuple[bool, dict[tuple[int, int], int], dict[int, int]]:
        """(NVLink supported anywhere, active links GPU->peer GPU, active links GPU->NVSwitch)."""
        by_bus = {key: d.index for d in physical if (key := _bus_key(d.pci_bus_id)) is not None}
        direct: dict[tuple[int, int], int] = {}
        switch_links: dict[int, int] = {}
        supported = False
        ask_type = True  # nvmlDeviceGetNvLinkRemoteDeviceType exists and answers
        for dev in physical:
            if dev.handle is None:
                continue
            for link in range(_NVLINK_LINKS):
                try:
                    active = pynvml.nvmlDeviceGetNvLinkState(dev.handle, link)
                except pynvml.NVMLError as err:
                    if link == 0 and err.value in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
                        break  # no NVLink on this GPU (PCIe card, VM): ask no more
                    if err.value in (_NOT_SUPPORTED, _INVALID_ARGUMENT):
                        break  # past the links this GPU has
                    self._note(f"GPU {dev.index} NVLink {link} state: {err}")
                    if err.value == _GPU_IS_LOST:
                        break
                    continue
                supported = True
                if active != pynvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _NVLINK_GPU
                if ask_type:
                    try:
                        remote = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(dev.handle, link)
                    except pynvml.NVMLError as err:
                        if err.value in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
                            ask_type = False  # older NVML: every remote end is a GPU
                        else:
                            self._note(f"GPU {dev.index} NVLink {link} remote type: {err}")
                            continue
                if remote == _NVLINK_SWITCH:
                    switch_links[dev.index] = switch_links.get(dev.index, 0) + 1
                    continue
                if remote != _NVLINK_GPU:
                    continue  # an IBM NPU: a CPU, not a peer
                try:
                    pci = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(dev.handle, link)
                except pynvml.NVMLError as err:
                    self._note(f"GPU {dev.index} NVLink {link} remote PCI: {err}")
                    continue
                key = _bus_key(_text(pci.busId)) or (int(pci.domain), int(pci.bus), int(pci.device))
                peer = by_bus.get(key)
                if peer is not None and peer != dev.index:
                    direct[(dev.index, peer)] = direct.get((dev.index, peer), 0) + 1
        return supported, direct, switch_links

    # ---- the sweep --------------------------------------------------------------------

    @property
    def device_count(self) -> int:
        return self._device_count

    def unsupported_fields(self) -> dict[str, tuple[str, ...]]:
        """Per device uuid, the fields NVML said it does not support."""
        return {d.uuid: tuple(sorted(d.unsupported)) for d in self._devices if d.unsupported}

    def sweep(self) -> GpuSweep:
        """One read of every device, its processes and their SM utilisation."""
        if self._closed:
            raise NvmlCallFailed("NVML backend used after close()", fix="create a new NvmlBackend")
        self._sweep_errors = []
        count = self._whole(pynvml.nvmlDeviceGetCount, "nvmlDeviceGetCount")
        if count != self._device_count:
            raise NvmlCallFailed(f"GPU count changed from {self._device_count} to {count}",
                                 fix="none needed: the agent re-initialises NVML")
        now_s = self._clock()
        self._drain_xid_events()
        infos: list[DeviceInfo] = []
        processes: list[GpuProcess] = []
        for dev in self._devices:
            was_lost = dev.lost
            if dev.handle is not None:
                dev.lost = False  # re-probed every sweep: a GPU that was reset comes back
            infos.append(self._read_device(dev))
            if not dev.mig_enabled:
                processes.extend(self._read_processes(dev, now_s))
            if was_lost and not dev.lost:
                # back from lost = it was reset: the fatal Xid that came with the loss is history
                dev.lost_reported = dev.fatal_xid = False
                infos[-1] = dataclasses.replace(infos[-1], healthy=True)
        physical = [d for d in self._devices if not d.is_mig]
        if physical and all(d.lost for d in physical):
            raise NvmlCallFailed(f"all {len(physical)} GPUs are lost (NVML: GPU is lost)",
                                 fix="check `nvidia-smi` and `dmesg` (Xid 79: fallen off the bus); "
                                     "the agent retries")
        return GpuSweep(timestamp_s=now_s, devices=tuple(infos), processes=tuple(processes),
                        driver_version=_text(self.driver_version) if self.driver_version else None,
                        cuda_driver_version=self.cuda_driver_version,
                        errors=tuple(self._sweep_errors), topology=self.topology)

    def _drain_xid_events(self) -> None:
        for each in self._devices:
            each.xid_events = []
        if self._event_set is None:
            return
        by_handle = {_address(d.handle): d for d in self._devices if d.handle is not None and not d.is_mig}
        for _ in range(1024):  # bounded: never spin on a misbehaving driver
            try:
                data = pynvml.nvmlEventSetWait_v2(self._event_set, 0)
            except pynvml.NVMLError as err:
                if err.value != _TIMEOUT:
                    self._note(f"xid events: {err}")
                return
            # by handle address: a lost GPU cannot even tell its UUID any more
            dev = by_handle.get(_address(data.device))
            if dev is None:
                continue
            dev.xid_errors_total += 1
            dev.xid_events.append(int(data.eventData))
            dev.last_xid = int(data.eventData)
            if int(data.eventData) in _FATAL_XIDS:
                dev.fatal_xid = True

    def _read_memory(self, dev: _Device) -> tuple[int | None, int | None, int | None]:
        if dev.lost:
            return None, None, None
        if dev.memory_v2 and "memory_v2" not in dev.unsupported:
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(dev.handle, version=pynvml.nvmlMemory_v2)
                return int(mem.total), int(mem.used), int(mem.free)
            except pynvml.NVMLError as err:
                if err.value not in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND,
                                     getattr(pynvml, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", -1)):
                    self._field(dev, "memory", _raise, err)  # same accounting as any field
                    return None, None, None
                dev.memory_v2 = False  # old driver: v1 from now on, silently
        mem = self._field(dev, "memory", pynvml.nvmlDeviceGetMemoryInfo, dev.handle)
        if mem is None:
            return None, None, None
        return int(mem.total), int(mem.used), int(mem.free)

    def _read_device(self, dev: _Device) -> DeviceInfo:
        total, used, free = self._read_memory(dev)
        util_gpu = util_mem = temperature = power = None
        ecc: int | None = None
        remap_failure: bool | None = None
        rows: tuple[int, int, int, int] | None = None
        fields: DeviceFields | None = None
        if not dev.is_mig:  # utilisation, temperature, power and health are per physical GPU
            rates = self._field(dev, "utilization", pynvml.nvmlDeviceGetUtilizationRates, dev.handle)
            if rates is not None:
                util_gpu, util_mem = rates.gpu / 100.0, rates.memory / 100.0
            temp = self._field(dev, "temperature", pynvml.nvmlDeviceGetTemperature, dev.handle,
                               pynvml.NVML_TEMPERATURE_GPU)
            temperature = float(temp) if temp is not None else None
            power_mw = self._field(dev, "power", pynvml.nvmlDeviceGetPowerUsage, dev.handle)
            power = power_mw / 1000.0 if power_mw is not None else None
            count = self._field(dev, "ecc_uncorrected_volatile", pynvml.nvmlDeviceGetTotalEccErrors, dev.handle,
                                pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
            ecc = int(count) if count is not None else None
            rows = self._field(dev, "remapped_rows", pynvml.nvmlDeviceGetRemappedRows, dev.handle)
            remap_failure = bool(rows[3]) if rows is not None else None  # (corr, unc, pending, failure)
            if self._read_fields and not dev.lost:
                fields = self._read_device_fields(dev, rows)
        return DeviceInfo(
            index=dev.index, uuid=dev.uuid, name=dev.name, pci_bus_id=dev.pci_bus_id,
            memory_total_bytes=total, memory_used_bytes=used, memory_free_bytes=free,
            utilization_gpu_ratio=util_gpu, utilization_memory_ratio=util_mem,
            temperature_celsius=temperature, power_watts=power,
            power_limit_watts=dev.power_limit_watts, minor_number=dev.minor_number,
            is_mig=dev.is_mig, parent_uuid=dev.parent_uuid, mig_index=dev.mig_index,
            healthy=not (dev.lost or dev.fatal_xid), xid_errors_total=dev.xid_errors_total,
            simulated=dev.name.startswith(SIM_NAME_PREFIX),
            lost=dev.lost, xid_events=tuple(dev.xid_events), ecc_uncorrected_volatile=ecc,
            row_remap_failure=remap_failure, compute_capability=dev.compute_capability,
            fields=fields, last_xid=dev.last_xid,
        )

    def _read_device_fields(self, dev: _Device, rows: tuple[int, int, int, int] | None) -> DeviceFields:
        """DCGM's default fields of one physical GPU (DeviceFields): one batched field-values call,
        then the four getters NVML has no field ids for. Each reading degrades on its own, with
        `_field`'s accounting: NOT_SUPPORTED drops it for good, any other error is N/A this sweep."""
        values: dict[str, float | int | bool | None] = dict(self._batched_fields(dev))
        handle = dev.handle
        for name, clock in (("sm_clock_hertz", pynvml.NVML_CLOCK_SM), ("memory_clock_hertz", pynvml.NVML_CLOCK_MEM)):
            mhz = self._field(dev, name, pynvml.nvmlDeviceGetClockInfo, handle, clock)
            values[name] = mhz * 1e6 if mhz is not None else None
        for name, fn in (("encoder_utilization_ratio", pynvml.nvmlDeviceGetEncoderUtilization),
                         ("decoder_utilization_ratio", pynvml.nvmlDeviceGetDecoderUtilization)):
            util = self._field(dev, name, fn, handle)  # [percent, sampling period (us)]
            values[name] = util[0] / 100.0 if util is not None else None
        if rows is not None:
            values["remapped_rows_correctable"], values["remapped_rows_uncorrectable"] = int(rows[0]), int(rows[1])
            values["row_remap_pending"] = bool(rows[2])
        return DeviceFields(**values)  # type: ignore[arg-type]  # names and types from _BATCHED_FIELDS

    def _batched_fields(self, dev: _Device) -> list[tuple[str, float | int]]:
        """(attribute, value) of the batched fields that answered: one nvmlDeviceGetFieldValues
        over the fields not yet found unsupported, its entries array kept per device."""
        wanted = [f for f in _BATCHED_FIELDS if f[0] not in dev.unsupported]
        if not wanted or "field_values" in dev.unsupported:
            return []
        key = "nvmlDeviceGetFieldValues"
        capacity, entries = dev.buffers.get(key, (0, None))
        if entries is None or capacity != len(wanted):  # the set shrinks when a field proves unsupported
            entries = (_FieldValue * len(wanted))()
            dev.buffers[key] = (len(wanted), entries)
        for entry, (_, field_id, _) in zip(entries, wanted, strict=True):
            entry.fieldId, entry.scopeId = field_id, 0
        try:
            ret = pynvml._nvmlGetFunctionPointer(key)(dev.handle, ctypes.c_int32(len(wanted)), entries)
            if ret != pynvml.NVML_SUCCESS:
                raise pynvml.NVMLError(ret)
        except pynvml.NVMLError as err:
            self._field(dev, "field_values", _raise, err)
            return []
        out: list[tuple[str, float | int]] = []
        for entry, (name, _, scale) in zip(entries, wanted, strict=True):
            if entry.nvmlReturn != pynvml.NVML_SUCCESS:
                self._field(dev, name, _raise, pynvml.NVMLError(entry.nvmlReturn))
                continue
            raw = _field_value(entry)
            if raw is None:
                continue
            value = raw * scale
            out.append((name, int(value) if name in _INT_FIELDS else value))
        return out

    def _process_list(self, dev: _Device, kind: str) -> list[tuple[int, ...]]:
        """(pid, usedGpuMemory) of one running-process list, v3 entry point with v2 fallback."""
        what = f"{kind.lower()}_processes"
        if dev.lost or what in dev.unsupported:
            return []
        for version in ("_v3", "_v2"):
            if f"{what}{version}" in dev.unsupported:
                continue
            try:
                return _list_call(dev, f"nvmlDeviceGet{kind}RunningProcesses{version}", _ProcessInfo,
                                  _PROCESS_INFO)
            except pynvml.NVMLError as err:
                if err.value != _FUNCTION_NOT_FOUND:
                    self._field(dev, what, _raise, err)
                    return []
                dev.unsupported.add(f"{what}{version}")
        dev.unsupported.add(what)
        return []

    def _read_processes(self, dev: _Device, now_s: float) -> list[GpuProcess]:
        merged: dict[int, tuple[int | None, ProcessKind]] = {}
        for kind, pkind in (("Graphics", ProcessKind.GRAPHICS), ("Compute", ProcessKind.COMPUTE)):
            for pid, used in self._process_list(dev, kind):
                memory: int | None = None if used == _VALUE_NOT_AVAILABLE else used
                previous = merged.get(pid)
                kept = previous[0] if previous is not None else None
                if kept is not None and (memory is None or kept > memory):
                    memory = kept  # listed as both (C+G): one allocation, keep the larger
                merged[pid] = (memory, pkind)
        utils, seconds = self._read_process_utilization(dev, now_s, merged) if not dev.is_mig else ({}, None)
        for pid in utils:
            merged.setdefault(pid, (None, ProcessKind.COMPUTE))
        # Reuse last sweep's (immutable) objects for unchanged processes: most hold the same
        # memory and share from one sweep to the next, and building them is most of the cost.
        reuse, current = dev.process_objects, {}
        out: list[GpuProcess] = []
        for pid, (memory, kind) in merged.items():
            ran_s = None if seconds is None else seconds.get(pid, 0.0)
            key = (pid, memory, kind, utils.get(pid), ran_s)
            proc = reuse.get(key)
            if proc is None:
                proc = GpuProcess(pid=pid, gpu_uuid=dev.uuid, gpu_index=dev.index, memory_bytes=memory,
                                  kind=kind, sm_utilization_ratio=key[3], kernel_seconds=ran_s)
            current[key] = proc
            out.append(proc)
        dev.process_objects = current
        return out

    def _read_process_utilization(self, dev: _Device, now_s: float, listed: dict[int, Any]
                                  ) -> tuple[dict[int, float], dict[int, float] | None]:
        """(SM share per pid, GPU seconds per pid since the last read) from the samples newer
        than the last-seen timestamp, integrated by the time they cover (gpu/samples.py).

        Seconds are None when the call is not available (a backend without process samples:
        attribution then falls back to share x interval). A listed pid without a sample in
        the covered periods ran 0 in them. Only when the device produced no new sample at all
        does a listed pid keep its previous *share* (for `util_hold_s`; NVML's sample period
        may be longer than our interval) -- never seconds: those come with the samples.
        """
        if "process_utilization" in dev.unsupported or dev.lost:
            return {}, None
        if now_s < dev.next_util_read_s:  # not due (cadence below): shares as last read, seconds later
            return {pid: ratio for pid, (ratio, _) in dev.held_util.items() if pid in listed}, {}
        cpu_start = self._cpu_clock()
        try:
            samples = _list_call(dev, "nvmlDeviceGetProcessUtilization", _UtilSample, _UTIL_SAMPLE,
                                 last_seen_us=dev.util_timeline.newest_us)
        except pynvml.NVMLError as err:
            if err.value != _NOT_FOUND:  # NOT_FOUND: no samples newer than last-seen
                self._field(dev, "process_utilization", _raise, err)
                return {}, None
            samples = []
        self._schedule_util_read(dev, now_s, self._cpu_clock() - cpu_start)
        baseline = not dev.util_timeline.primed
        read = integrate(((s[0], s[1], s[2]) for s in samples), dev.util_timeline)
        fresh: dict[int, float] = {}
        if read.covered_s > 0:
            fresh = {pid: read.ratio(pid) for pid in read.seconds_by_pid}
        elif baseline and samples:  # the first read: shares from the samples, nothing charged
            fresh = {int(pid): min(int(pct), 100) / 100.0 for pid, _, pct in samples}
        if fresh or read.covered_s > 0:
            fresh.update((pid, 0.0) for pid in listed if pid not in fresh)  # sampled periods: it ran 0
            dev.held_util = {pid: (ratio, now_s) for pid, ratio in fresh.items() if pid in listed or ratio > 0}
            return fresh, read.seconds_by_pid
        hold_s = self._util_hold_s
        dev.held_util = kept = {pid: (ratio, seen_s) for pid, (ratio, seen_s) in dev.held_util.items()
                                if pid in listed and now_s - seen_s <= hold_s}
        return {pid: ratio for pid, (ratio, _) in kept.items()}, {}


    def _schedule_util_read(self, dev: _Device, now_s: float, call_cpu_s: float) -> None:
        """When the next sweep reads this device's samples. nvmlDeviceGetProcessUtilization is
        NVML's costly call (1.8 ms of CPU on an H100 with driver 580, against 1-80 us for the
        others: ../shared/real-gpu/README.md section 3), and the driver keeps the samples (a
        ring of 72 periods, 12 s at 1/6 s), so one call collects all since the last: the reads
        of all GPUs together may cost at most `util_cpu_budget_ratio` of a core, never more than
        MAX_UTIL_READ_GAP_S apart (half the ring). Memory and process lists stay every sweep."""
        dev.util_call_cpu_s = call_cpu_s if dev.util_call_cpu_s == 0.0 else 0.5 * (dev.util_call_cpu_s + call_cpu_s)
        if self._util_cpu_budget_ratio <= 0:
            return
        all_devices_cpu_s = dev.util_call_cpu_s * max(1, len(self._devices))
        gap_s = min(all_devices_cpu_s / self._util_cpu_budget_ratio, MAX_UTIL_READ_GAP_S)
        dev.next_util_read_s = now_s + gap_s


class _ProcessInfo(ctypes.Structure):
    """nvmlProcessInfo_v2_t / _v3_t (same layout). Plain ctypes: pynvml's printable
    structures route every field read through Python __getattribute__ (slow at scale)."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class _UtilSample(ctypes.Structure):
    """nvmlProcessUtilizationSample_t."""

    _fields_ = [("pid", ctypes.c_uint), ("timeStamp", ctypes.c_ulonglong), ("smUtil", ctypes.c_uint),
                ("memUtil", ctypes.c_uint), ("encUtil", ctypes.c_uint), ("decUtil", ctypes.c_uint)]


class _FieldValue(ctypes.Structure):
    """nvmlFieldValue_t (40 bytes): the value union read as raw bytes by `_field_value`."""

    _fields_ = [("fieldId", ctypes.c_uint), ("scopeId", ctypes.c_uint), ("timestamp", ctypes.c_longlong),
                ("latencyUsec", ctypes.c_longlong), ("valueType", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint),
                ("value", ctypes.c_ubyte * 8)]


# nvmlValueType_t -> struct format of the union member it names
_VALUE_FORMATS = {pynvml.NVML_VALUE_TYPE_DOUBLE: "@d", pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "@I",
                  pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "@L", pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "@Q",
                  pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "@q", pynvml.NVML_VALUE_TYPE_SIGNED_INT: "@i"}


def _field_value(entry: _FieldValue) -> float | int | None:
    """The number in an answered field entry; None for a value type this code does not know."""
    fmt = _VALUE_FORMATS.get(entry.valueType)
    if fmt is None:
        return None
    value: float | int = struct.unpack_from(fmt, bytes(entry.value))[0]
    return value


# Decoders over the raw arrays (native alignment, checked against ctypes below):
# (pid, usedGpuMemory) and (pid, timeStamp, smUtil).
_PROCESS_INFO = struct.Struct("@IQII")
_UTIL_SAMPLE = struct.Struct("@IQIIII")
assert _PROCESS_INFO.size == ctypes.sizeof(_ProcessInfo) and _UTIL_SAMPLE.size == ctypes.sizeof(_UtilSample)
assert ctypes.sizeof(_FieldValue) == 40


def _list_call(dev: _Device, function: str, struct_type: type[ctypes.Structure], layout: struct.Struct,
               last_seen_us: int | None = None) -> list[tuple[int, ...]]:
    """One NVML list query with a per-device buffer reused across sweeps.

    pynvml's wrappers ask for the size, allocate, then ask again (two driver calls and
    Python objects per entry); here the buffer is kept big enough that one call
    usually suffices. Returns (pid, memory) or (pid, timestamp, sm%) tuples; raises
    pynvml.NVMLError like pynvml does.
    """
    fn = pynvml._nvmlGetFunctionPointer(function)  # same lookup pynvml's own wrappers use
    capacity, buffer = dev.buffers.get(function, (0, None))
    for _ in range(3):  # the list may grow between calls; give up after a few tries
        if buffer is None:
            capacity = max(capacity, 32)
            buffer = (struct_type * capacity)()
            dev.buffers[function] = (capacity, buffer)
        count = ctypes.c_uint(capacity)
        if last_seen_us is None:
            ret = fn(dev.handle, ctypes.byref(count), buffer)
        else:
            ret = fn(dev.handle, buffer, ctypes.byref(count), ctypes.c_ulonglong(last_seen_us))
        if ret == pynvml.NVML_SUCCESS:
            raw = memoryview(buffer).cast("B")[: count.value * layout.size]
            if last_seen_us is None:
                return [(e[0], e[1]) for e in layout.iter_unpack(raw)]
            return [(e[0], e[1], e[2]) for e in layout.iter_unpack(raw)]
        if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
            raise pynvml.NVMLError(ret)
        capacity = count.value * 2 + 32
        buffer = None
    raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)


def _bus_key(bus_id: str | None) -> tuple[int, int, int] | None:
    """(domain, bus, device) of a PCI bus id: "00000000:1B:00.0" and "0000:1b:00.0" match."""
    if not bus_id:
        return None
    parts = bus_id.strip().split(":")
    try:
        device = int(parts[-1].split(".")[0], 16)
        bus = int(parts[-2], 16)
        domain = int(parts[-3], 16) if len(parts) >= 3 else 0
    except (IndexError, ValueError):
        return None
    return domain, bus, device


def _address(handle: Any) -> int | None:
    """The C pointer value of an NVML device handle (handles are compared by address)."""
    return ctypes.cast(handle, ctypes.c_void_p).value


def _raise(err: BaseException) -> None:
    """Re-raise `err` inside `_field` so an already-caught error gets the same accounting."""
    raise err
