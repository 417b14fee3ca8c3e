"""Enforcement on runc containers running the simulated GPU workload (root + runc):
pause/resume stops and restarts its kernels, checkpoint-then-kill delivers the checkpoint
signal and the workload writes its marker before the kill, protected pods stay untouched.

The snapshots are built from the container's real identity (cgroup path from the runtime),
so this checks that the enforcer's cgroup handling fits what runc creates on this host."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.enforce.cgroup_ops import CgroupTree
from gpuwatch.enforce.control import cgroup_cpu_busy
from gpuwatch.sim import node as simnode
from gpuwatch.sim.runc import ContainerLab, RunningContainer
from tests.system.enforce_lab import GIB, audit_decisions, identity_of, lab_enforcer, snapshot, wait_ready
from tests.system.sim_helpers import private_node, sim_container, sim_run_argv

pytestmark = [pytest.mark.root, pytest.mark.runc]
MIB = 1024**2

POLICY = """
tuning: {release_after: 0s, min_hold: 0s}
rules:
  - name: ml-limit
    match: {namespace: ml}
    limits: {gpu_memory: 512MiB}
    actions:
      - {do: pause, at: 100%}
      - {do: checkpoint-then-kill, at: 100%, for: 1s, grace: 10s}
  - name: everyone
    match: {default: true}
    limits: {gpu_memory: 512MiB}
    actions: [{do: kill}]
"""



@pytest.fixture
def sim(tmp_path: Path, runc_required: str) -> Iterator[simnode.SimNode]:
    with private_node(tmp_path, devices=1, memory_bytes=4096 * MIB) as node:
        yield node


@pytest.fixture
def lab(tmp_path: Path, sim: simnode.SimNode) -> Iterator[ContainerLab]:
    with ContainerLab(tmp_path / "work", bundle_root=tmp_path / "bundles", runc_root=tmp_path / "runc") as lab:
        yield lab


def start(lab: ContainerLab, sim: simnode.SimNode, tmp_path: Path, name: str, namespace: str) -> RunningContainer:
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir(exist_ok=True)
    argv = sim_run_argv(mib_per_step=768, steps=1, duty=0.5, kernel_ms=5, checkpoint_marker=marker_dir / name)
    return wait_ready(lab.run(sim_container(sim, name, argv, binds=[marker_dir], namespace=namespace, pod=f"{name}-0")))



def cpu_advances(container: RunningContainer, seconds: float = 0.6) -> bool:
    handle = CgroupTree().handle(container.cgroup_path)
    before = handle.cpu_seconds()
    time.sleep(seconds)
    return handle.cpu_seconds() - before > 0.01


def test_pause_then_checkpoint_kill_on_runc_container(lab: ContainerLab, sim: simnode.SimNode, tmp_path: Path) -> None:
    container = start(lab, sim, tmp_path, "trainer", "ml")
    who = identity_of(container)
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    enforcer = lab_enforcer(tmp_path, policy, busy_source=cgroup_cpu_busy)
    try:
        assert cpu_advances(container), "the workload runs kernels (burns CPU) before enforcement"
        t0 = time.time()
        assert [d.verb.value for d in enforcer.on_snapshot(snapshot((who, 768 * MIB), t=t0))] == ["pause"]
        time.sleep(0.1)
        assert not cpu_advances(container), "paused: no kernel time"
        time.sleep(max(t0 + 1.05 - time.time(), 0.0))
        decisions = enforcer.on_snapshot(snapshot((who, 768 * MIB)))
        assert [d.verb.value for d in decisions] == ["checkpoint-then-kill"]
        assert enforcer.actions.checkpoint.wait(15)
        status = container.wait(5)
        assert status is not None
        marker = tmp_path / "markers" / "trainer"
        assert marker.exists(), container.logs()
        assert "checkpoint" in container.logs()
    finally:
        enforcer.close()
    records = audit_decisions(tmp_path / "audit.jsonl")
    assert [(r["action"], r["result"]) for r in records] == [
        ("pause", "ok"),
        ("checkpoint-then-kill", "started"),
        ("checkpoint-then-kill", "ok"),
    ]
    assert records[0]["target"]["cgroup_path"] == container.cgroup_path  # type: ignore[index]


def test_release_resumes_runc_container_and_protected_pod_untouched(
    lab: ContainerLab, sim: simnode.SimNode, tmp_path: Path
) -> None:
    trainer = start(lab, sim, tmp_path, "trainer2", "ml")
    dns = start(lab, sim, tmp_path, "coredns", "kube-system")
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    enforcer = lab_enforcer(tmp_path, policy, busy_source=cgroup_cpu_busy)
    try:
        decisions = enforcer.on_snapshot(snapshot((identity_of(trainer), GIB), (identity_of(dns), GIB)))
        assert [(d.verb.value, d.target.container_name) for d in decisions] == [("pause", "trainer2")]
        assert not cpu_advances(trainer) and cpu_advances(dns)
        decisions = enforcer.on_snapshot(snapshot((identity_of(trainer), 100 * MIB), (identity_of(dns), GIB)))
        assert [d.verb.value for d in decisions] == ["release"]
        assert cpu_advances(trainer)
    finally:
        thawed = enforcer.close()
    assert thawed == []
    assert trainer.running() and dns.running()
