"""Hooks for in-kernel enforcement: the memory limit (kill/stop at allocation) and device
isolation.

The probes layer will provide a BPF map keyed by cgroup id; the enforcer pushes each
container's effective GPU memory limit into it whenever it changes. Until then the
NullLimitMap just remembers what it was told (so it is observable in tests/metrics).
"""

from __future__ import annotations

from typing import Protocol

from gpuwatch.policy.rules import ActionKind, LimitKind, Rule

KERNEL_ACTIONS = ("event", "stop", "kill")


class LimitMap(Protocol):
    def set_limit(self, cgroup_id: int, limit_bytes: int, action: str = "event") -> None:
        """`action` for an allocation over the limit: "event" (report only), "stop"
        (SIGSTOP before it happens; the enforcer decides) or "kill" (SIGKILL before it)."""
        ...

    def clear(self, cgroup_id: int) -> None: ...


class NullLimitMap:
    """No kernel enforcement: keeps the limits in a dict."""

    def __init__(self) -> None:
        self.limits: dict[int, int] = {}
        self.actions: dict[int, str] = {}

    def set_limit(self, cgroup_id: int, limit_bytes: int, action: str = "event") -> None:
        self.limits[cgroup_id] = limit_bytes
        self.actions[cgroup_id] = action

    def clear(self, cgroup_id: int) -> None:
        self.limits.pop(cgroup_id, None)
        self.actions.pop(cgroup_id, None)


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
    """Hook for device isolation (a cgroup device BPF program, to come from the probes
    layer): a container may open only the GPU device nodes of the given indices. A gate with
    `enforcing = False` (NullDeviceGate) only records: the enforcer audits no device changes
    through it and logs what is not enforced; a gate without the attribute enforces."""

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
