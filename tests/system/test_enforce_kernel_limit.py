"""The enforcer drives the in-kernel memory limit (BPF map via the probes manager): an
over-limit allocation in a runc pod on the simulated node is killed before it happens
(the sim ledger never exceeds the limit), or stopped and then handled per policy."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.agent.enforcer_factory import ProbeLimitMap
from gpuwatch.enforce.audit import read_audit
from gpuwatch.probes.manager import ProbeConfig, ProbeManager
from gpuwatch.sim import node as simnode
from gpuwatch.sim.runc import ContainerLab, RunningContainer
from tests.system.enforce_lab import identity_of as identity_of  # re-exported: test_enforce_crosscheck imports it here
from tests.system.enforce_lab import lab_enforcer, ledger_snapshot
from tests.system.sim_helpers import private_node, sim_container, sim_run_argv

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


def run_pod(lab: ContainerLab, sim: simnode.SimNode, markers: Path, real_driver: bool = False) -> RunningContainer:
    argv = sim_run_argv(
        mib_per_step=128, steps=6, interval_s=0.7, hold=True, checkpoint_marker=markers / "grow-0",
        # exact driver (no context, no carving): the ledger's bytes are the API's, so the kill
        # and stop cases below measure the limit in the bytes the workload asked for
        context_mib=None if real_driver else 0, suballoc_mib=None if real_driver else 0,
    )
    return lab.run(sim_container(sim, "grower", argv, binds=[markers], namespace="ml", pod="grow-0"))


class LedgerWatch:
    """Polls the sim ledger every 2 ms and keeps the peak used memory."""

    def __init__(self, sim: simnode.SimNode) -> None:
        self.sim, self.peak, self._stop = sim, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, simnode.status(self.sim).devices[0].memory_used_bytes)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(2)
        return self.peak


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
    config = ProbeConfig(device_prefix=str(sim.dev_dir / "nvidia"), libcuda_paths=(str(sim.libraries.cuda_path),))
    with (
        ProbeManager(config) as pm,
        ContainerLab(tmp_path / "work", bundle_root=tmp_path / "bundles", runc_root=tmp_path / "runc") as lab,
    ):
        enforcer = lab_enforcer(tmp_path, limit_map=ProbeLimitMap(pm, "kill" if kernel_action == "kill" else None))
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
