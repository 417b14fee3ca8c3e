"""Sharing annotations without root: gpuwatch.io/sharing and gpuwatch.io/gpu-share parsed from
runtime metadata into identities (fixture bundle and cgroup trees), the exclusive gate's
decisions through the real Enforcer (which containers get which GPU denied, when the gate
lifts, protected namespaces, the host, dry run, refusals, audit records), the gpu-share
throttle, and the metrics (tenants, exclusive, namespace quotas)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpuwatch.agent.enforcer_factory import CgroupNodeContainers
from gpuwatch.containers.metadata import metadata_from_annotations, parse_docker_config_v2
from gpuwatch.core.annotations import GPU_SHARE_ANNOTATION, SHARING_ANNOTATION, label_annotations
from gpuwatch.core.model import HOST_IDENTITY, ContainerIdentity, ContainerUsage, DeviceInfo, ProbeCounters, Snapshot
from gpuwatch.enforce.audit import read_audit
from gpuwatch.enforce.enforcer import Enforcer, EnforcerConfig, EnforcerHooks
from gpuwatch.enforce.kernel_limits import NullDeviceGate
from gpuwatch.exporter.collector import SnapshotCollector
from gpuwatch.policy.sharing import (
    GATE_MAX_GPUS,
    SharingRequest,
    sharing_of,
)
from gpuwatch.probes import layout
from tests.unit.test_containers_resolver import ANN, CID, KPATH, FakeClock, Node
from tests.unit.test_enforce_devicegate import RefusingGate
from tests.unit.test_enforce_enforcer import make

GIB = 2**30
ALL = set(range(GATE_MAX_GPUS))
EXCLUSIVE = ((SHARING_ANNOTATION, "exclusive"),)
POLICY = """
rules:
  - name: watch
    match: {default: true}
    limits: {gpu_memory: 100GiB}
    actions: [{do: alert}]
