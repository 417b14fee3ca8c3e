"""`gpuwatch.io/sharing: exclusive` end to end (root + BCC + runc): real runc containers, their
identities read by the real resolver from the bundles' config.json annotations, the node's
containers listed from the real cgroup tree, the real cgroup device program, real opens.

Device nodes are mknod'd with NVIDIA's numbering as in test_devicegate.py (an allowed open
fails with ENXIO in the absent driver, a denied one with EPERM before it). The snapshots are
built by hand (the simulated node's nodes all carry /dev/null's numbers, which the gate
cannot tell apart): the exclusive container holds memory on GPU 0. The node listing is
narrowed to this test's pods, so containers of tests running beside it are never gated.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpuwatch.agent.enforcer_factory import CgroupNodeContainers, build_enforcer
from gpuwatch.containers.metadata import BundleRoots
from gpuwatch.containers.resolver import IdentityResolver
from gpuwatch.core.annotations import SHARING_ANNOTATION
from gpuwatch.core.model import ContainerIdentity, ContainerUsage, DeviceInfo, Snapshot
from gpuwatch.enforce.audit import read_audit
from gpuwatch.enforce.enforcer import EnforcerConfig
from gpuwatch.exporter.collector import SnapshotCollector
from gpuwatch.policy.sharing import sharing_of
from gpuwatch.probes.devicegate import BpfDeviceGate
from gpuwatch.sim.runc import ContainerSpec, RunningContainer
from tests.conftest import need_binary
from tests.system.test_devicegate import ALLOWED, DENIED, Env, Prober, attached, env, gate_lab  # noqa: F401

pytestmark = [pytest.mark.root]
GIB = 2**30
POLICY = """
rules:
  - name: watch
    match: {namespace: ml}
    limits: {gpu_memory: 64GiB}
    actions: [{do: alert}]
"""
GPU_RULES = [{"allow": True, "type": "c", "major": 195, "access": "rwm"}]  # what the NVIDIA toolkit adds


def snapshot(*holders: ContainerIdentity) -> Snapshot:
    devices = tuple(DeviceInfo(i, f"GPU-{i}", "lab", None, 16 * GIB, None, None) for i in (0, 1))
    rows = tuple(ContainerUsage(h, 0, "GPU-0", GIB, 0.0, 0.0) for h in holders)
    return Snapshot(timestamp_s=time.time(), node="lab", devices=devices, containers=rows)


def gpu_samples(snap: Snapshot) -> dict[str, float | None]:
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: snap, clock=lambda: snap.timestamp_s))
    labels = {"node": "lab", "gpu": "0", "uuid": "GPU-0", "model": "lab"}
    names = ("gpuwatch_gpu_tenants", "gpuwatch_gpu_exclusive")
    return {name: registry.get_sample_value(name, labels) for name in names}


def pod_dir(container: RunningContainer) -> str:
    return container.cgroup_path.rsplit("/", 1)[0]


def test_exclusive_container_keeps_other_containers_off_its_gpu(env: Env, tmp_path: Path) -> None:  # noqa: F811
    need_binary("runc", "runc")
    with gate_lab(env, tmp_path, POLICY) as (policy, probes, lab):
        roots = BundleRoots(containerd_tasks=(str(lab.bundle_root),), crio_containers=(),
                            runc_state=(str(lab.runc_root),), docker_containers=())
        enforcer = None
        try:
            holder_probe = Prober(tmp_path / "ctl-holder", env.paths)
            other_probe = Prober(tmp_path / "ctl-other", env.paths)
            holder = lab.run(ContainerSpec(name="trainer", namespace="ml", argv=holder_probe.argv,
                                           annotations={SHARING_ANNOTATION: "exclusive"}, device_rules=GPU_RULES,
                                           extra_binds=[str(env.devdir), str(holder_probe.ctl)]))
            other = lab.run(ContainerSpec(name="web", namespace="ml", argv=other_probe.argv, device_rules=GPU_RULES,
                                          extra_binds=[str(env.devdir), str(other_probe.ctl)]))
            # the identity the sampler would attach to the holder's GPU memory: from its pid
            found = IdentityResolver(bundle_roots=roots).resolve_pid(holder.host_pid)
            assert found is not None
            who = found.identity
            assert sharing_of(who).mode == "exclusive" and who.cgroup_id == holder.v2_dir.stat().st_ino

            listing = CgroupNodeContainers(bundle_roots=roots, subtrees=(pod_dir(holder), pod_dir(other)))
            assert {c.container_id for c in listing.containers()} == {holder.id, other.id}
            settings = EnforcerConfig(frozen_state_path=tmp_path / "frozen.json")
            enforcer = build_enforcer(policy, tmp_path / "audit.jsonl", settings, probes=probes,
                                      node_containers=listing)
            gate = enforcer.device_gate
            assert isinstance(gate, BpfDeviceGate)
            everything = {"nvidia0": ALLOWED, "nvidia1": ALLOWED, "nvidiactl": ALLOWED}
            assert other_probe.probe() == everything

            held = snapshot(who)
            enforcer.on_snapshot(held)
            assert attached(other.v2_dir) == (gate.prog_id(),)
            assert other_probe.probe() == {"nvidia0": DENIED, "nvidia1": ALLOWED, "nvidiactl": ALLOWED}
            assert attached(holder.v2_dir) == (), "the exclusive container itself is untouched"
            assert holder_probe.probe() == everything
            assert gpu_samples(held) == {"gpuwatch_gpu_tenants": 1.0, "gpuwatch_gpu_exclusive": 1.0}

            holder_probe.stop()
            holder.stop()  # the exclusive container is gone: the next snapshot no longer has it
            free = snapshot()
            enforcer.on_snapshot(free)
            assert attached(other.v2_dir) == ()
            assert other_probe.probe() == everything
            assert gpu_samples(free) == {"gpuwatch_gpu_tenants": 0.0, "gpuwatch_gpu_exclusive": 0.0}

            records = [r for r in read_audit(tmp_path / "audit.jsonl") if r["rule"] == "sharing"]
            assert [(r["action"], r["result"], r["target"]["container"]) for r in records] == [  # type: ignore[index]
                ("deny-device", "ok", "web"), ("allow-device", "ok", "web")]
            other_probe.stop()
        finally:
            if enforcer is not None:
                enforcer.close()
