"""Execution rescheduling on an oversubscribed simulated GPU, with runc pods, the kernel probes
(stop at the allocation) and the enforcer (freeze / thaw + SIGCONT).

A 4 GiB GPU and three jobs that each grow to 2 GiB (declared by their pods' rule) while they
work: together 6 GiB. Each job's process also holds its CUDA context (518 MiB, as on an H100;
created at its start, before any cuMemAlloc the probes could stop): the GPU has room for the
three contexts on top of the 4 GiB, and the rule's limit counts the job's own context.
Without the agent the third job's allocations would fail with
CUDA_ERROR_OUT_OF_MEMORY; with fair share + rescheduling it waits, frozen and stopped at its
first allocation ("waiting for memory" in top), until a job ends, then resumes. Every job
completes; none sees an OOM."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.core import snapshot_doc
from gpuwatch.enforce.audit import read_audit
from gpuwatch.sim import demo
from gpuwatch.sim import node as simnode
from gpuwatch.sim.node import DEFAULT_CONTEXT_MIB
from gpuwatch.sim.runc import ContainerLab, ContainerSpec, RunningContainer
from gpuwatch.tui.render import plain_table
from tests.system.sharing_lab import InProcessAgent
from tests.system.sim_helpers import CONTEXT_BYTES, private_node, sim_container, sim_run_argv

pytestmark = [pytest.mark.root, pytest.mark.runc, pytest.mark.bpf, pytest.mark.slow]
GIB = 1 << 30
GPU_BYTES = 4 * GIB + 3 * CONTEXT_BYTES  # two jobs' 2 GiB and all three contexts
NS = "resched-test"
POLICY = f"""
fair_share: {{enabled: true, split: demand}}
rescheduling: {{checkpoint_after: never}}
rules:
  - name: jobs
    match: {{namespace: {NS}}}
    limits: {{gpu_memory: {2048 + DEFAULT_CONTEXT_MIB}MiB}}
    actions: [{{do: alert, at: 101%}}]