"""


# ---- annotations ----------------------------------------------------------------------------


def test_valid_annotations_are_normalised() -> None:
    pairs, problems = label_annotations({SHARING_ANNOTATION: " Exclusive ", GPU_SHARE_ANNOTATION: "50%"})
    assert pairs == ((SHARING_ANNOTATION, "exclusive"), (GPU_SHARE_ANNOTATION, "0.5")) and problems == ()
    assert label_annotations({GPU_SHARE_ANNOTATION: "0.25", "other": "x"}) == (((GPU_SHARE_ANNOTATION, "0.25"),), ())
    assert label_annotations({}) == ((), ())


@pytest.mark.parametrize("mode", ["", "private", "exclusive,shared", "1"])
@pytest.mark.parametrize("share", ["", "0", "1.5", "-0.5", "half", "nan", "150%", "0.5GiB"])
def test_invalid_values_are_problems_not_values(mode: str, share: str) -> None:
    pairs, problems = label_annotations({SHARING_ANNOTATION: mode, GPU_SHARE_ANNOTATION: share})
    assert pairs == () and len(problems) == 2


def test_containerd_annotations_reach_the_metadata() -> None:
    meta = metadata_from_annotations({**ANN, SHARING_ANNOTATION: "shared", GPU_SHARE_ANNOTATION: "0.5"},
                                     "containerd", "/x/config.json")
    assert meta.pod_namespace == "ml"
    assert meta.sharing_labels == ((SHARING_ANNOTATION, "shared"), (GPU_SHARE_ANNOTATION, "0.5"))


def test_invalid_annotation_logged_once_and_absent(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpuwatch.containers.metadata")
    bad = {**ANN, SHARING_ANNOTATION: "mine-only", GPU_SHARE_ANNOTATION: "0.5"}
    for _ in range(3):
        meta = metadata_from_annotations(bad, "containerd", "/bundles/once/config.json")
        assert meta.sharing_labels == ((GPU_SHARE_ANNOTATION, "0.5"),)
        assert meta.pod_name == "resnet-0"  # the rest of the metadata is unaffected
    said = [r for r in caplog.records if "mine-only" in r.getMessage()]
    assert len(said) == 1 and "/bundles/once/config.json" in said[0].getMessage()


def test_garbage_annotation_types_never_crash() -> None:
    meta = metadata_from_annotations({SHARING_ANNOTATION: 7, GPU_SHARE_ANNOTATION: None}, "containerd", "g")
    assert meta.sharing_labels == ()


def test_crio_annotations_json_and_docker_labels() -> None:
    crio = {"io.kubernetes.cri-o.Annotations": json.dumps({SHARING_ANNOTATION: "exclusive"})}
    assert metadata_from_annotations(crio, "crio", "c").sharing_labels == EXCLUSIVE
    crio[SHARING_ANNOTATION] = "auto"  # the top-level annotation wins over the JSON copy
    assert metadata_from_annotations(crio, "crio", "c").sharing_labels == ((SHARING_ANNOTATION, "auto"),)
    doc = {"Name": "/web", "Config": {"Labels": {f"annotation.{SHARING_ANNOTATION}": "exclusive",
                                                 GPU_SHARE_ANNOTATION: "0.3"}}}
    meta = parse_docker_config_v2(json.dumps(doc), "d")
    assert meta is not None
    assert dict(meta.sharing_labels) == {SHARING_ANNOTATION: "exclusive", GPU_SHARE_ANNOTATION: "0.3"}


def test_sharing_of_reads_identity_labels() -> None:
    ident = ContainerIdentity("k8s", "/k", "id", labels=(("role", "x"), (SHARING_ANNOTATION, "shared"),
                                                         (GPU_SHARE_ANNOTATION, "0.5")))
    assert sharing_of(ident) == SharingRequest("shared", 0.5) and sharing_of(ident).throttle_share == 0.5
    assert sharing_of(ContainerIdentity("k8s", "/k", "id")) == SharingRequest()
    odd = ContainerIdentity("k8s", "/k", "id", labels=((SHARING_ANNOTATION, "exclusive"), (GPU_SHARE_ANNOTATION, "9")))
    assert sharing_of(odd) == SharingRequest("exclusive", None) and sharing_of(odd).throttle_share is None


def test_resolver_puts_annotations_into_identity_and_node_listing_finds_them(tmp_path: Path) -> None:
    """The resolver (fixture /proc, cgroup and bundle trees) and the node listing the factory
    wires both give the identity with its sharing labels and cgroup id."""
    node = Node(tmp_path)
    cgroup_id = node.cgroup(KPATH)
    node.cgroup(f"{KPATH}/sub")  # a cgroup the container made: covered by the container's gate
    node.cgroup("/system.slice/cron.service")
    node.bundle(CID, {**ANN, SHARING_ANNOTATION: "exclusive"})
    node.process(100, KPATH)
    found = node.resolver(FakeClock()).resolve_pid(100)
    assert found is not None and sharing_of(found.identity).mode == "exclusive"
    listing = CgroupNodeContainers(bundle_roots=node.roots, cgroup_root=str(node.unified), proc_root=str(node.proc))
    (only,) = listing.containers()
    assert only.cgroup_path == KPATH and only.cgroup_id == cgroup_id and only.pod_namespace == "ml"
    assert sharing_of(only).mode == "exclusive"
    narrowed = CgroupNodeContainers(bundle_roots=node.roots, cgroup_root=str(node.unified),
                                    proc_root=str(node.proc), subtrees=("/system.slice", "/absent"))
    assert narrowed.containers() == []


def test_gate_limit_matches_the_kernel_layout() -> None:
    assert layout.GW_GATE_MAX_GPUS == GATE_MAX_GPUS


# ---- the exclusive gate through the enforcer ------------------------------------------------


def who(name: str, cgroup_id: int | None, namespace: str = "ml", labels: tuple[tuple[str, str], ...] = ()
        ) -> ContainerIdentity:
    return ContainerIdentity("k8s", f"/kubepods/{name}", f"id-{name}", name, f"pod-{name}", namespace,
                             cgroup_id=cgroup_id, labels=labels)


def snap(*rows: tuple[ContainerIdentity, int, int], t: float | None = None, **extra: object) -> Snapshot:
    """rows: (identity, gpu index, memory bytes) on a two-GPU node."""
    devices = tuple(DeviceInfo(i, f"GPU-{i}", "sim", None, 16 * GIB, None, None) for i in (0, 1))
    usage = tuple(ContainerUsage(ident, g, f"GPU-{g}", mem, 0.0, 0.0) for ident, g, mem in rows)
    return Snapshot(timestamp_s=time.time() if t is None else t, node="n", devices=devices, containers=usage,
                    **extra)  # type: ignore[arg-type]


class Listing:
    """The node's containers (NodeContainers protocol): what the test says is running."""

    def __init__(self, *containers: ContainerIdentity) -> None:
        self.now = list(containers)
        self.calls = 0

    def containers(self) -> Sequence[ContainerIdentity]:
        self.calls += 1
        return list(self.now)


