"""The deadlock paper's scenario on the simulated node with runc pods: a 5 GiB GPU, two
containers each hold 2 GiB and each ask for 2 GiB more, stopped at the allocation. Each
process also holds its CUDA context (518 MiB, as on an H100): the GPUs get room for both
contexts on top, so the free memory is the paper's.

The kernel probe's stop-at-allocation is played by the test (SIGSTOP + a
STOPPED_AT_ALLOCATION event per container, exactly what the probe reports); everything
else is real: the ledger's memory, runc cgroups, the enforcer's detection, the victim's
checkpoint (marker) and kill, and the survivor continued once its request fits."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.core.model import ContainerUsage, DeviceInfo, Snapshot
from gpuwatch.enforce.audit import AuditLog
from gpuwatch.enforce.enforcer import Enforcer
from gpuwatch.policy.events import ProbeEvent, ProbeEventKind
from gpuwatch.sim import node as simnode
from gpuwatch.sim.runc import ContainerLab, ContainerSpec, RunningContainer
from tests.system.enforce_lab import audit_decisions, identity_of, wait_ready
from tests.system.sim_helpers import CONTEXT_BYTES, private_node

pytestmark = [pytest.mark.root, pytest.mark.runc]
MIB, GIB = 1024**2, 1024**3
CONTEXTS = 2 * CONTEXT_BYTES  # the two workers' contexts

POLICY = """
deadlock: {enabled: true, action: checkpoint-then-kill, signal: SIGUSR1, grace: 10s, blocked_window: 30s}
rules:
  - name: low
    priority: 1
    match: {namespace: ml, pod: low-*}
  - name: high
    priority: 9
    match: {namespace: ml, pod: high-*}
