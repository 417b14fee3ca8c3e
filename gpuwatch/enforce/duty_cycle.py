"""Throttle a cgroup to a GPU-time share by a freeze/thaw duty cycle, closed loop.

Every `period_s` the cgroup runs for `duty * period_s` and is frozen for the rest. Every
`control_interval_s` the measured share (busy seconds per wall second, from a callable:
the container's kernel_seconds_total on a GPU node, its CPU time on the simulated node)
corrects the duty with an integral step: duty += gain * (target - measured). Open-loop
duty cycles miss because freeze/thaw latency and the workload's own idle time distort the
ratio; the loop removes that bias. If the workload wants less than its share the duty
saturates at 1 (never frozen). The busy counter may be stepwise (updated once per sample
interval); the loop then corrects once per step, between the times the value changed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gpuwatch.core.errors import EnforcementError
from gpuwatch.enforce.cgroup_ops import CgroupHandle

log = logging.getLogger(__name__)
MIN_DUTY = 0.01


class DutyCycleThrottle:
    """One throttled cgroup; `start()` runs the loop in a daemon thread, `stop()` thaws."""

    def __init__(
        self,
        handle: CgroupHandle,
        share: float,
        busy_seconds: Callable[[], float],
        *,
        mechanism: str,
        period_s: float = 0.1,
        control_interval_s: float = 0.5,
        gain: float = 0.6,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 < share <= 1.0:
            raise EnforcementError(f"throttle share {share} out of range", fix="use a share in (0, 1]")
        self.handle = handle
        self.target_share = share
        self.busy_seconds = busy_seconds
        self.mechanism = mechanism
        self.period_s = period_s
        self.control_interval_s = control_interval_s
        self.gain = gain
        self.clock = clock
        self.duty = share
        self.measured_share: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"throttle:{handle.cgroup_path}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def set_share(self, share: float) -> None:
        self.target_share = min(max(share, MIN_DUTY), 1.0)

    def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopped; True if stop was requested."""
        return self._stop.wait(max(seconds, 0.0))

    def _run(self) -> None:
        last_t = self.clock()
        last_busy = self.busy_seconds()
        next_control = last_t + self.control_interval_s
        synced = False
        try:
            while not self._stop.is_set():
                cycle_start = self.clock()
                on_s = self.duty * self.period_s
                if on_s < self.period_s:
                    if self._sleep(on_s):
                        break
                    self.handle.set_frozen(True, self.mechanism)
                    if self._sleep(self.period_s - (self.clock() - cycle_start)):
                        break
                    self.handle.set_frozen(False, self.mechanism)
                elif self._sleep(self.period_s):
                    break
                now = self.clock()
                if now >= next_control:
                    busy = self.busy_seconds()
                    # A stepwise source (kernel seconds from the latest snapshot) changes once
                    # per sample interval: measure between changes, never over a stale value.
                    if busy != last_busy and not synced:
                        synced = True  # first change: the window before it is unknown
                        last_t, last_busy = now, busy
                    elif busy != last_busy and now > last_t:
                        self.measured_share = max(busy - last_busy, 0.0) / (now - last_t)
                        error = self.target_share - self.measured_share
                        self.duty = min(max(self.duty + self.gain * error, MIN_DUTY), 1.0)
                        last_t, last_busy = now, busy
                    next_control = now + self.control_interval_s
        except EnforcementError as err:
            if self.handle.exists():
                log.error("throttle of %s stopped: %s", self.handle.cgroup_path, err)
            else:  # the container ended: nothing left to throttle
                log.debug("throttle of %s ended with its cgroup", self.handle.cgroup_path)
        finally:
            self._thaw()

    def _thaw(self) -> None:
        if self.handle.exists():
            try:
                self.handle.set_frozen(False, self.mechanism)
            except EnforcementError as err:
                log.error("could not thaw %s after throttling: %s", self.handle.cgroup_path, err)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._thaw()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()
