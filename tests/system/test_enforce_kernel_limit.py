"""The enforcer drives the in-kernel memory limit (BPF map via the probes manager): an
over-limit allocation in a runc pod on the simulated node is killed before it happens
(the sim ledger never exceeds the limit), or stopped and then handled per policy."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.enforce.audit import read_audit
from gpuwatch.sim import node as simnode
from tests.system.enforce_lab import LedgerWatch, kernel_limit_lab, ledger_snapshot, run_pod
from tests.system.sim_helpers import private_node

pytestmark = [pytest.mark.root, pytest.mark.runc, pytest.mark.bpf]
MIB = 1024**2
LIMIT_MIB = 300

POLICY = """
rules:
  - name: capped
    match: {{namespace: ml}}
    limits: {{gpu_memory: {limit_mib}MiB}}
    actions: [{{do: checkpoint-then-kill, at: 100%, grace: 5s}}]
"""


@pytest.fixture
def sim(tmp_path: Path, runc_required: str, bcc_required: None) -> Iterator[simnode.SimNode]:
    with private_node(tmp_path, devices=1, memory_bytes=4096 * MIB) as node:
        yield node


@pytest.mark.parametrize(("kernel_action", "driver"), [("kill", "exact"), ("stop", "exact"), ("kill", "real")])
def test_enforcer_limit_reaches_the_kernel(sim: simnode.SimNode, tmp_path: Path, kernel_action: str,
                                           driver: str) -> None:
    """driver "real": the sim's default H100 shape, a 518 MiB context allocated by cuCtxCreate
    (no cuMemAlloc): the limit, sized as a user would with the context in it, must hold what
    NVML shows -- the kernel checks the decoded driver bytes, not only the libcuda counter
    (which never sees the context and would let the pod reach limit + 518 MiB)."""
    markers = tmp_path / "markers"
    markers.mkdir()
    limit_mib = LIMIT_MIB + (simnode.DEFAULT_CONTEXT_MIB if driver == "real" else 0)
    (tmp_path / "policy.yaml").write_text(POLICY.format(limit_mib=limit_mib))
    with kernel_limit_lab(tmp_path, sim, "kill" if kernel_action == "kill" else None) as (pm, lab, enforcer):
        watch = LedgerWatch(sim)
        try:
            pod = run_pod(lab, sim, markers, real_driver=driver == "real")
            seen = pm.poll_events(0)
            enforcer.on_snapshot(ledger_snapshot(sim, [pod], time.monotonic()), seen)  # pushes the limit
            deadline = time.monotonic() + 15
            decisions = []
            while pod.running() and time.monotonic() < deadline and not decisions:
                time.sleep(0.1)
                events = pm.poll_events(0)
                seen += events
                decisions = enforcer.on_snapshot(ledger_snapshot(sim, [pod], time.monotonic()), events)
            if kernel_action == "kill":
                assert pod.wait(5) == 128 + signal.SIGKILL, pod.logs()
                seen += pm.poll_events(200)
                over = [e.ts_ns for e in seen if e.type == "over_limit"]
                killed = [e.ts_ns for e in seen if e.type == "kill"]
                exited = [e.ts_ns for e in seen if e.type == "process_exit" and over and e.ts_ns > over[0]]
                assert over and killed
                print(
                    f"\nin-kernel path: over-limit call -> SIGKILL sent {(killed[0] - over[0]) / 1e3:.1f} us"
                    + (f", -> process exit {(exited[0] - over[0]) / 1e3:.0f} us" if exited else "")
                )
            else:
                # Stopped before the 3rd allocation; the policy then checkpoints and kills it.
                assert [d.verb.value for d in decisions] == ["checkpoint-then-kill"], pod.logs()
                assert enforcer.actions.checkpoint.wait(10)
                assert pod.wait(5) is not None
                assert (markers / "grow-0").exists(), "the stopped workload checkpointed before the kill"
        finally:
            peak = watch.stop()
            enforcer.close()
    if kernel_action == "kill":
        assert 0 < peak <= limit_mib * MIB, f"ledger peak {peak / MIB:.0f} MiB > limit {limit_mib} MiB"
    else:
        # A checkpoint must let the stopped process run to handle its signal, so the one
        # allocation it was stopped at goes through: over by at most that request.
        assert 0 < peak <= (limit_mib + 128) * MIB, f"ledger peak {peak / MIB:.0f} MiB"
    if kernel_action == "stop":
        record = read_audit(tmp_path / "audit.jsonl")[0]
        assert record["measured"]["pending_allocation_bytes"] == 128 * MIB  # type: ignore[index]
