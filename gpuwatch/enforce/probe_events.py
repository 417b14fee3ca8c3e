"""Turn the probes layer's ring-buffer events into the evaluator's ProbeEvent values.

The kernel stamps events with bpf_ktime_get_ns() (CLOCK_MONOTONIC); timestamps are shifted
into the snapshots' clock (`wall`: time.time for epoch snapshots, time.monotonic for the
sampler's default, which makes the shift zero). Only the event types
evaluation cares about are kept (OOM returns, over-limit allocations, stops at allocation).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from gpuwatch.policy.events import KernelEventRecord, ProbeEvent, ProbeEventKind

KIND_BY_TYPE = {
    "oom": ProbeEventKind.OOM,
    "over_limit": ProbeEventKind.OVER_LIMIT,
    "stopped_at_allocation": ProbeEventKind.STOPPED_AT_ALLOCATION,
    "stop": ProbeEventKind.STOPPED_AT_ALLOCATION,
}
ANY_GPU = -1


def convert_events(
    events: Iterable[ProbeEvent | KernelEventRecord],
    wall: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
) -> list[ProbeEvent]:
    """Accept evaluator ProbeEvents as they are; convert the probes layer's events
    (KernelEventRecord) of the kinds evaluation reacts to; drop the other kinds."""
    offset = wall() - monotonic()
    out: list[ProbeEvent] = []
    for event in events:
        if isinstance(event, ProbeEvent):
            out.append(event)
            continue
        kind = KIND_BY_TYPE.get(event.type)
        if kind is None:
            continue
        device = event.device
        out.append(
            ProbeEvent(
                kind=kind,
                timestamp_s=int(event.ts_ns) / 1e9 + offset,
                pid=int(event.tgid),
                gpu_index=ANY_GPU if device is None or device < 0 else int(device),
                requested_bytes=int(event.size_bytes),
                cgroup_id=int(event.cgroup_id),
            )
        )
    return out
