"""`gpuwatch trace` formatting and filters (pure)."""

from __future__ import annotations

import json

from gpuwatch.core.model import ContainerIdentity
from gpuwatch.probes.kernel_events import KernelEvent
from gpuwatch.probes.trace_view import TraceFilter, format_json, format_line, human_bytes

POD = ContainerIdentity(runtime="containerd", cgroup_path="/kubepods/pod1/abc", container_id="abcdef123456",
                        container_name="trainer", pod_name="job-1", pod_namespace="ml", cgroup_id=42)
HOST = ContainerIdentity(runtime="host", cgroup_path="/")


def _ev(type_: str = "alloc", source: str = "cuda", size: int = 3 << 20, value: int = 0x7F00,
        device: int | None = None) -> KernelEvent:
    return KernelEvent(type=type_, ts_ns=2_500_000_000, cgroup_id=42, tgid=100, tid=101, comm="python",
                      size_bytes=size, value=value, device=device, source=source, kind="")


def test_filter_by_container_pod_namespace() -> None:
    assert TraceFilter().matches(None)
    assert TraceFilter(container="trainer").matches(POD)
    assert TraceFilter(container="abcdef").matches(POD)
    assert not TraceFilter(container="other").matches(POD)
    assert TraceFilter(pod="job-1", namespace="ml").matches(POD)
    assert not TraceFilter(namespace="kube-system").matches(POD)
    assert not TraceFilter(namespace="ml").matches(HOST)
    assert not TraceFilter(pod="job-1").matches(None)


def test_line_has_time_process_container_and_size() -> None:
    line = format_line(_ev(), POD, t0_ns=500_000_000)
    assert line.split()[:5] == ["2.000", "100", "python", "ml/job-1/trainer", "alloc"]
    assert "cuda 3.0 MiB ptr=0x7f00" in line
    rm = format_line(_ev(source="ioctl", size=4096, value=0x64, device=1), None, 0)
    assert "cgroup:42" in rm and "ioctl 4.0 KiB hObject=0x64 gpu=1" in rm


def test_json_line_carries_identity() -> None:
    doc = json.loads(format_json(_ev(type_="oom", value=2), POD))
    assert doc["event"] == "oom" and doc["size_bytes"] == 3 << 20 and doc["value"] == 2
    assert doc["container"]["pod"] == "job-1" and doc["container"]["namespace"] == "ml"
    assert json.loads(format_json(_ev(), None))["container"] is None


def test_human_bytes() -> None:
    assert human_bytes(1000) == "1000 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(2 << 40) == "2.0 TiB"
