"""Probe vs NVML cross-check: may the kernel act on a container's probe counter?

The in-kernel memory limit (kill or stop at the allocation, bpf/cuda.bpf.c) acts on a
counter the probes keep, not on what the driver holds. That counter can be wrong: an
allocation path the decoder misreads, a free it never sees (a bounded map that overflowed,
a parent or fd-close free), a device it puts on the wrong GPU. An overcount there kills a
healthy container. NVML's per-process used memory is the driver's own number, so every
interval the agent compares the two per container:

    divergence_bytes = probe live bytes - NVML used bytes          (signed)

* probe live bytes: the larger of the decoded driver counter (RM allocations, all GPUs and
  the unknown one) and the libcuda uprobe counter (when those probes run) over every cgroup
  id of the container -- the kernel limit reads one of them, and the larger is the one
  that would kill first;
* NVML used bytes: the container's memory on every GPU, from the usage rows; a container
  NVML does not list, or lists with every process N/A, has no NVML number.

`ProbeNvmlCrossCheck` turns the comparisons into a decision with hysteresis: a container
whose probe counter exceeds NVML's by more than max(64 MiB, 10% of NVML) for 3 intervals
in a row is *suspended* (the enforcer keeps it out of the kernel limit map; polling
enforcement on NVML numbers goes on); 3 agreeing intervals in a row resume it. No NVML
number or no probe number: no judgement (the streaks stay as they were). A container that
has neither any more is forgotten. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuwatch.core.model import ContainerIdentity, ProbeNvmlComparison

MIB = 1024**2
DEFAULT_MIN_EXCESS_BYTES = 64 * MIB
DEFAULT_EXCESS_RATIO = 0.10
DEFAULT_SUSPEND_AFTER_INTERVALS = 3
DEFAULT_RESUME_AFTER_INTERVALS = 3


@dataclass(frozen=True)
class SuspensionChange:
    """A container whose in-kernel enforcement was just suspended or resumed, and why."""

    identity: ContainerIdentity
    suspended: bool
    comparison: ProbeNvmlComparison
    intervals: int
    allowed_excess_bytes: int

    @property
    def reason(self) -> str:
        c = self.comparison
        if self.suspended:
            return (f"probe counter {c.probe_bytes} B exceeds NVML {c.nvml_bytes} B by more than "
                    f"{self.allowed_excess_bytes} B for {self.intervals} intervals: in-kernel kill/stop "
                    "suspended (polling enforcement on NVML numbers continues)")
        return (f"probe counter {c.probe_bytes} B agrees with NVML {c.nvml_bytes} B (within "
                f"{self.allowed_excess_bytes} B) for {self.intervals} intervals: in-kernel kill/stop resumed")


@dataclass
class _Track:
    identity: ContainerIdentity
    suspended: bool = False
    diverging: int = 0  # consecutive judged intervals over the allowance
    agreeing: int = 0  # consecutive judged intervals within it


class ProbeNvmlCrossCheck:
    """Hysteresis over the per-interval comparisons (see the module doc). `observe` once per
    interval; `suspended` says which containers the kernel must not act on."""

    def __init__(self, min_excess_bytes: int = DEFAULT_MIN_EXCESS_BYTES,
                 excess_ratio: float = DEFAULT_EXCESS_RATIO,
                 suspend_after_intervals: int = DEFAULT_SUSPEND_AFTER_INTERVALS,
                 resume_after_intervals: int = DEFAULT_RESUME_AFTER_INTERVALS) -> None:
        if min_excess_bytes < 0 or excess_ratio < 0:
            raise ValueError("the allowed excess must not be negative")
        if suspend_after_intervals < 1 or resume_after_intervals < 1:
            raise ValueError("suspension and resumption need at least one interval")
        self.min_excess_bytes = min_excess_bytes
        self.excess_ratio = excess_ratio
        self.suspend_after_intervals = suspend_after_intervals
        self.resume_after_intervals = resume_after_intervals
        self._tracks: dict[str, _Track] = {}

    def allowed_excess_bytes(self, nvml_bytes: int) -> int:
        """How far the probe counter may exceed NVML's number: max(64 MiB, 10% of NVML)."""
        return max(self.min_excess_bytes, int(self.excess_ratio * max(nvml_bytes, 0)))

    def diverges(self, comparison: ProbeNvmlComparison) -> bool | None:
        """True: the probes count more than allowed over NVML; False: they agree (an
        undercount agrees: it never makes the kernel act); None: no judgement."""
        excess = comparison.divergence_bytes
        if excess is None or comparison.nvml_bytes is None:
            return None
        return excess > self.allowed_excess_bytes(comparison.nvml_bytes)

    def observe(self, comparisons: Mapping[str, ProbeNvmlComparison]) -> list[SuspensionChange]:
        """One interval: advance every container's streaks; return the suspensions and
        resumptions it caused. Containers absent from `comparisons` are forgotten."""
        for key in set(self._tracks) - set(comparisons):
            del self._tracks[key]
        changes: list[SuspensionChange] = []
        for key, comparison in sorted(comparisons.items()):
            track = self._tracks.setdefault(key, _Track(comparison.identity))
            track.identity = comparison.identity
            verdict = self.diverges(comparison)
            if verdict is None:
                continue
            if verdict:
                track.diverging, track.agreeing = track.diverging + 1, 0
            else:
                track.diverging, track.agreeing = 0, track.agreeing + 1
            assert comparison.nvml_bytes is not None  # judged: both numbers known
            allowed = self.allowed_excess_bytes(comparison.nvml_bytes)
            if not track.suspended and track.diverging >= self.suspend_after_intervals:
                track.suspended = True
                changes.append(SuspensionChange(track.identity, True, comparison, track.diverging, allowed))
            elif track.suspended and track.agreeing >= self.resume_after_intervals:
                track.suspended = False
                changes.append(SuspensionChange(track.identity, False, comparison, track.agreeing, allowed))
        return changes

    def is_suspended(self, key: str) -> bool:
        track = self._tracks.get(key)
        return track is not None and track.suspended

    def suspended(self) -> dict[str, ContainerIdentity]:
        """Container key -> identity of every container whose in-kernel enforcement is off."""
        return {key: t.identity for key, t in self._tracks.items() if t.suspended}

    def tracked(self) -> dict[str, tuple[ContainerIdentity, bool]]:
        """Every container judged or waiting for a judgement: key -> (identity, suspended)."""
        return {key: (t.identity, t.suspended) for key, t in self._tracks.items()}
