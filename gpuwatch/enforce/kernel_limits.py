"""What enforce/ needs from the kernel, as typed protocols (no `Any`, no getattr), and the
stand-ins used when no kernel program runs.

The enforcer never imports the probes layer (sources never know consumers; consumers talk
to sources through protocols). The running probes (probes/manager.ProbeManager) satisfy
`KernelProbes`; the agent hands them to agent/enforcer_factory.py, which wires:

* the in-kernel memory limit: `KernelLimitTable` -- one entry per cgroup id in the BPF limit
  map, read by the kernel at every allocation (kill or stop before an over-limit one
  proceeds, or only report it). An entry that is absent means the kernel does nothing for
  that cgroup: that is how the probe-vs-NVML cross-check (enforce/inkernel_guard.py)
  suspends in-kernel enforcement of a container whose probe counter NVML contradicts. The
  probes implement it directly; `NullKernelLimits` remembers what it was told where no
  probes run (observable in tests and metrics);
* device isolation: `DeviceGate` -- the cgroup device program (probes/devicegate.py) loaded
  with the `ProbeScope` of the probes (same device-node prefix and cgroup v2 mount);
  `NullDeviceGate` records without enforcing.

mypy checks the conformance where the agent wires them (gpuwatch/agent/daemon.py).
"""

from __future__ import annotations

from typing import Protocol

from gpuwatch.policy.rules import ActionKind, LimitKind, Rule

KERNEL_ACTIONS = ("event", "stop", "kill")


class KernelLimitTable(Protocol):
    """The BPF limit map, keyed by cgroup v2 id."""

    def set_limit(self, cgroup_id: int, limit_bytes: int, action: str = "event") -> None:
        """Live-bytes limit for the cgroup; `action` at an over-limit allocation: "event"
        (report), "stop" (SIGSTOP before it; the enforcer decides) or "kill" (SIGKILL before
        it). Raises ValueError for another action."""
        ...

    def clear_limit(self, cgroup_id: int) -> None:
        """Remove the cgroup's entry: the kernel no longer acts on its allocations."""
        ...


class NullKernelLimits:
    """No kernel enforcement: keeps the limits in a dict."""

    def __init__(self) -> None:
        self.limits: dict[int, int] = {}
        self.actions: dict[int, str] = {}

    def set_limit(self, cgroup_id: int, limit_bytes: int, action: str = "event") -> None:
        if action not in KERNEL_ACTIONS:
            raise ValueError(f"kernel action {action!r} is not one of {', '.join(KERNEL_ACTIONS)}")
        self.limits[cgroup_id] = limit_bytes
        self.actions[cgroup_id] = action

    def clear_limit(self, cgroup_id: int) -> None:
        self.limits.pop(cgroup_id, None)
        self.actions.pop(cgroup_id, None)


class ProbeScope(Protocol):
    """Where the probes look: the device-node prefix (e.g. /dev/nvidia) and the cgroup v2
    mount (None: found from /proc/self/mounts)."""

    @property
    def device_prefix(self) -> str: ...

    @property
    def cgroup_root(self) -> str | None: ...


class KernelProbes(KernelLimitTable, Protocol):
    """Started kernel probes as the enforcer uses them: the limit map and their scope."""

    @property
    def config(self) -> ProbeScope: ...


def kernel_action(rule: Rule | None, fair_share: bool = False) -> str:
    """What the kernel does at an over-limit allocation for containers of this rule: the
    first memory step that fires at once at <= 100% decides — kill -> "kill" (0 bytes
    over), pause/checkpoint -> "stop" (the enforcer decides), otherwise "event". Under an
    oversubscribed fair share, "stop" so allocations wait instead of running into OOM."""
    if fair_share:
        return "stop"
    for step in rule.actions if rule is not None else ():
        if (step.on and LimitKind.GPU_MEMORY not in step.on) or step.at_ratio > 1.0 or step.for_s > 0:
            continue
        if step.kind is ActionKind.KILL:
            return "kill"
        if step.kind in (ActionKind.PAUSE, ActionKind.CHECKPOINT_KILL):
            return "stop"
    return "event"


class DeviceGate(Protocol):
    """Device isolation (the cgroup device program of probes/devicegate.py): a container may
    open only the GPU device nodes of the given indices. A gate with `enforcing = False`
    (NullDeviceGate) only records: the enforcer audits no device changes through it and
    logs what is not enforced; a gate without the attribute enforces."""

    def allow_only(self, cgroup_id: int, gpu_indices: tuple[int, ...]) -> None: ...

    def clear(self, cgroup_id: int) -> None: ...


class NullDeviceGate:
    """No kernel program: remembers the allowed GPUs per cgroup (observable in tests).
    `enforcing` is False: the enforcer audits no device changes through it (nothing is done)."""

    enforcing = False

    def __init__(self) -> None:
        self.allowed: dict[int, tuple[int, ...]] = {}

    def allow_only(self, cgroup_id: int, gpu_indices: tuple[int, ...]) -> None:
        self.allowed[cgroup_id] = gpu_indices

    def clear(self, cgroup_id: int) -> None:
        self.allowed.pop(cgroup_id, None)