"""



@pytest.fixture
def sim(tmp_path: Path, runc_required: str) -> Iterator[simnode.SimNode]:
    with private_node(tmp_path, devices=1, memory_bytes=5 * GIB + CONTEXTS) as node:
        yield node


def start(lab: ContainerLab, sim: simnode.SimNode, markers: Path, pod: str) -> RunningContainer:
    spec = ContainerSpec(
        name="worker",
        namespace="ml",
        pod=pod,
        argv=[
            sys.executable,
            "-m",
            "gpuwatch",
            "sim",
            "run",
            "--mib-per-step",
            "2048",
            "--steps",
            "1",
            "--duty",
            "0.3",
            "--kernel-ms",
            "5",
            "--checkpoint-marker",
            str(markers / pod),
        ],
        env=simnode.sim_env(sim),
        extra_binds=[str(sim.state_path.parent), str(sim.root), str(markers)],
        ro_binds=[str(sim.libraries.lib_dir)],
    )
    return wait_ready(lab.run(spec))



def ledger_snapshot(sim: simnode.SimNode, containers: list[RunningContainer]) -> Snapshot:
    state = simnode.status(sim)
    device = state.devices[0]
    rows = []
    for c in containers:
        pids = set(c.pids())
        memory = sum(p.memory_bytes for p in state.processes if p.host_pid in pids)
        if pids:
            rows.append(ContainerUsage(identity_of(c), 0, "GPU-0", memory, 0.0, 0.0))
    info = DeviceInfo(
        0,
        "GPU-0",
        "sim",
        None,
        device.memory_total_bytes,
        device.memory_used_bytes,
        device.memory_total_bytes - device.memory_used_bytes,
        simulated=True,
    )
    return Snapshot(timestamp_s=time.time(), node="sim", devices=(info,), containers=tuple(rows), simulated=True)


def stopped(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("State:"):
            return line.split()[1] == "T"
    return False


def test_paper_deadlock_is_broken_by_priority(sim: simnode.SimNode, tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    (tmp_path / "policy.yaml").write_text(POLICY)
    with ContainerLab(tmp_path / "work", bundle_root=tmp_path / "bundles", runc_root=tmp_path / "runc") as lab:
        low, high = start(lab, sim, markers, "low-0"), start(lab, sim, markers, "high-0")
        enforcer = Enforcer(
            tmp_path / "policy.yaml",
            audit=AuditLog(tmp_path / "audit.jsonl"),
            frozen_state_path=tmp_path / "frozen.json",
            own_cgroups=frozenset(),
        )
        try:
            # Each asks for 2 GiB more with 1 GiB free: the probe stops both at the allocation.
            events = []
            for c in (low, high):
                for pid in c.pids():
                    os.kill(pid, signal.SIGSTOP)
                events.append(
                    ProbeEvent(
                        ProbeEventKind.STOPPED_AT_ALLOCATION,
                        time.time(),
                        c.host_pid,
                        0,
                        2 * GIB,
                        cgroup_path=c.cgroup_path,
                    )
                )
            first = ledger_snapshot(sim, [low, high])
            assert first.devices[0].memory_free_bytes == GIB
            decisions = enforcer.on_snapshot(first, events)
            assert [(d.verb.value, d.target.pod_name) for d in decisions] == [("checkpoint-then-kill", "low-0")]
            assert enforcer.last_result is not None and enforcer.last_result.deadlocks_detected == 1
            assert enforcer.actions.checkpoint.wait(15)
            assert low.wait(5) is not None
            assert (markers / "low-0").exists(), "the victim checkpointed before it ended"
            # The victim's 2 GiB are back: the survivor's stopped allocation now fits.
            deadline = time.monotonic() + 5
            while (simnode.status(sim).devices[0].memory_used_bytes > 2 * GIB + CONTEXT_BYTES
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            decisions = enforcer.on_snapshot(ledger_snapshot(sim, [high]), events)
            assert [(d.verb.value, d.target.pod_name, d.continue_stopped) for d in decisions] == [
                ("release", "high-0", True)
            ]
            assert enforcer.last_result is not None and enforcer.last_result.deadlocks_resolved == 1
            time.sleep(0.2)
            assert high.running() and not any(stopped(pid) for pid in high.pids())
        finally:
            enforcer.close()
    records = audit_decisions(tmp_path / "audit.jsonl")
    assert [(r["action"], r["result"], r["scope"]) for r in records] == [
        ("checkpoint-then-kill", "started", "deadlock"),
        ("checkpoint-then-kill", "ok", "deadlock"),
        ("release", "ok", "deadlock"),
    ]


def frozen(c: RunningContainer) -> bool:
    return (c.v2_dir / "cgroup.freeze").read_text().strip() == "1"


def test_fair_share_pauses_low_priority_instead_of_oom(sim: simnode.SimNode, tmp_path: Path) -> None:
    """8 GiB GPU (plus the contexts), both hold 2 GiB and want 3 GiB more (10 > 8): the high-priority one
    continues, the low one waits paused; when the high one ends, the low one resumes."""
    markers = tmp_path / "markers"
    markers.mkdir()
    simnode.down(sim.name, state_path=sim.state_path)
    node = simnode.up(devices=1, memory_bytes=8 * GIB + CONTEXTS, name=sim.name, state_path=sim.state_path,
                      root=sim.root)
    (tmp_path / "policy.yaml").write_text("fair_share: {enabled: true}\n" + POLICY)
    with ContainerLab(tmp_path / "work", bundle_root=tmp_path / "bundles", runc_root=tmp_path / "runc") as lab:
        low, high = start(lab, node, markers, "low-0"), start(lab, node, markers, "high-0")
        enforcer = Enforcer(
            tmp_path / "policy.yaml",
            audit=AuditLog(tmp_path / "audit.jsonl"),
            frozen_state_path=tmp_path / "frozen.json",
            own_cgroups=frozenset(),
        )
        try:
            events = []
            for c in (low, high):
                for pid in c.pids():
                    os.kill(pid, signal.SIGSTOP)
                events.append(
                    ProbeEvent(
                        ProbeEventKind.STOPPED_AT_ALLOCATION,
                        time.time(),
                        c.host_pid,
                        0,
                        3 * GIB,
                        cgroup_path=c.cgroup_path,
                    )
                )
            decisions = enforcer.on_snapshot(ledger_snapshot(node, [low, high]), events)
            assert [(d.verb.value, d.target.pod_name) for d in decisions] == [("release", "high-0"), ("pause", "low-0")]
            limits = enforcer.last_result.effective_limits_bytes if enforcer.last_result else {}
            assert limits[high.id] > limits[low.id] and sum(limits.values()) <= 8 * GIB + CONTEXTS
            time.sleep(0.2)
            assert not any(stopped(pid) for pid in high.pids()) and frozen(low)
            high.stop()
            deadline = time.monotonic() + 5
            while (simnode.status(node).devices[0].memory_used_bytes > 2 * GIB + CONTEXT_BYTES
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            decisions = enforcer.on_snapshot(ledger_snapshot(node, [low]), events)
            assert [(d.verb.value, d.target.pod_name) for d in decisions] == [("release", "low-0")]
            time.sleep(0.2)
            assert not frozen(low) and not any(stopped(pid) for pid in low.pids()) and low.running()
        finally:
            enforcer.close()
    records = audit_decisions(tmp_path / "audit.jsonl")
    assert [(r["action"], r["scope"]) for r in records] == [
        ("release", "deadlock"),
        ("pause", "fair_share"),
        ("release", "fair_share"),
    ]
