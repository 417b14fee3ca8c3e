"""Enforcer without root: policy reload (a bad file never replaces the running policy),
audit records, metrics, dry run, limit-map pushes, probe-event conversion and crash
recovery bookkeeping on a fake cgroup tree."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpuwatch.core.errors import PolicyError
from gpuwatch.core.model import ContainerIdentity, ContainerUsage, DeviceInfo, Snapshot
from gpuwatch.enforce.audit import read_audit
from gpuwatch.enforce.cgroup_ops import CgroupTree
from gpuwatch.enforce.enforcer import Enforcer
from gpuwatch.enforce.freeze.frozen_state import FrozenRegistry
from gpuwatch.enforce.kernel_limits import NullKernelLimits
from gpuwatch.enforce.probe_events import convert_events
from gpuwatch.policy.events import ProbeEventKind
from gpuwatch.probes.kernel_events import KernelEvent
from tests.enforcer_setup import enforcer_on_fake_tree

GIB = 2**30
CASES = Path(__file__).parent / "policy_cases"
ALERT_POLICY = """
rules:
  - name: alert-only
    match: {namespace: ml}
    limits: {gpu_memory: 1GiB, gpu_time_share: 50%}
    actions: [{do: alert, at: 100%}]
"""


def who(name: str = "a", cgroup_id: int | None = 42) -> ContainerIdentity:
    return ContainerIdentity(
        runtime="k8s",
        cgroup_path=f"/kubepods/{name}",
        container_id=f"id-{name}",
        container_name=name,
        pod_name="p",
        pod_namespace="ml",
        cgroup_id=cgroup_id,
    )


def snap(*rows: tuple[ContainerIdentity, int], t: float | None = None) -> Snapshot:
    device = DeviceInfo(0, "GPU-0", "sim", None, 16 * GIB, None, None)
    usage = tuple(ContainerUsage(i, 0, "GPU-0", m, 0.0, 0.0) for i, m in rows)
    return Snapshot(timestamp_s=time.time() if t is None else t, node="n", devices=(device,), containers=usage)


def make(tmp_path: Path, text: str = ALERT_POLICY, **kwargs: object) -> Enforcer:
    return enforcer_on_fake_tree(tmp_path, text, **kwargs)


def bump_mtime(path: Path) -> None:
    st = path.stat()
    os.utime(path, (st.st_atime + 5, st.st_mtime + 5))


def test_invalid_initial_policy_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(PolicyError):
        make(tmp_path, (CASES / "bad_11_unknown_action.yaml").read_text())


@pytest.mark.parametrize("bad", sorted(CASES.glob("bad_*.yaml")), ids=lambda p: p.stem)
def test_bad_file_never_replaces_running_policy(tmp_path: Path, bad: Path) -> None:
    enforcer = make(tmp_path)
    running = enforcer.policy
    (tmp_path / "policy.yaml").write_text(bad.read_text())
    assert enforcer.reload() is False
    assert enforcer.policy is running
    assert "problem(s)" in enforcer.last_reload_error
    assert enforcer.metrics.reloads["failure"] == 1
    enforcer.close()


def test_mtime_change_reloads_on_next_snapshot_and_sighup_flag(tmp_path: Path) -> None:
    enforcer = make(tmp_path)
    path = tmp_path / "policy.yaml"
    path.write_text(ALERT_POLICY.replace("alert-only", "renamed"))
    bump_mtime(path)
    enforcer.on_snapshot(snap())
    assert enforcer.policy.rules[0].name == "renamed"
    assert enforcer.check_reload() is None  # unchanged file: nothing to do
    enforcer.reload_requested = True
    assert enforcer.check_reload() is True
    # A broken edit is tried once, not on every snapshot.
    path.write_text("rules: [")
    bump_mtime(path)
    enforcer.on_snapshot(snap())
    enforcer.on_snapshot(snap())
    assert enforcer.metrics.reloads["failure"] == 1 and enforcer.policy.rules[0].name == "renamed"
    enforcer.close()


def test_audit_record_fields_and_metrics(tmp_path: Path) -> None:
    enforcer = make(tmp_path)
    registry = CollectorRegistry()
    registry.register(enforcer.metrics_collector())
    decisions = enforcer.on_snapshot(snap((who(), 2 * GIB)))
    assert [d.verb.value for d in decisions] == ["alert"]
    (record,) = read_audit(tmp_path / "audit.jsonl")
    assert set(record) >= {"time", "target", "rule", "reason", "measured", "action", "result", "dry_run"}
    assert record["rule"] == "alert-only" and record["result"] == "ok" and record["dry_run"] is False
    assert record["target"]["container"] == "a"  # type: ignore[index]
    assert record["measured"]["gpu_memory_ratio"] == 2.0  # type: ignore[index]
    assert registry.get_sample_value("gpuwatch_enforce_actions_total", {"action": "alert", "result": "ok"}) == 1
    assert registry.get_sample_value("gpuwatch_policy_reloads_total", {"result": "success"}) == 1
    labels = {
        "namespace": "ml",
        "pod": "p",
        "container": "a",
        "container_id": "id-a",
        "cgroup": "/kubepods/a",
        "rule": "alert-only",
    }
    assert registry.get_sample_value("gpuwatch_enforce_limit_bytes", labels) == GIB
    assert registry.get_sample_value("gpuwatch_enforce_limit_gpu_time_share", labels) == 0.5
    enforcer.close()


def test_dry_run_audits_but_does_not_act(tmp_path: Path) -> None:
    text = ALERT_POLICY.replace("do: alert", "do: kill")
    limits = NullKernelLimits()
    enforcer = make(tmp_path, text, dry_run=True, kernel_limits=limits)
    enforcer.on_snapshot(snap((who(), 2 * GIB)))
    (record,) = read_audit(tmp_path / "audit.jsonl")
    assert record["action"] == "kill" and record["result"] == "dry_run" and record["dry_run"] is True
    assert limits.limits == {}  # dry run does not touch the kernel limit map either
    enforcer.close()


def test_stale_snapshot_not_acted_on_and_counted(tmp_path: Path) -> None:
    enforcer = make(tmp_path)
    assert enforcer.on_snapshot(snap((who(), 2 * GIB), t=time.time() - 10)) == []
    assert enforcer.metrics.stale_snapshots == 1
    assert not (tmp_path / "audit.jsonl").read_text()
    enforcer.close()


def test_kernel_limits_get_limits_and_clear_vanished(tmp_path: Path) -> None:
    limits = NullKernelLimits()
    enforcer = make(tmp_path, kernel_limits=limits)
    t = time.time()
    enforcer.on_snapshot(snap((who("a", 7), GIB // 2), (who("b", None), GIB // 2), t=t - 0.5))
    assert limits.limits == {7: GIB}  # no cgroup id, no kernel limit
    enforcer.on_snapshot(snap(t=t))
    assert limits.limits == {}
    enforcer.close()


def test_kernel_limit_action_overrides_the_rules_action(tmp_path: Path) -> None:
    """EnforcerConfig.kernel_limit_action is the action of every pushed limit (the alert-only
    rule alone would push "event")."""
    for override, expected in ((None, "event"), ("kill", "kill")):
        limits = NullKernelLimits()
        enforcer = make(tmp_path, kernel_limits=limits, kernel_limit_action=override)
        enforcer.on_snapshot(snap((who("a", 7), GIB // 2)))
        assert limits.limits == {7: GIB} and limits.actions == {7: expected}
        enforcer.close()
    with pytest.raises(ValueError, match="not one of"):
        NullKernelLimits().set_limit(7, GIB, "freeze")


def test_convert_probe_layer_events() -> None:
    def kernel_event(type_: str, ts_ns: int, size: int, device: int | None) -> KernelEvent:
        return KernelEvent(type=type_, ts_ns=ts_ns, cgroup_id=9, tgid=77, tid=77, comm="python", size_bytes=size,
                           value=0, device=device, source="ioctl", kind="gpu")

    raw = [kernel_event("oom", 10 * 10**9, GIB, 0), kernel_event("over_limit", 11 * 10**9, 5, None),
           kernel_event("new_gpu_process", 1, 0, 0)]
    events = convert_events(raw, wall=lambda: 1000.0, monotonic=lambda: 20.0)
    assert [e.kind for e in events] == [ProbeEventKind.OOM, ProbeEventKind.OVER_LIMIT]
    assert events[0].timestamp_s == 990.0 and events[0].requested_bytes == GIB and events[0].cgroup_id == 9
    assert events[1].gpu_index == -1 and events[0].pid == 77


def test_recover_thaws_what_the_state_file_lists(tmp_path: Path) -> None:
    cg = tmp_path / "cg" / "kubepods" / "a"
    cg.mkdir(parents=True)
    (cg / "cgroup.freeze").write_text("1")
    (cg / "cgroup.procs").write_text("")
    (tmp_path / "frozen.json").write_text(
        json.dumps(
            {
                "frozen": [
                    {"cgroup_path": "/kubepods/a", "mechanism": "v2", "reason": "crash", "since_s": 1.0},
                    {"cgroup_path": "/kubepods/gone", "mechanism": "v2", "reason": "crash", "since_s": 1.0},
                ]
            }
        )
    )
    registry = FrozenRegistry(CgroupTree(v2_root=tmp_path / "cg", autodetect=False), tmp_path / "frozen.json")
    assert registry.recover() == ["/kubepods/a", "/kubepods/gone"]
    assert (cg / "cgroup.freeze").read_text() == "0"
    assert json.loads((tmp_path / "frozen.json").read_text())["frozen"] == []


def test_root_cgroup_path_is_refused(tmp_path: Path) -> None:
    from gpuwatch.core.errors import EnforcementError

    tree = CgroupTree(v2_root=tmp_path, autodetect=False)
    for bad in ("/", "", "/a/../.."):
        with pytest.raises(EnforcementError):
            tree.handle(bad)


def test_audit_is_append_only_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text('{"previous": true}\n')
    enforcer = make(tmp_path)
    enforcer.on_snapshot(snap((who(), 2 * GIB)))
    enforcer.close()
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"previous": True} and json.loads(lines[1])["action"] == "alert"


def test_device_gate_gets_allowed_gpus_and_clears_vanished(tmp_path: Path) -> None:
    from gpuwatch.enforce.kernel_limits import NullDeviceGate

    gate = NullDeviceGate()
    text = ALERT_POLICY.replace("{gpu_memory: 1GiB, gpu_time_share: 50%}", "{devices: [0, 2]}")
    enforcer = make(tmp_path, text, device_gate=gate)
    t = time.time()
    enforcer.on_snapshot(snap((who("a", 7), GIB), t=t - 0.5))
    assert gate.allowed == {7: (0, 2)}
    enforcer.on_snapshot(snap(t=t))
    assert gate.allowed == {}
    enforcer.close()


def test_kernel_action_follows_the_rule_ladder(tmp_path: Path) -> None:
    from gpuwatch.enforce.kernel_limits import kernel_action
    from gpuwatch.policy.loader import check_policy_text

    def rule_with(actions: str) -> object:
        text = (
            "rules:\n  - name: r\n    match: {default: true}\n"
            f"    limits: {{gpu_memory: 1GiB, gpu_time_share: 50%}}\n    actions: {actions}\n"
        )
        loaded, issues = check_policy_text(text)
        assert loaded is not None, issues
        return loaded.rules[0]

    assert kernel_action(rule_with("[{do: alert, at: 90%}, {do: kill, at: 100%}]")) == "kill"  # type: ignore[arg-type]
    assert kernel_action(rule_with("[{do: checkpoint-then-kill}]")) == "stop"  # type: ignore[arg-type]
    assert kernel_action(rule_with("[{do: kill, for: 10s}]")) == "event"  # type: ignore[arg-type]
    assert kernel_action(rule_with("[{do: kill, on: gpu_time_share}]")) == "event"  # type: ignore[arg-type]
    assert kernel_action(None) == "event" and kernel_action(None, fair_share=True) == "stop"
    limits = NullKernelLimits()
    enforcer = make(tmp_path, ALERT_POLICY.replace("do: alert", "do: kill"), kernel_limits=limits)
    enforcer.on_snapshot(snap((who("a", 7), GIB // 2)))
    assert limits.actions == {7: "kill"}
    enforcer.close()
