"""Hybrid host (v1 controllers + v2): probe counters follow the same identity as NVML (root, BPF).

This CI machine is hybrid. Three sim workers are placed the way v1-only runtimes leave them:
* A: named only by v1 cgroups (``/docker/<A>`` in the v1 controllers), its v2 cgroup the root;
* B and C: two docker-shaped containers (``/docker/<B>``, ``/docker/<C>`` in v1) sharing one
  v2 cgroup, as docker with the cgroupfs driver does.
The real probes count all of them per v2 cgroup. The sampler (real resolver, real probes, a
GPU backend reading the sim's ledger -- what its fake NVML reports) must join the counters
per process, so each container's probe bytes equal its NVML bytes and the probe-vs-NVML
cross-check meets every container. A kill limit on B is refused for the kernel (audited with
its reason: B has no v2 cgroup of its own, the kernel would count B and C together) and no
kernel limit is pushed.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.containers.resolver import IdentityResolver
from gpuwatch.core.model import DeviceInfo, GpuProcess, GpuSweep
from gpuwatch.core.probe_nvml import compare_probe_nvml
from gpuwatch.enforce.audit import read_audit
from gpuwatch.enforce.kernel_limits import NullKernelLimits
from gpuwatch.pipeline.sampler import Sampler
from gpuwatch.probes.manager import ProbeConfig, ProbeManager
from gpuwatch.sim import node as simnode
from tests.enforcer_setup import enforcer_for
from tests.system.sim_helpers import Workers, cgroup2_root, in_cgroups, private_node, remove_dirs, workers

pytestmark = [pytest.mark.root, pytest.mark.bpf]
MIB = 1 << 20
V1_CONTROLLERS = ("memory", "pids", "freezer")


class LedgerBackend:
    """A GpuBackend over the sim's ledger: per process what its fake NVML reports."""

    def __init__(self, sim: simnode.SimNode) -> None:
        self.sim = sim

    def sweep(self) -> GpuSweep:
        state = simnode.status(self.sim)
        devices = tuple(DeviceInfo(d.index, f"GPU-sim-{d.index}", "sim", None, d.memory_total_bytes,
                                   d.memory_used_bytes, d.memory_total_bytes - d.memory_used_bytes, simulated=True)
                        for d in state.devices)
        procs = tuple(GpuProcess(pid=p.host_pid, gpu_uuid=f"GPU-sim-{p.device}", gpu_index=p.device,
                                 memory_bytes=p.memory_bytes) for p in state.processes if p.host_pid)
        return GpuSweep(timestamp_s=time.monotonic(), devices=devices, processes=procs)

    def close(self) -> None:
        pass


@pytest.fixture
def sim(tmp_path: Path, bcc_required: None) -> Iterator[simnode.SimNode]:
    with private_node(tmp_path, devices=1, memory_bytes=8192 * MIB) as node:
        yield node


class HybridCgroups:
    """v1 docker-shaped directories and one shared v2 directory, removed at the end."""

    def __init__(self) -> None:
        self.made: list[Path] = []
        self.shared = cgroup2_root() / f"gwtest-shared-{os.getpid()}"
        self._mkdir(self.shared)

    def v1(self, cid: str) -> list[Path]:
        dirs = [Path("/sys/fs/cgroup", ctrl, "docker", cid) for ctrl in V1_CONTROLLERS]
        for d in dirs:
            self._mkdir(d.parent)
            self._mkdir(d)
        return dirs

    def _mkdir(self, path: Path) -> None:
        if not path.exists():
            path.mkdir()
            self.made.append(path)

    def remove(self) -> None:
        remove_dirs(self.made)


def start_in(w: Workers, procs_files: list[Path], mib: int) -> int:
    argv = [str(w.node.libraries.worker_path), "--gpu", "0", "--mib-per-step", str(mib), "--steps", "2",
            "--lifetime-s", "0"]
    proc = w.start(argv=in_cgroups(procs_files, argv))
    Workers.wait_line(proc, "ready")
    return proc.pid


def test_probe_bytes_follow_the_identity_nvml_gets(sim: simnode.SimNode, tmp_path: Path) -> None:
    ids = {name: secrets.token_hex(32) for name in "ABC"}
    config = ProbeConfig(device_prefix=str(sim.dev_dir / "nvidia"), libcuda_paths=(str(sim.libraries.cuda_path),),
                         scan_all_processes=False)
    cgroups = HybridCgroups()
    try:
        with ProbeManager(config) as pm, workers(sim) as w:
            pids = {
                "A": start_in(w, [cgroup2_root() / "cgroup.procs", *(d / "cgroup.procs" for d in cgroups.v1(ids["A"]))],
                              96),
                "B": start_in(w, [cgroups.shared / "cgroup.procs", *(d / "cgroup.procs" for d in cgroups.v1(ids["B"]))],
                              64),
                "C": start_in(w, [cgroups.shared / "cgroup.procs", *(d / "cgroup.procs" for d in cgroups.v1(ids["C"]))],
                              160),
            }
            resolver = IdentityResolver()
            sampler = Sampler(lambda: LedgerBackend(sim), resolver, "hybrid", probe_source=pm)
            sampler.run_once()
            snapshot = sampler.run_once()
            ledger = simnode.status(sim)
            comparisons = compare_probe_nvml(snapshot)
            for name, cid in ids.items():
                nvml = sum(p.memory_bytes for p in ledger.processes if p.host_pid == pids[name])
                comparison = comparisons.get(cid)
                assert comparison is not None, f"{name} not compared: {sorted(comparisons)}"
                print(f"container {name}: probe {comparison.probe_bytes} B, NVML {comparison.nvml_bytes} B, "
                      f"ledger {nvml} B")
                assert comparison.nvml_bytes == nvml > 0
                assert comparison.probe_bytes == nvml  # the cross-check joined them, and they agree
                row = next(r for r in snapshot.containers if r.identity.container_id == cid)
                assert row.probe is not None and row.probe.cuda_allocated_bytes is not None
            # nothing of theirs is left on the v2 root or the shared cgroup
            for key in ("cgroup:/", f"cgroup:/{cgroups.shared.name}"):
                left = comparisons.get(key)
                assert left is None or not left.probe_bytes, f"{key} kept {left}"
            enforce_refused(snapshot, ids["B"], tmp_path)
    finally:
        cgroups.remove()


def enforce_refused(snapshot: object, cid_b: str, tmp_path: Path) -> None:
    """A kill limit on B: no kernel limit pushed, the refusal audited with its reason."""
    from gpuwatch.core.model import Snapshot

    assert isinstance(snapshot, Snapshot)
    (tmp_path / "policy.yaml").write_text(
        f"rules:\n  - name: cap-b\n    match: {{container_id: '{cid_b}'}}\n"
        "    limits: {gpu_memory: 4GiB}\n    actions: [{do: kill, at: 100%}]\n")
    limits = NullKernelLimits()
    enforcer = enforcer_for(tmp_path / "policy.yaml", tmp_path, kernel_limits=limits)
    try:
        enforcer.on_snapshot(snapshot)
    finally:
        enforcer.close()
    assert limits.limits == {}
    refusals = [e for e in read_audit(tmp_path / "audit.jsonl") if e.get("action") == "refuse-inkernel"]
    assert [e["target"]["container_id"] for e in refusals] == [cid_b]  # type: ignore[index]
    assert "is not the cgroup v2 its processes" in str(refusals[0]["reason"])
