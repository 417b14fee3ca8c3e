"""Rare probe events the evaluator reacts to (OOM returns, stopped/over-limit allocations).

The probes layer decodes its ring-buffer records into KernelEvents
(probes/kernel_events.py), which reach the enforcer as `KernelEventRecord` (the typed seam:
the fields it reads, which KernelEvent has) and are converted by enforce/probe_events.py;
evaluation only reads the ProbeEvents made from them. `cgroup_path` is matched against
ContainerIdentity.cgroup_path, `cgroup_id` against ContainerIdentity.cgroup_id (either may
be unknown).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class ProbeEventKind(StrEnum):
    OOM = "oom"
    """An allocation returned out-of-memory to the application."""
    OVER_LIMIT = "over_limit"
    """An allocation would exceed the container's limit (killed or denied in kernel)."""
    STOPPED_AT_ALLOCATION = "stopped_at_allocation"
    """The process was SIGSTOPped before an allocation that would exceed its limit."""


@dataclass(frozen=True)
class ProbeEvent:
    kind: ProbeEventKind
    timestamp_s: float
    pid: int
    gpu_index: int
    requested_bytes: int
    cgroup_path: str = ""
    cgroup_id: int | None = None


class KernelEventRecord(Protocol):
    """A ring-buffer event as the probes layer decodes it (probes.kernel_events.KernelEvent):
    the fields the enforcer turns into a ProbeEvent. `type` is the event name ("oom",
    "over_limit", "stop", ...), `ts_ns` CLOCK_MONOTONIC, `device` the GPU index (None for
    CUDA-API records, -1 unknown)."""

    @property
    def type(self) -> str: ...

    @property
    def ts_ns(self) -> int: ...

    @property
    def cgroup_id(self) -> int: ...

    @property
    def tgid(self) -> int: ...

    @property
    def size_bytes(self) -> int: ...

    @property
    def device(self) -> int | None: ...
