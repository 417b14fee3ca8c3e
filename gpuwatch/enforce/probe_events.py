"""Turn the probes layer's ring-buffer events into the evaluator's ProbeEvent values.

The kernel stamps events with bpf_ktime_get_ns() (CLOCK_MONOTONIC); timestamps are shifted
into the snapshots' clock (`wall`: time.time for epoch snapshots, time.monotonic for the
sampler's default, which makes the shift zero). Only the event types
evaluation cares about are kept (OOM returns, over-limit allocations, stops at allocation).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from gpuwatch.policy.events import ProbeEvent, ProbeEventKind

KIND_BY_TYPE = {
    "oom": ProbeEventKind.OOM,
    "over_limit": ProbeEventKind.OVER_LIMIT,
    "stopped_at_allocation": ProbeEventKind.STOPPED_AT_ALLOCATION,
    "stop": ProbeEventKind.STOPPED_AT_ALLOCATION,
}
ANY_GPU = -1


def convert_events(
    events: Iterable[Any],
    wall: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
) -> list[ProbeEvent]:
    """Accept evaluator ProbeEvents as they are; convert probes-layer events (duck-typed:
    type, ts_ns, cgroup_id, tgid, size_bytes, device); drop everything else."""
    offset = wall() - monotonic()
    out: list[ProbeEvent] = []
    for event in events:
        if isinstance(event, ProbeEvent):
            out.append(event)
            continue
        kind = KIND_BY_TYPE.get(str(getattr(event, "type", "")))
        if kind is None:
            continue
        device = getattr(event, "device", None)
        out.append(
            ProbeEvent(
                kind=kind,
                timestamp_s=int(event.ts_ns) / 1e9 + offset,
                pid=int(getattr(event, "tgid", 0)),
                gpu_index=ANY_GPU if device is None or device < 0 else int(device),
                requested_bytes=int(getattr(event, "size_bytes", 0)),
                cgroup_id=int(event.cgroup_id),
            )
        )
    return out
