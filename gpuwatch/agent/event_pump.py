"""Drain the kernel probes' event ring in its own thread and wake the sampler on what the
enforcer must answer at once.

Without it the agent read the ring once per snapshot, so a container stopped at an
allocation (fair share's `gate_new`, or a request that must wait) was admitted at the next
sample -- up to a whole interval later (1 s by default) -- and a waiter was resumed up to an
interval after a GPU process exited and freed its memory. The pump blocks on the ring (no
polling cost when nothing happens), keeps every event for the enforcer's next step, and on
a stop, OOM, over-limit or GPU-process exit/exec asks the sampler for a cycle now
(`Sampler.wake`, itself rate-limited). The enforcer still decides once per snapshot, from
the events and the snapshot together.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

WAKE_EVENTS = frozenset({"stop", "oom", "over_limit", "process_exit", "process_exec"})
"""Event types after which the enforcer's answer should not wait for the next tick: a request
waits (stop), failed (oom) or broke a limit (over_limit), or memory was freed (exit/exec)."""
MAX_BUFFERED = 65_536
"""Events kept between two enforcer steps; beyond it the oldest are dropped (and counted)."""


class EventPump:
    """`poll(timeout_ms)` -> events (ProbeManager.poll_events); `wake()` -> the sampler's."""

    def __init__(self, poll: Callable[[int], Sequence[Any]], wake: Callable[[], None], *,
                 poll_timeout_ms: int = 200, max_buffered: int = MAX_BUFFERED) -> None:
        self._poll = poll
        self._wake = wake
        self._poll_timeout_ms = poll_timeout_ms
        self._events: deque[Any] = deque(maxlen=max_buffered)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0
        self.wakes = 0

    def start(self) -> EventPump:
        self._thread = threading.Thread(target=self._run, name="gpuwatch-event-pump", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop pumping (returns within one poll timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def take(self) -> list[Any]:
        """Every event pumped since the last take, oldest first."""
        with self._lock:
            out = list(self._events)
            self._events.clear()
            return out

    def pump_once(self, timeout_ms: int) -> int:
        """One wait on the ring: keep what came, wake the sampler if it matters; the count."""
        events = self._poll(timeout_ms)
        if not events:
            return 0
        with self._lock:
            room = (self._events.maxlen or 0) - len(self._events)
            if len(events) > room:
                self.dropped += len(events) - room
            self._events.extend(events)
        if any(getattr(event, "type", None) in WAKE_EVENTS for event in events):
            self.wakes += 1
            self._wake()
        return len(events)

    def _run(self) -> None:
        warned_drop = 0
        while not self._stop.is_set():
            try:
                self.pump_once(self._poll_timeout_ms)
            except Exception:  # a failing ring must not end the agent: the enforcer runs without events
                log.exception("probe event pump failed; retrying in 1 s")
                self._stop.wait(1.0)
            if self.dropped > warned_drop:
                log.warning("probe events: %d dropped (more than %d between two enforcer steps)",
                            self.dropped, self._events.maxlen)
                warned_drop = self.dropped
