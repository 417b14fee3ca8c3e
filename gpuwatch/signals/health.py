"""GPU liveness: one health verdict per GPU, with the reason, for schedulers to act on.

A GPU is **unhealthy** when (first matching reason wins):

* ``lost``: NVML answers GPU_IS_LOST (fallen off the bus, Xid 79). Healthy again as soon
  as NVML reads it again (it was reset).
* ``xid``: a critical Xid -- any code not in the ignored set -- from NVML's Xid events or
  the kernel log. Healthy again only after a reset (the GPU was lost and came back) or a
  driver reload (NVML re-initialised after an outage): a fatal Xid does not heal by itself.
* ``row-remap-failure``: nvmlDeviceGetRemappedRows reports a remapping failure. Healthy
  again when NVML stops reporting it (after a reset or RMA).
* ``ecc-uncorrectable``: the volatile uncorrectable ECC count is above 0. Healthy again
  when the volatile count is 0 (volatile counts clear on a reset).
* ``nvml-errors``: NVML could not read the GPU's memory for `nvml_error_sweeps` sweeps in
  a row, or no sweep at all was possible for that many cycles (driver gone). Healthy
  again at the first good read.

Ignored Xids (``DEFAULT_IGNORED_XIDS``) are application errors -- the device plugin's
default skip list (13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped
processing, 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout
in recent versions) -- plus NVIDIA's informational events 63 (row-remapping recording
event) and 92 (high single-bit ECC rate). They are counted per GPU and per container but
keep the GPU healthy. Everything else, e.g. 48 (double-bit ECC), 64 (remapping failure),
74 (NVLink), 79 (off the bus), 94/95 (contained/uncontained ECC), 119/120 (GSP), marks the
GPU unhealthy. `--health-ignore-xids` replaces the ignored set.

`transitions_total` counts changes of the healthy flag (not of the reason while unhealthy).
The tracker is pure state over what the sampler hands it: no I/O, unit-testable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpuwatch.core.model import DeviceInfo, GpuHealth

DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 63, 68, 92, 109})
DEFAULT_NVML_ERROR_SWEEPS = 3

XID_DESCRIPTIONS = {
    13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
    45: "preemptive cleanup", 48: "double-bit ECC error", 61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt", 63: "row-remapping recording event", 64: "row-remapping failure",
    68: "video processor exception", 69: "graphics engine class error", 74: "NVLink error",
    79: "fallen off the bus", 92: "high single-bit ECC rate", 94: "contained ECC error",
    95: "uncontained ECC error", 109: "context switch timeout", 119: "GSP RPC timeout", 120: "GSP error",
}


def describe_xid(xid: int) -> str:
    """ "XID 79 (fallen off the bus)" """
    text = XID_DESCRIPTIONS.get(xid)
    return f"XID {xid} ({text})" if text else f"XID {xid}"


@dataclass
class _GpuState:
    uuid: str
    fatal_xid: int | None = None
    was_lost: bool = False
    bad_reads: int = 0
    healthy: bool = True
    transitions_total: int = 0
    last: DeviceInfo | None = None


@dataclass
class HealthTracker:
    """Per-GPU health state across sweeps (keyed by GPU index; a new UUID at an index resets it)."""

    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS
    nvml_error_sweeps: int = DEFAULT_NVML_ERROR_SWEEPS
    _gpus: dict[int, _GpuState] = field(default_factory=dict)
    _failed_sweeps: int = 0

    def is_critical(self, xid: int) -> bool:
        return xid not in self.ignored_xids

    def update(self, devices: Sequence[DeviceInfo] | None,
               kernel_xids: Iterable[tuple[int, int]] = ()) -> tuple[GpuHealth, ...]:
        """One cycle. `devices`: this sweep's physical and MIG devices, None when no sweep
        was possible. `kernel_xids`: (gpu index, xid) pairs read from the kernel log."""
        if devices is None:
            return self._no_sweep()
        recovered_driver = self._failed_sweeps >= 1
        self._failed_sweeps = 0
        physical = [d for d in devices if not d.is_mig]
        critical_from_log: dict[int, int] = {}
        for index, xid in kernel_xids:
            if self.is_critical(xid):
                critical_from_log[index] = xid
        verdicts: list[GpuHealth] = []
        for device in physical:
            state = self._gpus.get(device.index)
            if state is None or (state.uuid != device.uuid and not device.lost):
                state = self._gpus[device.index] = _GpuState(uuid=device.uuid)
            verdicts.append(self._judge(state, device, critical_from_log.get(device.index), recovered_driver))
        return tuple(verdicts)

    def _judge(self, state: _GpuState, device: DeviceInfo, log_xid: int | None,
               recovered_driver: bool) -> GpuHealth:
        if recovered_driver or (state.was_lost and not device.lost):
            state.fatal_xid = None  # a driver reload or a reset clears what the Xid broke
        state.was_lost = device.lost
        for code in device.xid_events:
            if self.is_critical(code):
                state.fatal_xid = code
        if log_xid is not None:
            state.fatal_xid = log_xid
        if device.memory_total_bytes is None and not device.lost:
            state.bad_reads += 1
        else:
            state.bad_reads = 0
        state.last = device
        reason, detail = "ok", ""
        xid: int | None = None
        if device.lost:
            reason, detail = "lost", "GPU is lost (fallen off the bus); needs a reset"
        elif state.fatal_xid is not None:
            reason, xid = "xid", state.fatal_xid
            detail = f"{describe_xid(state.fatal_xid)}; healthy again after a GPU reset or driver reload"
        elif device.row_remap_failure:
            reason, detail = "row-remap-failure", "row remapping failed; the GPU needs a reset or RMA"
        elif device.ecc_uncorrected_volatile:
            reason = "ecc-uncorrectable"
            detail = f"{device.ecc_uncorrected_volatile} uncorrectable ECC errors since the last reset"
        elif state.bad_reads >= self.nvml_error_sweeps:
            reason, detail = "nvml-errors", f"NVML could not read it for {state.bad_reads} sweeps"
        return self._verdict(state, device.index, reason, detail, xid)

    def _no_sweep(self) -> tuple[GpuHealth, ...]:
        """No NVML at all this cycle: after `nvml_error_sweeps` cycles every known GPU is unhealthy."""
        self._failed_sweeps += 1
        verdicts = []
        for index, state in sorted(self._gpus.items()):
            if state.last is None or state.last.is_mig:
                continue
            if self._failed_sweeps >= self.nvml_error_sweeps:
                verdicts.append(self._verdict(state, index, "nvml-errors",
                                              f"NVML unavailable for {self._failed_sweeps} sweeps", None))
            else:
                verdicts.append(GpuHealth(index=index, uuid=state.uuid, healthy=state.healthy,
                                          reason="ok" if state.healthy else "nvml-errors",
                                          transitions_total=state.transitions_total))
        return tuple(verdicts)

    @staticmethod
    def _verdict(state: _GpuState, index: int, reason: str, detail: str, xid: int | None) -> GpuHealth:
        healthy = reason == "ok"
        if healthy != state.healthy:
            state.transitions_total += 1
            state.healthy = healthy
        return GpuHealth(index=index, uuid=state.uuid, healthy=healthy, reason=reason, detail=detail,
                         transitions_total=state.transitions_total, xid=xid)

    def last_devices(self) -> tuple[DeviceInfo, ...]:
        """The last devices seen (for labels while NVML is down)."""
        return tuple(s.last for _, s in sorted(self._gpus.items()) if s.last is not None)


def apply_health(devices: Sequence[DeviceInfo], health: Sequence[GpuHealth]) -> tuple[DeviceInfo, ...]:
    """Devices with `healthy` set from the verdicts (MIG instances follow their parent)."""
    by_index = {h.index: h.healthy for h in health}
    out = []
    for device in devices:
        healthy = by_index.get(device.index, device.healthy)
        out.append(device if device.healthy == healthy else dataclasses.replace(device, healthy=healthy))
    return tuple(out)
