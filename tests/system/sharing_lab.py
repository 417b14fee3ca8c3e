"""The agent's pipeline in the test process, wired as `gpuwatch agent --policy` wires it (sampler
over the simulated node's NVML with container identities from the runc bundles, kernel probes
with uprobes on the simulated libcuda, the probes' event pump that wakes the sampler, the
enforcer with its actions), for system tests that
need the probes' stop-at-allocation: the agent CLI finds libcuda by itself only once a GPU
process maps it, so a test's first allocation could run before the uprobe is attached; here
the library path is given.

The policy's rules must match only the test's own pods: the probes see every process that
uses the simulated libcuda on this machine, other tests' included, and a limit pushed for a
cgroup stops its allocations.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from gpuwatch.sim.node import SimNode


class InProcessAgent:
    def __init__(self, sim: SimNode, lab_dirs: dict[str, Path], work: Path, policy_text: str,
                 interval_s: float = 0.25) -> None:
        from gpuwatch.agent.enforcer_factory import CgroupNodeContainers, build_enforcer
        from gpuwatch.containers import BundleRoots
        from gpuwatch.enforce.enforcer import EnforcerConfig
        from gpuwatch.enforce.kernel_limits import NullDeviceGate
        from gpuwatch.pipeline.sampler import build_sampler
        from gpuwatch.probes.manager import ProbeConfig, ProbeManager

        os.environ["GPUWATCH_SIM_STATE"] = str(sim.state_path)
        roots = BundleRoots(containerd_tasks=(str(lab_dirs["bundle_root"]),), runc_state=(str(lab_dirs["runc_root"]),))
        self.interval_s = interval_s
        self.errors: list[str] = []
        self.probes = ProbeManager(ProbeConfig(device_prefix=str(sim.dev_dir / "nvidia"),
                                               libcuda_paths=(str(sim.libraries.cuda_path),)))
        self.probes.start()
        try:
            self.sampler = build_sampler(nvml_library=str(sim.libraries.nvml_path), interval_s=interval_s,
                                         node="sim-node", probe_source=self.probes, bundle_roots=roots)
            policy = work / "policy.yaml"
            policy.write_text(policy_text)
            self.audit_path = work / "audit.jsonl"
            self.enforcer: Any = build_enforcer(
                policy, self.audit_path,
                EnforcerConfig(frozen_state_path=work / "frozen.json", recover=False, lock_path=work / "agent.lock"),
                probes=self.probes, device_gate=NullDeviceGate(),
                node_containers=CgroupNodeContainers(bundle_roots=roots, subtrees=("/kubepods",)))
        except BaseException:
            self.probes.stop()
            raise
        self.sampler.start()
        from gpuwatch.agent.event_pump import EventPump

        self.pump = EventPump(self.probes.poll_events, self.sampler.wake).start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="test-agent", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from gpuwatch.core.errors import GpuwatchError

        for snapshot in self.sampler.follow(self._stop, poll_s=self.interval_s / 4):
            try:
                self.enforcer.on_snapshot(snapshot, self.pump.take())
            except GpuwatchError as err:
                self.errors.append(str(err))

    def snapshot(self) -> Any:
        """The latest snapshot with the enforcer's view, as the agent serves /snapshot.json."""
        return self.enforcer.decorate(self.sampler.latest())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pump.stop()
        self.enforcer.close()
        self.sampler.stop()
        self.probes.stop()

    def __enter__(self) -> InProcessAgent:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
