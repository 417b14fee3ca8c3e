"""Hooks for in-kernel enforcement: the memory limit (kill/stop at allocation) and device
isolation.

The probes layer will provide a BPF map keyed by cgroup id; the enforcer pushes each
container's effective GPU memory limit into it whenever it changes. Until then the
NullLimitMap just remembers what it was told (so it is observable in tests/metrics).
"""

from __future__ import annotations

from typing import Protocol


class LimitMap(Protocol):
    def set_limit(self, cgroup_id: int, limit_bytes: int) -> None: ...

    def clear(self, cgroup_id: int) -> None: ...


class NullLimitMap:
    """No kernel enforcement: keeps the limits in a dict."""

    def __init__(self) -> None:
        self.limits: dict[int, int] = {}

    def set_limit(self, cgroup_id: int, limit_bytes: int) -> None:
        self.limits[cgroup_id] = limit_bytes

    def clear(self, cgroup_id: int) -> None:
        self.limits.pop(cgroup_id, None)


class DeviceGate(Protocol):
    """Hook for device isolation (a cgroup device BPF program, to come from the probes
    layer): a container may open only the GPU device nodes of the given indices."""

    def allow_only(self, cgroup_id: int, gpu_indices: tuple[int, ...]) -> None: ...

    def clear(self, cgroup_id: int) -> None: ...


class NullDeviceGate:
    """No kernel program: remembers the allowed GPUs per cgroup (observable in tests)."""

    def __init__(self) -> None:
        self.allowed: dict[int, tuple[int, ...]] = {}

    def allow_only(self, cgroup_id: int, gpu_indices: tuple[int, ...]) -> None:
        self.allowed[cgroup_id] = gpu_indices

    def clear(self, cgroup_id: int) -> None:
        self.allowed.pop(cgroup_id, None)
