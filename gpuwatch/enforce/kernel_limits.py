"""What enforce/ needs from the kernel probes, as typed protocols (no `Any`, no getattr).

The enforcer never imports the probes layer (sources never know consumers; consumers talk
to sources through protocols). The running probes (probes/manager.ProbeManager) satisfy
`KernelProbes`; the agent hands them to agent/enforcer_factory.py, which wires:

* the in-kernel memory limit: `KernelLimitTable` -- one entry per cgroup id in the BPF limit
  map, read by the kernel at every allocation (kill or stop before an over-limit one
  proceeds, or only report it). An entry that is absent means the kernel does nothing for
  that cgroup: that is how the probe-vs-NVML cross-check (policy/probe_trust.py) suspends
  in-kernel enforcement of a container whose probe counter NVML contradicts;
* device isolation: `ProbeScope` -- the device-node prefix and cgroup v2 mount the probes
  use, so the cgroup device program gates the same nodes.

mypy checks the conformance where the agent wires the two (gpuwatch/agent/daemon.py).
"""

from __future__ import annotations

from typing import Protocol


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
