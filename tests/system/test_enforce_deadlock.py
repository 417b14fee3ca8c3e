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
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.policy.events import ProbeEvent, ProbeEventKind
from gpuwatch.sim import node as simnode
from gpuwatch.sim.runc import ContainerLab, RunningContainer
from tests.system.enforce_lab import audit_decisions, lab_enforcer, ledger_snapshot, wait_ready
from tests.system.sim_helpers import CONTEXT_BYTES, private_node, sim_container, sim_run_argv

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
    argv = sim_run_argv(mib_per_step=2048, steps=1, duty=0.3, kernel_ms=5, checkpoint_marker=markers / pod)
    return wait_ready(lab.run(sim_container(sim, "worker", argv, binds=[markers], namespace="ml", pod=pod)))


def stop_at_allocation(containers: list[RunningContainer], nbytes: int) -> list[ProbeEvent]:
    """What the probe does when each container asks for `nbytes` more: every process stopped
    (SIGSTOP), one STOPPED_AT_ALLOCATION event per container."""
    events = []
    for c in containers:
        for pid in c.pids():
            os.kill(pid, signal.SIGSTOP)
        events.append(
            ProbeEvent(ProbeEventKind.STOPPED_AT_ALLOCATION, time.time(), c.host_pid, 0, nbytes,
                       cgroup_path=c.cgroup_path)
        )
    return events


def wait_memory_used_at_most(sim: simnode.SimNode, nbytes: int, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while simnode.status(sim).devices[0].memory_used_bytes > nbytes and time.monotonic() < deadline:
        time.sleep(0.05)


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
        enforcer = lab_enforcer(tmp_path)
        try:
            # Each asks for 2 GiB more with 1 GiB free: the probe stops both at the allocation.
            events = stop_at_allocation([low, high], 2 * GIB)
            first = ledger_snapshot(sim, [low, high])
            assert first.devices[0].memory_free_bytes == GIB
            decisions = enforcer.on_snapshot(first, events)
            assert [(d.verb.value, d.target.pod_name) for d in decisions] == [("checkpoint-then-kill", "low-0")]
            assert enforcer.last_result is not None and enforcer.last_result.deadlocks_detected == 1
            assert enforcer.actions.checkpoint.wait(15)
            assert low.wait(5) is not None
            assert (markers / "low-0").exists(), "the victim checkpointed before it ended"
            # The victim's 2 GiB are back: the survivor's stopped allocation now fits.
            wait_memory_used_at_most(sim, 2 * GIB + CONTEXT_BYTES)
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
        enforcer = lab_enforcer(tmp_path)
        try:
            events = stop_at_allocation([low, high], 3 * GIB)
            decisions = enforcer.on_snapshot(ledger_snapshot(node, [low, high]), events)
            assert [(d.verb.value, d.target.pod_name) for d in decisions] == [("release", "high-0"), ("pause", "low-0")]
            limits = enforcer.last_result.effective_limits_bytes if enforcer.last_result else {}
            assert limits[high.id] > limits[low.id] and sum(limits.values()) <= 8 * GIB + CONTEXTS
            time.sleep(0.2)
            assert not any(stopped(pid) for pid in high.pids()) and frozen(low)
            high.stop()
            wait_memory_used_at_most(node, 2 * GIB + CONTEXT_BYTES)
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
