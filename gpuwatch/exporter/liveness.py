"""The agent's /healthz (liveness) and /readyz (readiness) answers.

Liveness is about the one thing a restart cures: the sampling loop stuck (a hung NVML call,
a deadlock). The loop beats once per cycle, failed cycles included (NVML down is reported
in the metrics, and a restart would not bring the driver back); /healthz fails once no beat
came for `stall_intervals` intervals. Readiness: the first cycle has finished and the loop
is live, so Prometheus' first scrape of a new pod already has data. Both are pure functions
of the beat and a clock, so tests drive them without threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_STALL_INTERVALS = 10
MIN_STALL_S = 5.0  # short intervals (0.05 s in tests) would otherwise flap on a busy node


@dataclass(frozen=True)
class Verdict:
    """One probe answer: HTTP 200 when ok, 503 otherwise; `reason` is the body."""

    ok: bool
    reason: str


@dataclass
class LoopHealth:
    """Judges the sampling loop by its beats (`beat_s()`: monotonic time of the last finished
    cycle, None before the first)."""

    beat_s: Callable[[], float | None]
    interval_s: float
    stall_intervals: int = DEFAULT_STALL_INTERVALS
    min_stall_s: float = MIN_STALL_S
    clock: Callable[[], float] = field(default=time.monotonic)
    started_s: float = field(default=-1.0)

    def __post_init__(self) -> None:
        if self.started_s < 0:
            self.started_s = self.clock()

    @property
    def stall_s(self) -> float:
        """Seconds without a beat after which the loop counts as stalled."""
        return max(self.stall_intervals * self.interval_s, self.min_stall_s)

    def live(self) -> Verdict:
        beat = self.beat_s()
        now = self.clock()
        since = now - (beat if beat is not None else self.started_s)
        if since > self.stall_s:
            what = "no sampling cycle finished since start" if beat is None else \
                f"the sampling loop last finished a cycle {since:.1f} s ago"
            return Verdict(False, f"stalled: {what} (limit {self.stall_s:g} s = {self.stall_intervals} "
                                  f"intervals of {self.interval_s:g} s); the agent's log names the last step")
        if beat is None:
            return Verdict(True, "ok: starting, first cycle not finished yet")
        return Verdict(True, f"ok: last cycle {since:.1f} s ago")

    def ready(self) -> Verdict:
        if self.beat_s() is None:
            return Verdict(False, "not ready: the first sampling cycle has not finished")
        live = self.live()
        return Verdict(live.ok, live.reason if not live.ok else "ready")


def idle_health(reason: str) -> LoopHealth:
    """Health of an agent idling on a node without NVIDIA devices: live and ready (it serves
    what it has to say: no GPUs), with `reason` in both answers."""
    now = time.monotonic()

    class _Idle(LoopHealth):
        def live(self) -> Verdict:
            return Verdict(True, f"ok: idle ({reason})")

        def ready(self) -> Verdict:
            return Verdict(True, f"ready: idle ({reason})")

    return _Idle(beat_s=lambda: now, interval_s=1.0)