def denied(gate: RefusingGate | NullDeviceGate, cgroup_id: int) -> set[int]:
    """GPUs the gate keeps this cgroup off (nothing when it is not gated)."""
    return ALL - set(gate.allowed[cgroup_id]) if cgroup_id in gate.allowed else set()


def sharing_records(tmp_path: Path) -> list[dict[str, object]]:
    return [r for r in read_audit(tmp_path / "audit.jsonl") if r["rule"] == "sharing"]


HOLDER = who("holder", 10, labels=EXCLUSIVE)
TENANT = who("tenant", 11)  # on GPU 1
IDLE = who("idle", 12)  # on the node, no GPU yet: only the node listing knows it
SYSTEM = who("dns", 13, namespace="kube-system")


def test_exclusive_holder_keeps_every_other_container_off_its_gpu(tmp_path: Path) -> None:
    gate = RefusingGate(refusals=0)
    listing = Listing(HOLDER, TENANT, IDLE, SYSTEM)
    enforcer = make(tmp_path, POLICY, device_gate=gate, node_containers=listing)
    registry = CollectorRegistry()
    registry.register(enforcer.metrics)
    t = time.time()
    host = (HOST_IDENTITY, 0, GIB)
    enforcer.on_snapshot(snap((TENANT, 1, GIB), host, t=t - 2))
    assert gate.allowed == {} and listing.calls == 0, "nobody exclusive: no gate, no node walk"

    enforcer.on_snapshot(snap((HOLDER, 0, GIB), (TENANT, 1, GIB), host, t=t - 1))
    assert denied(gate, 11) == {0} and denied(gate, 12) == {0}
    assert 10 not in gate.allowed, "the exclusive container itself is untouched"
    assert 13 not in gate.allowed, "a protected namespace is never gated unless a rule names it"
    records = sharing_records(tmp_path)
    deny = {r["target"]["container"]: r for r in records if r["action"] == "deny-device"}  # type: ignore[index]
    assert deny["tenant"]["result"] == "ok" and deny["idle"]["result"] == "ok"
    assert "held exclusively by ml/pod-holder/holder" in str(deny["tenant"]["reason"])
    assert deny["dns"]["result"] == "suppressed" and "protected" in str(deny["dns"]["suppressed"])
    assert set(deny) == {"tenant", "idle", "dns"}, "the host bucket is not a target"
    labels = {"node": "n", "gpu": "0", "uuid": "GPU-0", "model": "sim"}
    assert registry.get_sample_value("gpuwatch_enforce_exclusive_gated_containers", labels) == 2
    assert registry.get_sample_value("gpuwatch_enforce_actions_total",
                                     {"action": "deny-device", "result": "ok"}) == 2

    enforcer.on_snapshot(snap((HOLDER, 0, GIB), (TENANT, 1, GIB), t=t - 0.5))  # unchanged: no new records
    assert len(sharing_records(tmp_path)) == len(records)

    enforcer.on_snapshot(snap((TENANT, 1, GIB), t=t))  # the holder is gone: the gate lifts
    assert gate.allowed == {}
    lifted = [r for r in sharing_records(tmp_path) if r["action"] == "allow-device"]
    assert sorted(r["target"]["container"] for r in lifted) == ["idle", "tenant"]  # type: ignore[index]
    assert all(r["result"] == "ok" and "no longer held" in str(r["reason"]) for r in lifted)
    assert registry.get_sample_value("gpuwatch_enforce_exclusive_gated_containers", labels) is None
    enforcer.close()


