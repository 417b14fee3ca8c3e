"""GPU seconds per process from NVML's process-utilisation samples, by the time they cover.

What the real driver gives (open-gpu-kernel-modules: NV2080_CTRL_PERF_GPUMON_PERFMON_UTIL_SAMPLE,
a ring of 72 samples per GPU; src/nvidia/src/kernel/diagnostics/gpu_acct.c reads it): each
sample has one timestamp, the engine's busy percentage over the sample period, and the process
that was active on the engine when it was taken. `nvmlDeviceGetProcessUtilization(lastSeen)`
returns the samples newer than `lastSeen` as (pid, timestamp, smUtil). So a process gets a
sample only for periods in which it ran, a sample's smUtil is the engine's busy share of that
period (not the process's share of the read), and several processes can appear with one
timestamp (the fake NVML of older gpuwatch releases did that for every process).

Method (README "Kernel time"): the samples of a device form one timeline; each distinct
timestamp stands for the period since the device's previous timestamp, at most 1.1 x the
device's sample period (learned as the median gap between its consecutive samples; 1/6 s before
any gap is seen -- NVML documents a sample period between 1/6 s and 1 s), so a sample after an
idle stretch covers its own period (with 10 % for timing jitter), not the idle time before it. A process's GPU
seconds are the sum of smUtil x covered period over its samples; a process without a sample
in a period ran 0 in it. The samples of one period never add up to more than the period. The
first read of a device is a baseline: it learns the timeline and charges nothing (the ring
holds seconds of history from before the reader started); when it finds no samples at all (an
idle GPU), every sample after it is new and charged.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

DEFAULT_SAMPLE_PERIOD_US = 166_667  # NVML: "between 1 second and 1/6 second depending on the product"
CAP_PERIODS = 1.1  # a sample covers at most its own period (+10 % for the driver's timing jitter)
GAPS_KEPT = 16  # recent gaps the period is learned from


@dataclass
class SampleTimeline:
    """Per-device state between reads: the newest timestamp charged and recent gaps."""

    newest_us: int = 0  # the newest sample timestamp charged (0: none yet)
    gaps_us: deque[int] = field(default_factory=lambda: deque(maxlen=GAPS_KEPT))
    primed: bool = False  # a read happened: later samples are new (the first read is the baseline)

    @property
    def period_us(self) -> int:
        """The device's sample period as its samples show it (median recent gap)."""
        return int(statistics.median(self.gaps_us)) if self.gaps_us else DEFAULT_SAMPLE_PERIOD_US


@dataclass(frozen=True)
class SampleRead:
    """What one read's new samples come to."""

    seconds_by_pid: dict[int, float]  # GPU seconds each sampled process ran, over the covered time
    covered_s: float  # time the new samples stand for (0: no new samples)

    def ratio(self, pid: int) -> float:
        """The process's SM share of the covered time (0 for a process without a sample)."""
        return min(1.0, self.seconds_by_pid.get(pid, 0.0) / self.covered_s) if self.covered_s > 0 else 0.0


def integrate(samples: Iterable[tuple[int, int, int]], timeline: SampleTimeline) -> SampleRead:
    """Charge the samples newer than `timeline.newest_us` ((pid, timestamp_us, sm_percent) in
    any order) and advance the timeline. Samples at or before the newest timestamp already
    charged are ignored (NVML returns samples *newer than* lastSeen, but a driver may repeat)."""
    by_time: dict[int, dict[int, int]] = {}
    for pid, timestamp_us, sm_percent in samples:
        if timestamp_us > timeline.newest_us:
            period = by_time.setdefault(timestamp_us, {})
            period[pid] = max(period.get(pid, 0), min(max(sm_percent, 0), 100))
    baseline = not timeline.primed
    timeline.primed = True  # a first read without samples (an idle GPU: NOT_FOUND) is the baseline too
    if not by_time:
        return SampleRead({}, 0.0)
    previous = timeline.newest_us
    seconds: dict[int, float] = {}
    covered_us = 0
    for timestamp_us in sorted(by_time):
        if previous:
            timeline.gaps_us.append(timestamp_us - previous)
        cap_us = CAP_PERIODS * timeline.period_us
        span_us = min(timestamp_us - previous, cap_us) if previous else timeline.period_us
        previous = timestamp_us
        if baseline:
            continue
        covered_us += int(span_us)
        shares = by_time[timestamp_us]
        total = sum(shares.values())
        scale = 100.0 / total if total > 100 else 1.0  # one period holds at most itself
        for pid, percent in shares.items():
            seconds[pid] = seconds.get(pid, 0.0) + percent * scale / 100.0 * span_us / 1e6
    timeline.newest_us = previous
    return SampleRead(seconds, covered_us / 1e6)
