"""Rare probe events the evaluator reacts to (OOM returns, stopped/over-limit allocations).

The probes layer decodes its ring-buffer records into these values; evaluation only reads
them. `cgroup_path` is matched against ContainerIdentity.cgroup_path, `cgroup_id` against
ContainerIdentity.cgroup_id (either may be unknown).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


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