def test_exclusive_on_a_gpu_the_rule_allows_narrows_the_rule_gate(tmp_path: Path) -> None:
    text = POLICY.replace("{gpu_memory: 100GiB}", "{gpu_memory: 100GiB, devices: [0, 1]}")
    gate = RefusingGate(refusals=0)
    enforcer = make(tmp_path, text, device_gate=gate, node_containers=Listing())
    t = time.time()
    enforcer.on_snapshot(snap((TENANT, 1, GIB), t=t - 1))
    assert gate.allowed == {11: (0, 1)}
    enforcer.on_snapshot(snap((HOLDER, 0, GIB), (TENANT, 1, GIB), t=t - 0.5))
    assert gate.allowed[11] == (1,) and gate.allowed[10] == (0, 1), "the holder keeps its own rule gate"
    enforcer.on_snapshot(snap((TENANT, 1, GIB), t=t))
    assert gate.allowed == {11: (0, 1)}
    enforcer.close()


def test_a_rule_naming_a_protected_namespace_lets_the_gate_act_on_it(tmp_path: Path) -> None:
    text = POLICY.replace("rules:\n", "rules:\n  - name: system\n    match: {namespace: kube-system}\n"
                                      "    limits: {gpu_memory: 1GiB}\n    actions: [{do: alert}]\n")
    gate = RefusingGate(refusals=0)
    enforcer = make(tmp_path, text, device_gate=gate, node_containers=Listing(SYSTEM))
    enforcer.on_snapshot(snap((HOLDER, 0, GIB)))
    assert denied(gate, 13) == {0}
    enforcer.close()


def test_two_holders_of_one_gpu_leave_each_other_alone_and_block_the_rest(tmp_path: Path) -> None:
    other = who("other", 14, labels=EXCLUSIVE)
    gate = RefusingGate(refusals=0)
    enforcer = make(tmp_path, POLICY, device_gate=gate, node_containers=Listing(IDLE))
    enforcer.on_snapshot(snap((HOLDER, 0, GIB), (other, 0, GIB), (other, 1, GIB)))
    assert denied(gate, 10) == {1}, "GPU 1 is held by `other` alone"
    assert 14 not in gate.allowed
    assert denied(gate, 12) == {0, 1}
    enforcer.close()


def test_probe_allocations_count_as_holding_a_gpu(tmp_path: Path) -> None:
    gate = RefusingGate(refusals=0)
    enforcer = make(tmp_path, POLICY, device_gate=gate, node_containers=Listing(IDLE))
    counters = (ProbeCounters(cgroup_id=10, allocated_bytes_by_gpu=((1, GIB),)),)
    enforcer.on_snapshot(snap(probe_counters=counters, probe_identities=((10, HOLDER),)))
    assert denied(gate, 12) == {1}
    enforcer.close()


def test_dry_run_audits_once_and_acts_on_nothing(tmp_path: Path) -> None:
    gate = NullDeviceGate()
    enforcer = make(tmp_path, POLICY, device_gate=gate, dry_run=True, node_containers=Listing(IDLE))
    t = time.time()
    enforcer.on_snapshot(snap((HOLDER, 0, GIB), t=t - 1))
    enforcer.on_snapshot(snap((HOLDER, 0, GIB), t=t - 0.5))
    assert gate.allowed == {}
    (record,) = sharing_records(tmp_path)
    assert (record["action"], record["result"], record["dry_run"]) == ("deny-device", "dry_run", True)
    enforcer.on_snapshot(snap(t=t))
    assert [r["action"] for r in sharing_records(tmp_path)] == ["deny-device", "allow-device"]
    assert sharing_records(tmp_path)[-1]["result"] == "dry_run"
    enforcer.close()


