"""Pure formatting and filtering for `gpuwatch trace` (no I/O, unit-tested).

One line (or one JSON object) per event: time, process, container identity, event type
and what it carried (device, bytes, pointer/handle, return code).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gpuwatch.core.model import ContainerIdentity
from gpuwatch.probes.kernel_events import KernelEvent

HEADER = f"{'TIME(s)':>10} {'PID':>7} {'COMM':<16} {'CONTAINER':<40} {'EVENT':<16} DETAIL"


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class TraceFilter:
    """Keep events whose container/pod/namespace match (exact name, or container-id prefix)."""

    container: str | None = None
    pod: str | None = None
    namespace: str | None = None

    def matches(self, identity: ContainerIdentity | None) -> bool:
        if self.container is None and self.pod is None and self.namespace is None:
            return True
        if identity is None:
            return False
        if self.container is not None and not (
                identity.container_name == self.container
                or (identity.container_id and identity.container_id.startswith(self.container))):
            return False
        if self.pod is not None and identity.pod_name != self.pod:
            return False
        return self.namespace is None or identity.pod_namespace == self.namespace


def _where(identity: ContainerIdentity | None, cgroup_id: int) -> str:
    if identity is None:
        return f"cgroup:{cgroup_id}"
    return identity.display_name


def detail(ev: KernelEvent) -> str:
    dev = "" if ev.device is None else ("gpu=?" if ev.device < 0 else f"gpu={ev.device}")
    if ev.type == "device_open":
        return f"kind={ev.kind} fd={ev.value} {dev}".strip()
    if ev.type in ("alloc", "free"):
        handle = f"ptr={ev.value:#x}" if ev.source == "cuda" else f"hObject={ev.value:#x}"
        return f"{ev.source} {human_bytes(ev.size_bytes)} {handle} {dev}".strip()
    if ev.type == "oom":
        code = f"CUresult={ev.value}" if ev.source == "cuda" else f"status={ev.value:#x}"
        return f"{ev.source} {human_bytes(ev.size_bytes)} {code} {dev}".strip()
    if ev.type in ("over_limit", "kill", "stop"):
        return f"{ev.source} request={human_bytes(ev.size_bytes)} limit={human_bytes(ev.value)}"
    return ""


def format_line(ev: KernelEvent, identity: ContainerIdentity | None, t0_ns: int) -> str:
    t = (ev.ts_ns - t0_ns) / 1e9
    return (f"{t:>10.3f} {ev.tgid:>7} {ev.comm[:16]:<16} {_where(identity, ev.cgroup_id)[:40]:<40} "
            f"{ev.type:<16} {detail(ev)}").rstrip()


def format_json(ev: KernelEvent, identity: ContainerIdentity | None) -> str:
    doc = {
        "ts_ns": ev.ts_ns, "event": ev.type, "pid": ev.tgid, "tid": ev.tid, "comm": ev.comm,
        "cgroup_id": ev.cgroup_id, "source": ev.source or None, "device": ev.device,
        "size_bytes": ev.size_bytes, "value": ev.value, "device_kind": ev.kind or None,
        "container": None if identity is None else {
            "id": identity.container_id, "name": identity.container_name, "pod": identity.pod_name,
            "namespace": identity.pod_namespace, "runtime": identity.runtime,
            "cgroup_path": identity.cgroup_path},
    }
    return json.dumps(doc, sort_keys=True)
