"""End to end on the simulated node: runc pod -> fake NVML -> real sampler and identity
resolver -> enforcer -> cgroup kill, with the polling-path latency measured from the
moment the sim ledger first shows the container over its limit to the kill.

The agent side runs in its own process (NVML state is process-global), exactly as
`gpuwatch agent` would: build_sampler + Enforcer.on_snapshot every interval."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.sim import node as simnode
from gpuwatch.sim.node import DEFAULT_CONTEXT_MIB
from gpuwatch.sim.runc import ContainerLab
from tests.system.enforce_lab import audit_decisions
from tests.system.sim_helpers import CONTEXT_BYTES, private_node, sim_container, sim_run_argv

pytestmark = [pytest.mark.root, pytest.mark.runc, pytest.mark.slow]
MIB = 1024**2
LIMIT_MIB = 600 + DEFAULT_CONTEXT_MIB  # 600 MiB of data beside the CUDA context, as a real user sizes it

POLICY = f"""
rules:
  - name: ml-memory
    match: {{namespace: ml}}
    limits: {{gpu_memory: {LIMIT_MIB}MiB}}
    actions: [{{do: kill, at: 100%}}]
"""

AGENT = r"""
import json, sys, time
from pathlib import Path
from gpuwatch.containers.metadata import BundleRoots
from gpuwatch.pipeline.sampler import build_sampler
from gpuwatch.enforce.enforcer import Enforcer, EnforcerConfig
from gpuwatch.enforce.audit import AuditLog
tmp, nvml, interval = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
roots = BundleRoots(containerd_tasks=(str(tmp / "bundles"),), runc_state=(str(tmp / "runc"),))
sampler = build_sampler(nvml_library=nvml, interval_s=interval, node="e2e", bundle_roots=roots)
enforcer = Enforcer(tmp / "policy.yaml", EnforcerConfig(frozen_state_path=tmp / "frozen.json"),
                    audit=AuditLog(tmp / "audit.jsonl"))
print("agent-ready", flush=True)
deadline = time.monotonic() + 20
cycles = []
while time.monotonic() < deadline:
    start = time.monotonic()
    snap = sampler.run_once()
    decisions = enforcer.on_snapshot(snap)
    cycles.append(enforcer.last_latency_s)
    if decisions:
        print(json.dumps({"time": time.time(), "verbs": [d.verb.value for d in decisions],
                          "targets": [d.target.container_id for d in decisions],
                          "on_snapshot_ms": enforcer.last_latency_s * 1e3}), flush=True)
        break
    time.sleep(max(interval - (time.monotonic() - start), 0))
enforcer.close()
sampler.stop()
"""



@pytest.fixture
def sim(tmp_path: Path, runc_required: str) -> Iterator[simnode.SimNode]:
    with private_node(tmp_path, devices=1, memory_bytes=4096 * MIB) as node:
        yield node


def test_over_limit_container_is_killed_through_the_real_pipeline(sim: simnode.SimNode, tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    interval_s = 0.1
    env = dict(os.environ, GPUWATCH_SIM_STATE=str(sim.state_path))
    env.pop("LD_LIBRARY_PATH", None)
    repo = Path(__file__).resolve().parents[2]
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(tmp_path), str(sim.libraries.nvml_path), str(interval_s)],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stdout is not None
        assert agent.stdout.readline().strip() == "agent-ready"
        with ContainerLab(tmp_path / "work", bundle_root=tmp_path / "bundles", runc_root=tmp_path / "runc") as lab:
            argv = sim_run_argv(mib_per_step=256, steps=3, interval_s=1.0, hold=True)
            container = lab.run(sim_container(sim, "trainer", argv, namespace="ml", pod="job-0"))
            over_at = None
            deadline = time.monotonic() + 15
            while container.running() and time.monotonic() < deadline:
                used = simnode.status(sim).devices[0].memory_used_bytes
                if over_at is None and used > LIMIT_MIB * MIB:
                    over_at = time.time()
                time.sleep(0.002)
            status = container.wait(5)
            line = agent.stdout.readline()
            assert line, "the agent made no decision"
            report = json.loads(line)
            assert report["verbs"] == ["kill"] and report["targets"] == [container.id]
            assert status == 128 + 9, container.logs()
            assert over_at is not None
            latency_ms = (report["time"] - over_at) * 1e3
            print(
                f"\npolling path: ledger over limit -> kill done in {latency_ms:.0f} ms "
                f"(sample interval {interval_s * 1e3:.0f} ms, on_snapshot {report['on_snapshot_ms']:.1f} ms)"
            )
            assert latency_ms < 1000 * (2 * interval_s + 0.5)
    finally:
        agent.wait(30)
    (record,) = audit_decisions(tmp_path / "audit.jsonl")
    assert record["action"] == "kill" and record["result"] == "ok"
    assert record["target"]["namespace"] == "ml" and record["target"]["pod"] == "job-0"  # type: ignore[index]
    assert record["measured"]["memory_bytes"] == 768 * MIB + CONTEXT_BYTES  # type: ignore[index]