"""


def spec(sim: simnode.SimNode, name: str) -> ContainerSpec:
    argv = sim_run_argv(name=sim.name, gpu=0, mib_per_step=1024, steps=2, interval_s=0.5, hold=True, duty=1,
                        kernel_ms=10, work_s=3)
    return sim_container(sim, name, ["/bin/sh", "-c", 'sleep 1 && exec "$@"', name, *argv], namespace=NS, pod=name)


def test_oversubscribed_gpu_waits_instead_of_oom_and_every_job_resumes(
    tmp_path: Path, runc_required: str, bcc_required: None
) -> None:
    with private_node(tmp_path / "node", devices=1, memory_bytes=GPU_BYTES) as sim:
        dirs = demo.default_lab_dirs(tmp_path / "node")
        with ContainerLab(**dirs) as lab, InProcessAgent(sim, dirs, tmp_path, POLICY) as agent:
            jobs: list[RunningContainer] = []
            for name in ("first", "second", "third"):
                jobs.append(lab.run(spec(sim, name)))
                time.sleep(0.3)
            seen_waiting: dict[str, object] = {}  # pod -> the first snapshot showing it waiting
            peak = 0
            deadline = time.monotonic() + 90
            while any(j.running() for j in jobs) and time.monotonic() < deadline:
                peak = max(peak, simnode.status(sim).devices[0].memory_used_bytes)
                snapshot = agent.snapshot()
                for e in snapshot.enforcement:
                    if e.state == "waiting-memory":
                        seen_waiting.setdefault(e.identity.pod_name, snapshot)
                time.sleep(0.1)
            exits = {j.name: (j.wait(5), j.logs()) for j in jobs}
        assert not agent.errors, agent.errors
    for name, (status, logs) in exits.items():
        assert status == 0 and "done " in logs and "oom " not in logs, (name, status, logs[-500:])
    assert peak <= GPU_BYTES
    # the third does not fit while the first two hold 4 GiB (the second may wait a round too:
    # the first, alone, was promised the whole GPU until its allowance shrank)
    assert "third" in seen_waiting, f"the third job never waited for memory: {list(seen_waiting)}"
    shown = seen_waiting["third"]
    third = next(e for e in shown.enforcement if e.identity.pod_name == "third")  # type: ignore[attr-defined]
    # its allowance is what it holds already, its context: no room for data yet
    assert third.pending_bytes == GIB and third.memory_limit_bytes == CONTEXT_BYTES
    table = plain_table(shown)  # type: ignore[arg-type]
    print(table)
    assert "waiting for memory" in table
    # the same view through the snapshot document and the CLI, as `top --agent` shows it
    doc = tmp_path / "snapshot.json"
    doc.write_text(snapshot_doc.dumps(shown))  # type: ignore[arg-type]
    top = subprocess.run([sys.executable, "-m", "gpuwatch", "top", "--snapshot-file", str(doc), "--once"],
                         capture_output=True, text=True, timeout=30, check=False)
    assert "waiting for memory" in top.stdout, top.stdout + top.stderr
    records = read_audit(agent.audit_path)
    for pod in seen_waiting:  # every job that waited was resumed
        moves = [(r["action"], r["scope"]) for r in records if r["target"]["pod"] == pod]  # type: ignore[index]
        assert ("pause", "fair_share") in moves and ("release", "fair_share") in moves, (pod, moves)
    assert all(r["result"] in ("ok", "gone") for r in records), records


def _stopped(container: RunningContainer) -> bool:
    """A process of the container is stopped (T): held at an allocation by the kernel probes."""
    for pid in container.pids():
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return True
        except (OSError, IndexError):
            continue
    return False


def test_a_waiting_job_resumes_within_a_cycle_of_the_memory_freeing_not_at_the_next_tick(
    tmp_path: Path, runc_required: str, bcc_required: None
) -> None:
    """The probes' event pump (gpuwatch/agent/event_pump.py): a holder's process exit wakes the
    sampler, so a job waiting for memory is resumed within a cycle, not at the next tick of a
    long interval. Two holders and two waiters: each waiter resumes when a job before it ends."""
    interval_s = 4.0  # a woken cycle comes at most 0.4 s after the previous one
    start_after_s = interval_s + 1  # the waiters are listed (and gated) before their first allocation

    def job(sim: simnode.SimNode, name: str, work_s: float, sleep_s: float) -> ContainerSpec:
        argv = sim_run_argv(name=sim.name, gpu=0, mib_per_step=1024, steps=2, interval_s=0.5, hold=True, duty=1,
                            kernel_ms=10, work_s=work_s)
        return sim_container(sim, name, ["/bin/sh", "-c", f'sleep {sleep_s:g} && exec "$@"', name, *argv],
                             namespace=NS, pod=name)

    four_contexts = 4 * GIB + 4 * CONTEXT_BYTES  # two jobs' data, every job's context (made at its start)
    with private_node(tmp_path / "node", devices=1, memory_bytes=four_contexts) as sim:
        dirs = demo.default_lab_dirs(tmp_path / "node")
        with ContainerLab(**dirs) as lab, InProcessAgent(sim, dirs, tmp_path, POLICY, interval_s=interval_s) as agent:
            holders = [lab.run(job(sim, "first", 6, 1)), lab.run(job(sim, "second", 9, 1))]
            waiters = [lab.run(job(sim, "third", 2, start_after_s)), lab.run(job(sim, "fourth", 2, start_after_s))]
            ended: dict[str, float] = {}
            stopped_since: dict[str, float] = {}
            resumed: dict[str, float] = {}
            deadline = time.monotonic() + 60
            while any(c.running() for c in holders + waiters) and time.monotonic() < deadline:
                now = time.monotonic()
                for c in holders + waiters:
                    if c.name not in ended and not c.running():
                        ended[c.name] = now
                for c in waiters:
                    if c.name in resumed or not c.running():
                        continue
                    if _stopped(c):
                        stopped_since.setdefault(c.name, now)
                    elif c.name in stopped_since:
                        resumed[c.name] = now
                time.sleep(0.02)
            exits = {c.name: (c.wait(5), c.logs()) for c in holders + waiters}
        assert not agent.errors, agent.errors
        wakes = agent.pump.wakes
    for name, (status, logs) in exits.items():
        assert status == 0 and "done " in logs and "oom " not in logs, (name, status, logs[-500:])
    assert set(stopped_since) == {"third", "fourth"}, f"both waiters should have waited: {stopped_since}"
    # each waiter's room came from the job that ended last before it resumed (seen 20 ms apart)
    delays = {}
    for waiter, at in resumed.items():
        freed = [t for t in ended.values() if t <= at + 0.05]
        assert freed, f"{waiter} resumed before any job ended: {resumed} {ended}"
        delays[waiter] = at - max(freed)
    print(f"\nresumed after a job's end (interval {interval_s:g} s): "
          + ", ".join(f"{w} {d * 1000:.0f} ms" for w, d in delays.items()) + f"; sampler woken {wakes} times")
    assert set(delays) == {"third", "fourth"} and all(d < 1.0 for d in delays.values()), delays
