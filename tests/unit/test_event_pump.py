"""gpuwatch/agent/event_pump.py: every event reaches the enforcer's next step, in order; the
sampler is woken by the events the enforcer must answer at once and by no others."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from gpuwatch.agent.event_pump import WAKE_EVENTS, EventPump


@dataclass(frozen=True)
class Event:
    type: str
    n: int = 0


class Ring:
    """Batches handed out one per poll, as the probes' ring buffer does."""

    def __init__(self, *batches: list[Event]) -> None:
        self.batches = deque(batches)
        self.polls = 0

    def poll(self, timeout_ms: int) -> list[Event]:
        self.polls += 1
        return self.batches.popleft() if self.batches else []


def test_events_are_kept_in_order_until_taken_and_only_some_wake_the_sampler() -> None:
    wakes: list[int] = []
    ring = Ring([Event("new_gpu_process", 1), Event("device_open", 2)], [Event("stop", 3)],
                [Event("kill", 4)], [Event("process_exit", 5)])
    pump = EventPump(ring.poll, lambda: wakes.append(len(wakes)))
    assert [pump.pump_once(0) for _ in range(5)] == [2, 1, 1, 1, 0]
    assert [e.n for e in pump.take()] == [1, 2, 3, 4, 5]
    assert pump.take() == []
    assert len(wakes) == pump.wakes == 2  # the stop and the exit; not a new process, an open or a kill
    assert {"stop", "oom", "over_limit", "process_exit", "process_exec"} == WAKE_EVENTS


def test_a_full_buffer_drops_the_oldest_and_counts_them() -> None:
    ring = Ring([Event("alloc", i) for i in range(5)], [Event("alloc", i) for i in range(5, 8)])
    pump = EventPump(ring.poll, lambda: None, max_buffered=4)
    pump.pump_once(0)
    pump.pump_once(0)
    assert [e.n for e in pump.take()] == [4, 5, 6, 7]
    assert pump.dropped == 4


def test_the_thread_pumps_until_stopped_and_survives_a_failing_ring() -> None:
    woken = threading.Event()
    calls = {"n": 0}

    def poll(timeout_ms: int) -> list[Event]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("ring gone for a moment")
        time.sleep(timeout_ms / 1000)
        return [Event("oom")] if calls["n"] == 2 else []

    pump = EventPump(poll, woken.set, poll_timeout_ms=20).start()
    try:
        assert woken.wait(5), "the pump did not recover from a failing poll"
    finally:
        pump.stop()
    assert [e.type for e in pump.take()] == ["oom"]
    polls = calls["n"]
    time.sleep(0.1)
    assert calls["n"] == polls  # stopped