def test_without_a_kernel_gate_nothing_is_audited_and_the_log_says_so_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpuwatch.enforce.sharing_hooks")
    enforcer = make(tmp_path, POLICY, device_gate=NullDeviceGate(), node_containers=Listing(IDLE))
    t = time.time()
    enforcer.on_snapshot(snap((HOLDER, 0, GIB), t=t - 1))
    enforcer.on_snapshot(snap((HOLDER, 0, GIB), t=t))
    assert sharing_records(tmp_path) == []
    said = [r.getMessage() for r in caplog.records if "not enforced" in r.getMessage()]
    assert len(said) == 1 and "GPU 0" in said[0] and "holder" in said[0]
    enforcer.close()


def test_without_a_node_listing_snapshot_containers_are_still_gated(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpuwatch.enforce.sharing_hooks")
    gate = RefusingGate(refusals=0)
    enforcer = make(tmp_path, POLICY, device_gate=gate)
    enforcer.on_snapshot(snap((HOLDER, 0, GIB), (TENANT, 1, GIB)))
    assert denied(gate, 11) == {0} and set(gate.allowed) == {11}
    assert any("only containers seen using a GPU" in r.getMessage() for r in caplog.records)
    enforcer.close()


def test_refused_gate_is_audited_once_and_retried(tmp_path: Path) -> None:
    gate = RefusingGate(refusals=2)
    enforcer = make(tmp_path, POLICY, device_gate=gate, node_containers=Listing(IDLE))
    t = time.time()
    enforcer.on_snapshot(snap((HOLDER, 0, GIB), t=t - 1))
    enforcer.on_snapshot(snap((HOLDER, 0, GIB), t=t - 0.5))
    assert gate.allowed == {}
    (failed,) = sharing_records(tmp_path)
    assert failed["result"] == "failed" and failed["action"] == "deny-device"
    enforcer.on_snapshot(snap((HOLDER, 0, GIB), t=t))
    assert denied(gate, 12) == {0}
    assert [r["result"] for r in sharing_records(tmp_path)] == ["failed", "ok"]
    enforcer.close()


def test_agent_and_host_root_are_never_gated(tmp_path: Path) -> None:
    agent = who("agent", 15)
    gate = RefusingGate(refusals=0)
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    from gpuwatch.enforce.audit import AuditLog
    from gpuwatch.enforce.cgroup_ops import CgroupTree

    enforcer = Enforcer(policy, EnforcerConfig(frozen_state_path=tmp_path / "frozen.json",
                                               own_cgroups=frozenset({"/kubepods/agent"})),
                        audit=AuditLog(tmp_path / "audit.jsonl"),
                        hooks=EnforcerHooks(cgroups=CgroupTree(v2_root=tmp_path / "cg", autodetect=False),
                                            device_gate=gate, node_containers=Listing(agent, IDLE)))
    enforcer.on_snapshot(snap((HOLDER, 0, GIB)))
    assert set(gate.allowed) == {12}
    enforcer.close()


# ---- shared + gpu-share: the throttle -------------------------------------------------------


def cgroup_dir(tmp_path: Path, name: str) -> Path:
    d = tmp_path / "cg" / "kubepods" / name
    d.mkdir(parents=True)
    (d / "cgroup.freeze").write_text("0")
    (d / "cgroup.procs").write_text("")
    return d


SHARED = who("shared", 20, labels=((SHARING_ANNOTATION, "shared"), (GPU_SHARE_ANNOTATION, "0.5")))


def test_shared_container_gets_the_throttle_at_its_share_and_loses_it_when_gone(tmp_path: Path) -> None:
    cgroup_dir(tmp_path, "shared")
    now = [1000.0]
    enforcer = make(tmp_path, POLICY, clock=lambda: now[0])

    def at(t: float, *rows: tuple[ContainerIdentity, int, int]) -> None:
        now[0] = t
        enforcer.on_snapshot(snap(*rows, t=t))

    at(1000.0, (SHARED, 0, GIB))
    throttles = enforcer.actions.control.throttled()
    assert throttles["/kubepods/shared"].target_share == 0.5
    at(1001.0, (SHARED, 0, GIB))  # running: not started again
    (record,) = sharing_records(tmp_path)
    assert (record["action"], record["result"], record["measured"]) == ("throttle", "ok", {"gpu_share": 0.5})
    at(1002.0)  # left the snapshot: kept over a short gap
    assert "/kubepods/shared" in enforcer.actions.control.throttled()
    at(1004.5)  # gone for 3 intervals: released
    assert enforcer.actions.control.throttled() == {}
    assert [r["action"] for r in sharing_records(tmp_path)] == ["throttle", "release"]
    enforcer.close()


def test_a_rule_with_a_throttle_step_wins_over_the_annotation(tmp_path: Path) -> None:
    cgroup_dir(tmp_path, "shared")
    text = POLICY.replace("{gpu_memory: 100GiB}", "{gpu_time_share: 90%}").replace(
        "[{do: alert}]", "[{do: throttle, at: 100%, share: 80%}]")
    enforcer = make(tmp_path, text)
    enforcer.on_snapshot(snap((SHARED, 0, GIB)))
    assert enforcer.actions.control.throttled() == {} and sharing_records(tmp_path) == []
    enforcer.close()


def test_shared_throttle_in_dry_run_and_in_protected_namespace(tmp_path: Path) -> None:
    enforcer = make(tmp_path, POLICY, dry_run=True)
    protected = who("p", 21, namespace="kube-system", labels=SHARED.labels)
    t = time.time()
    enforcer.on_snapshot(snap((SHARED, 0, GIB), (protected, 1, GIB), t=t - 1))
    enforcer.on_snapshot(snap((SHARED, 0, GIB), (protected, 1, GIB), t=t))
    assert enforcer.actions.control.throttled() == {}
    got = {(r["target"]["container"], r["result"]) for r in sharing_records(tmp_path)}  # type: ignore[index]
    assert got == {("shared", "dry_run"), ("p", "suppressed")}
    enforcer.close()


# ---- metrics --------------------------------------------------------------------------------


def test_exporter_tenants_and_exclusive_without_a_policy() -> None:
    snapshot = snap((HOLDER, 0, GIB), (TENANT, 1, GIB), (IDLE, 1, 0), (HOST_IDENTITY, 1, GIB))
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: snapshot, clock=lambda: snapshot.timestamp_s))

    def gpu(i: int) -> dict[str, str]:
        return {"node": "n", "gpu": str(i), "uuid": f"GPU-{i}", "model": "sim"}

    assert registry.get_sample_value("gpuwatch_gpu_tenants", gpu(0)) == 1
    # TENANT and the host process (a tenant all the same: issue 19); IDLE holds nothing
    assert registry.get_sample_value("gpuwatch_gpu_tenants", gpu(1)) == 2, "no memory, no process: not a tenant"
    assert registry.get_sample_value("gpuwatch_gpu_exclusive", gpu(0)) == 1
    assert registry.get_sample_value("gpuwatch_gpu_exclusive", gpu(1)) == 0


