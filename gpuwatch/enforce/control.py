"""Freeze bookkeeping shared by pause, throttle, release and the kill actions.

Owns the cgroup tree, the on-disk frozen registry and the running throttles, so that any
action can hand a target over cleanly (a kill first stops that target's throttle and
thaws it so the checkpoint signal is delivered) and `close()` leaves nothing frozen.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpuwatch.enforce.cgroup_ops import CgroupHandle, CgroupTree
from gpuwatch.enforce.duty_cycle import DutyCycleThrottle
from gpuwatch.enforce.freeze.frozen_state import FrozenRegistry

log = logging.getLogger(__name__)
BusySource = Callable[[str, CgroupHandle], Callable[[], float]]
"""(target key, handle) -> callable returning cumulative busy seconds of that target."""


def cgroup_cpu_busy(_key: str, handle: CgroupHandle) -> Callable[[], float]:
    """Busy seconds = the cgroup's CPU time (the simulated node's kernels burn CPU)."""
    return handle.cpu_seconds


class FreezeControl:
    def __init__(
        self,
        cgroups: CgroupTree,
        registry: FrozenRegistry,
        busy_source: BusySource = cgroup_cpu_busy,
        *,
        throttle_period_s: float = 0.1,
        throttle_control_s: float = 0.5,
    ) -> None:
        self.cgroups = cgroups
        self.registry = registry
        self.busy_source = busy_source
        self.throttle_period_s = throttle_period_s
        self.throttle_control_s = throttle_control_s
        self._lock = threading.Lock()
        self._throttles: dict[str, DutyCycleThrottle] = {}
        self._paused: set[str] = set()

    def pause(self, cgroup_path: str, reason: str) -> str:
        self.stop_throttle(cgroup_path)
        handle = self.cgroups.handle(cgroup_path)
        mechanism = handle.mechanism()
        self.registry.mark(cgroup_path, mechanism, reason)  # recorded before the freeze
        handle.set_frozen(True, mechanism)
        with self._lock:
            self._paused.add(cgroup_path)
        return mechanism

    def throttle(self, key: str, cgroup_path: str, share: float, reason: str, period_s: float | None = None) -> str:
        """Start a throttle at `share` (or adjust the running one); `period_s`: its freeze/thaw
        period (None: this control's default)."""
        period = period_s if period_s is not None else self.throttle_period_s
        with self._lock:
            running = self._throttles.get(cgroup_path)
        if running is not None and running.running:
            running.set_share(share)
            running.period_s = period
            return "adjusted"
        handle = self.cgroups.handle(cgroup_path)
        mechanism = handle.mechanism()
        self.registry.mark(cgroup_path, mechanism, reason)
        throttle = DutyCycleThrottle(
            handle,
            share,
            self.busy_source(key, handle),
            mechanism=mechanism,
            period_s=period,
            control_interval_s=self.throttle_control_s,
        )
        with self._lock:
            self._paused.discard(cgroup_path)
            self._throttles[cgroup_path] = throttle
        throttle.start()
        return mechanism

    def stop_throttle(self, cgroup_path: str) -> bool:
        with self._lock:
            throttle = self._throttles.pop(cgroup_path, None)
        if throttle is None:
            return False
        throttle.stop()
        return True

    def release(self, cgroup_path: str) -> bool:
        """Stop throttling and thaw what this agent froze; True if anything was held."""
        held = self.stop_throttle(cgroup_path)
        with self._lock:
            held |= cgroup_path in self._paused
            self._paused.discard(cgroup_path)
        handle = self.cgroups.handle(cgroup_path)
        entry = self.registry.entries().get(cgroup_path)
        # Only what this agent froze: a container paused by someone else stays paused.
        if handle.exists() and (entry is not None or held):
            handle.set_frozen(False, entry.mechanism if entry else None)
        self.registry.unmark(cgroup_path)
        return held or entry is not None

    def forget(self, cgroup_path: str) -> None:
        """The target is being killed: stop its throttle, thaw it, drop the record."""
        self.release(cgroup_path)

    def paused(self) -> set[str]:
        with self._lock:
            return set(self._paused)

    def throttled(self) -> dict[str, DutyCycleThrottle]:
        with self._lock:
            return dict(self._throttles)

    def close(self) -> list[str]:
        """Stop every throttle and thaw everything recorded; returns the paths thawed."""
        for path in list(self.throttled()):
            self.stop_throttle(path)
        with self._lock:
            self._paused.clear()
        return self.registry.thaw_all()
