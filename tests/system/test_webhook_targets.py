"""Webhook targets match exactly; repeated identical alert actions are folded (issue 20, item 4).

A pause alert with `container_id: "9"` froze a bystander whose id began with 9; the
`containerd://<id>` form kube-state-metrics exports matched nothing, so real alerts were
silently ignored; 100 valid alerts x 5/s wrote 8,200 fsynced audit records in 20 s.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from gpuwatch.core.model import ContainerIdentity, ContainerUsage, DeviceInfo, Snapshot
from gpuwatch.enforce.audit import read_audit
from gpuwatch.enforce.cgroup_ops import CgroupTree
from gpuwatch.enforce.enforcer import Enforcer
from gpuwatch.enforce.webhook.receiver import WebhookRequest, WebhookServer, parse_alertmanager_payload
from gpuwatch.enforce.webhook.requests import RepeatGate, find_target, normalize_container_id
from tests.enforcer_setup import enforcer_for

POLICY = "rules:\n  - name: all\n    match: {default: true}\n"
TOKEN = "webhook-test-token-0123456789"
ID_A = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
ID_B = "9f86d0818f4c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a09"  # shares 8 hex chars with A
ID_C = "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752"


def ident(name: str, cid: str, uid: str) -> ContainerIdentity:
    return ContainerIdentity(runtime="containerd", cgroup_path=f"/kubepods/pod{uid}/{cid}", container_id=cid,
                             container_name="main", pod_name=f"{name}-pod", pod_namespace="ml", pod_uid=uid)


IDENTITIES = [ident("a", ID_A, "uid-a"), ident("b", ID_B, "uid-b"), ident("c", ID_C, "uid-c")]


def names(target: dict[str, str]) -> list[str]:
    return [i.pod_name for i in find_target(IDENTITIES, target)]


def test_container_id_prefixes_shorter_than_12_match_nothing() -> None:
    assert names({"container_id": "9"}) == []
    assert names({"container_id": "6"}) == []
    assert names({"container_id": ID_C[:11]}) == []
    assert names({"container_id": ID_C[:12]}) == ["c-pod"]


def test_ambiguous_prefixes_match_both_and_full_ids_one() -> None:
    assert names({"container_id": ID_A[:8] + "0"}) == []  # 9 chars: too short
    assert names({"container_id": ID_A}) == ["a-pod"]
    assert names({"container_id": ID_A[:12]}) == ["a-pod"]


def test_runtime_scheme_is_stripped() -> None:
    for scheme in ("containerd://", "docker://", "cri-o://"):
        assert names({"container_id": scheme + ID_C}) == ["c-pod"]
    assert normalize_container_id("containerd://" + ID_C.upper()) == ID_C


def test_pod_by_namespace_name_or_uid() -> None:
    assert names({"namespace": "ml", "pod": "b-pod"}) == ["b-pod"]
    assert names({"namespace": "other", "pod": "b-pod"}) == []
    assert names({"pod_uid": "uid-c"}) == ["c-pod"]
    (parsed,) = parse_alertmanager_payload({"alerts": [{"labels": {"pod_uid": "uid-c"}}]}).requests
    assert parsed.target_dict() == {"pod_uid": "uid-c"}


def enforcer(tmp_path: Path, identities: list[ContainerIdentity]) -> Enforcer:
    (tmp_path / "policy.yaml").write_text(POLICY)
    e = enforcer_for(tmp_path / "policy.yaml", tmp_path, dry_run=True,
                     cgroups=CgroupTree(v2_root=tmp_path / "cg", autodetect=False))
    rows = tuple(ContainerUsage(i, 0, "GPU-0", 1, 0.0, 0.0) for i in identities)
    e.on_snapshot(Snapshot(time.time(), "n", (DeviceInfo(0, "GPU-0", "sim", None, 1 << 34, None, None),), rows))
    return e


def request(action: str, **target: str) -> WebhookRequest:
    return WebhookRequest(action=action, firing=True, alert_name="GpuHog", fingerprint="f",
                          target=tuple(sorted(target.items())), labels=())


def test_pause_with_a_one_character_id_freezes_no_bystander(tmp_path: Path) -> None:
    e = enforcer(tmp_path, IDENTITIES)
    assert e.on_webhook(request("pause", container_id="9")).startswith("ignored: no container")
    assert e.on_webhook(request("pause", container_id="containerd://" + ID_C)).startswith("dry_run")
    assert [r["target"]["container_id"] for r in read_audit(tmp_path / "audit.jsonl")] == [ID_C]  # type: ignore[index]
    e.close()


def test_a_target_matching_several_containers_is_refused_for_every_action(tmp_path: Path) -> None:
    twins = [ident("a", ID_A, "uid-a"), ContainerIdentity(
        runtime="containerd", cgroup_path="/kubepods/x", container_id=ID_B, container_name="side",
        pod_name="a-pod", pod_namespace="ml", pod_uid="uid-a")]
    e = enforcer(tmp_path, twins)
    for action in ("alert", "pause"):
        assert e.on_webhook(request(action, namespace="ml", pod="a-pod")).startswith("ignored: ambiguous target")
    e.close()


def test_repeat_gate_folds_identical_actions_within_the_window() -> None:
    now = [0.0]
    gate = RepeatGate(window_s=60, clock=lambda: now[0])
    assert gate.admit("k", "payload") and not gate.admit("k") and not gate.admit("k") and gate.admit("other")
    assert gate.expired() == []
    now[0] = 61
    assert gate.expired() == [("k", 2, "payload")]
    assert gate.admit("k")


def test_repeated_alerts_over_http_are_one_audit_record_and_counted(tmp_path: Path) -> None:
    e = enforcer(tmp_path, IDENTITIES)
    srv = WebhookServer("127.0.0.1", 0, TOKEN, e.on_webhook, rate_per_s=1000, burst=1000)
    srv.start()
    alerts = [{"status": "firing", "labels": {"alertname": "GpuHog", "gpuwatch_action": "alert",
                                              "container_id": "containerd://" + ID_C}}] * 99
    alerts += [{"status": "firing", "labels": {"alertname": "Typo", "container_id": "9"}}]
    try:
        for _ in range(20):
            req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/api/v1/alerts",
                                         data=json.dumps({"alerts": alerts}).encode(), method="POST",
                                         headers={"Authorization": f"bearer {TOKEN}"})  # lower-case scheme
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 200
    finally:
        srv.stop()
        e.close()
    records = read_audit(tmp_path / "audit.jsonl")
    assert len(records) == 1, len(records)  # not 2,000
    assert srv.metrics.alerts["duplicate"] == 20 * 99 - 1
    assert srv.metrics.alerts["no_target"] == 20


def test_get_on_the_webhook_is_405(tmp_path: Path) -> None:
    srv = WebhookServer("127.0.0.1", 0, TOKEN, lambda r: "ok")
    srv.start()
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/api/v1/alerts", method="GET")
        try:
            urllib.request.urlopen(req, timeout=10)
        except urllib.error.HTTPError as err:
            assert err.code == 405 and err.headers["Allow"] == "POST"
        else:
            raise AssertionError("GET accepted")
    finally:
        srv.stop()