def test_namespace_quota_metric_literal_and_glob(tmp_path: Path) -> None:
    text = POLICY + """
namespace_quotas:
  - namespace: team-*
    limits: {gpu_memory: 16GiB}
  - namespace: team-b
    limits: {gpu_memory: 8GiB}
  - namespace: research
    limits: {gpu_memory: 4GiB}
  - namespace: shares-only
    limits: {gpu_time_share: 1.5}
"""
    on_node = who("b", 30, namespace="team-b")
    idle = who("c", 31, namespace="team-c")
    enforcer = make(tmp_path, text, node_containers=Listing(on_node, idle))
    registry = CollectorRegistry()
    registry.register(enforcer.metrics)
    enforcer.on_snapshot(snap((who("a", 32, namespace="team-a"), 0, GIB), (who("x", 33, namespace="ml"), 0, GIB)))

    def quota(namespace: str) -> float | None:
        return registry.get_sample_value("gpuwatch_namespace_gpu_memory_quota_bytes",
                                         {"node": "n", "namespace": namespace})

    assert quota("team-a") == 16 * GIB  # glob, in the snapshot
    assert quota("team-c") == 16 * GIB  # glob, on the node without a GPU
    assert quota("team-b") == 8 * GIB  # two quotas apply: the smaller binds
    assert quota("research") == 4 * GIB  # literal: always
    assert quota("ml") is None and quota("shares-only") is None
    enforcer.close()
