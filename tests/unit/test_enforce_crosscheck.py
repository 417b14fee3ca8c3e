"""The in-kernel guard through the real Enforcer (no root): a container whose probe counter
exceeds NVML's for 3 snapshots loses its kernel limit entry (audited, logged once, metric 1)
while polling enforcement on NVML numbers goes on; 3 agreeing snapshots push it back."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpuwatch.core.model import ContainerIdentity, ContainerUsage, DeviceInfo, ProbeCounters, ProcessUsage, Snapshot
from gpuwatch.enforce.audit import read_audit
from gpuwatch.enforce.inkernel_guard import SUSPENDED_METRIC
from gpuwatch.enforce.kernel_limits import NullKernelLimits
from tests.unit.test_enforce_enforcer import make, who

MIB = 2**20
KILL_POLICY = """
rules:
  - name: capped
    match: {namespace: ml}
    limits: {gpu_memory: 1GiB}
    actions: [{do: kill, at: 100%}]
"""


def snap(rows: list[tuple[ContainerIdentity, int, int]], t: float) -> Snapshot:
    """(identity, NVML bytes, probe bytes) per container, one GPU."""
    device = DeviceInfo(0, "GPU-0", "sim", None, 16 * 1024 * MIB, None, None)
    usage = tuple(ContainerUsage(i, 0, "GPU-0", nvml, 0.0, 0.0,
                                 processes=(ProcessUsage(100 + n, None, "job", nvml, 0.0),))
                  for n, (i, nvml, _probe) in enumerate(rows))
    counters = tuple(ProbeCounters(cgroup_id=i.cgroup_id or 0, allocated_bytes_by_gpu=((0, probe),))
                     for i, _nvml, probe in rows)
    return Snapshot(timestamp_s=t, node="n", devices=(device,), containers=usage, probes_up=True,
                    probe_counters=counters, probe_identities=tuple((i.cgroup_id or 0, i) for i, _n, _p in rows))


def suspended_gauge(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(SUSPENDED_METRIC, {"node": "n", "namespace": "ml", "pod": "p", "pod_uid": "",
                                                        "container": name, "container_id": f"id-{name}"})


def test_diverging_probe_counter_suspends_then_resumes_the_kernel_limit(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    limits = NullKernelLimits()
    t = time.time()
    enforcer = make(tmp_path, KILL_POLICY, kernel_limits=limits, dry_run=False, clock=lambda: t)
    registry = CollectorRegistry()
    registry.register(enforcer.metrics_collector())
    a, b = who("a", 7), who("b", 8)

    def step(a_probe_mib: int, a_nvml_mib: int = 300) -> None:
        nonlocal t
        t += 0.5
        enforcer.on_snapshot(snap([(a, a_nvml_mib * MIB, a_probe_mib * MIB), (b, 200 * MIB, 200 * MIB)], t))

    caplog.set_level(logging.INFO, logger="gpuwatch.enforce.inkernel_guard")
    step(300)
    assert limits.limits == {7: 1024 * MIB, 8: 1024 * MIB} and limits.actions[7] == "kill"
    assert suspended_gauge(registry, "a") == 0.0
    step(900)
    step(900)
    assert 7 in limits.limits  # 2 intervals: still trusted
    step(900)
    assert limits.limits == {8: 1024 * MIB}  # no entry: the kernel cannot kill a on its counter
    assert suspended_gauge(registry, "a") == 1.0 and suspended_gauge(registry, "b") == 0.0
    view = {v.identity.container_name: v for v in enforcer.view()}
    assert "in-kernel kill/stop suspended" in view["a"].reason and view["b"].reason == ""
    for _ in range(4):
        step(950)
    assert limits.limits == {8: 1024 * MIB}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "suspended" in r.getMessage()]
    assert len(warnings) == 1  # logged once, not every interval

    # polling enforcement on NVML numbers goes on while the kernel path is off
    t += 0.5
    decisions = enforcer.on_snapshot(snap([(a, 1100 * MIB, 2000 * MIB), (b, 200 * MIB, 200 * MIB)], t))
    assert [(d.verb.value, d.target.container_name) for d in decisions] == [("kill", "a")]
    assert 7 not in limits.limits

    step(310)
    step(310)
    assert 7 not in limits.limits
    step(310)
    assert limits.limits[7] == 1024 * MIB and limits.actions[7] == "kill"
    assert suspended_gauge(registry, "a") == 0.0

    records = [r for r in read_audit(tmp_path / "audit.jsonl") if r["event"] == "crosscheck"]
    assert [r["action"] for r in records] == ["suspend-inkernel", "resume-inkernel"]
    suspended = records[0]
    assert suspended["target"]["container"] == "a" and suspended["result"] == "ok"  # type: ignore[index]
    assert suspended["measured"]["divergence_bytes"] == 600 * MIB  # type: ignore[index]
    assert suspended["measured"]["allowed_excess_bytes"] == 64 * MIB  # type: ignore[index]
    enforcer.close()


def test_no_nvml_number_keeps_the_kernel_limit(tmp_path: Path) -> None:
    """NVML does not list the container (or lists it N/A): no judgement, its limit stays."""
    limits = NullKernelLimits()
    t = time.time()
    enforcer = make(tmp_path, KILL_POLICY, kernel_limits=limits, clock=lambda: t)
    a = who("a", 7)
    for _ in range(5):
        t += 0.5
        base = snap([(a, 300 * MIB, 5000 * MIB)], t)
        na_rows = tuple(ContainerUsage(r.identity, 0, "GPU-0", 0, 0.0, 0.0,
                                       processes=(ProcessUsage(100, None, "job", None, 0.0),))
                        for r in base.containers)
        enforcer.on_snapshot(Snapshot(timestamp_s=t, node="n", devices=base.devices, containers=na_rows,
                                      probes_up=True, probe_counters=base.probe_counters,
                                      probe_identities=base.probe_identities))
    assert enforcer.kernel_guard.suspended_keys() == frozenset()
    assert not [r for r in read_audit(tmp_path / "audit.jsonl") if r["event"] == "crosscheck"]
    enforcer.close()


def test_dry_run_audits_the_suspension_as_dry_run(tmp_path: Path) -> None:
    limits = NullKernelLimits()
    t = time.time()
    enforcer = make(tmp_path, KILL_POLICY, kernel_limits=limits, dry_run=True, clock=lambda: t)
    a = who("a", 7)
    for _ in range(3):
        t += 0.5
        enforcer.on_snapshot(snap([(a, 100 * MIB, 900 * MIB)], t))
    assert limits.limits == {}  # a dry run pushes nothing
    records = [r for r in read_audit(tmp_path / "audit.jsonl") if r["event"] == "crosscheck"]
    assert [(r["action"], r["result"], r["dry_run"]) for r in records] == [("suspend-inkernel", "dry_run", True)]
    enforcer.close()
