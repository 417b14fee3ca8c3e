"""Alertmanager webhook requests through Enforcer.on_webhook (dry run / alert only, no root)."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.core.model import ContainerIdentity, ContainerUsage, DeviceInfo, Snapshot
from gpuwatch.enforce.audit import read_audit
from gpuwatch.enforce.enforcer import Enforcer
from gpuwatch.enforce.webhook.receiver import WebhookRequest, WebhookServer
from tests.enforcer_setup import enforcer_on_fake_tree

POLICY = """
rules:
  - name: ml
    match: {namespace: ml}
    limits: {gpu_memory: 8GiB}
    actions: [{do: alert}]
  - name: all
    match: {default: true}
"""
TOKEN = "webhook-test-token-0123456789"


def ident(name: str, namespace: str) -> ContainerIdentity:
    return ContainerIdentity(
        runtime="k8s",
        cgroup_path=f"/kubepods/{name}",
        container_id=f"id-{name}",
        container_name=name,
        pod_name=f"{name}-pod",
        pod_namespace=namespace,
    )


def enforcer(tmp_path: Path, dry_run: bool = True) -> Enforcer:
    e = enforcer_on_fake_tree(tmp_path, POLICY, dry_run=dry_run)
    rows = tuple(ContainerUsage(i, 0, "GPU-0", 1, 0.0, 0.0) for i in (ident("a", "ml"), ident("dns", "kube-system")))
    e.on_snapshot(Snapshot(time.time(), "n", (DeviceInfo(0, "GPU-0", "sim", None, 1 << 34, None, None),), rows))
    return e


def request(action: str, firing: bool = True, **target: str) -> WebhookRequest:
    return WebhookRequest(
        action=action,
        firing=firing,
        alert_name="GpuHog",
        fingerprint="f",
        target=tuple(sorted(target.items())),
        labels=(),
    )


def test_alert_for_known_container_is_audited(tmp_path: Path) -> None:
    e = enforcer(tmp_path, dry_run=False)
    assert e.on_webhook(request("alert", namespace="ml", pod="a-pod")) == "ok: logged"
    (record,) = read_audit(tmp_path / "audit.jsonl")
    assert record["scope"] == "webhook" and record["rule"] == "webhook:GpuHog" and record["action"] == "alert"
    e.close()


def test_kill_in_dry_run_does_nothing_but_is_recorded(tmp_path: Path) -> None:
    e = enforcer(tmp_path)
    assert e.on_webhook(request("kill", container_id="id-a")).startswith("dry_run")
    assert read_audit(tmp_path / "audit.jsonl")[-1]["dry_run"] is True
    e.close()


def test_unknown_target_is_ignored(tmp_path: Path) -> None:
    e = enforcer(tmp_path)
    assert e.on_webhook(request("kill", container_id="nope")).startswith("ignored: no container")
    assert not (tmp_path / "audit.jsonl").read_text()
    e.close()


def test_protected_namespace_refused(tmp_path: Path) -> None:
    e = enforcer(tmp_path, dry_run=False)
    result = e.on_webhook(request("kill", namespace="kube-system", pod="dns-pod"))
    assert result.startswith("suppressed: namespace 'kube-system' is protected")
    e.close()


def test_resolved_alert_only_releases(tmp_path: Path) -> None:
    e = enforcer(tmp_path)
    assert e.on_webhook(request("kill", firing=False, container_id="id-a")).startswith("ignored: alert resolved")
    assert e.on_webhook(request("pause", firing=False, container_id="id-a")).startswith("dry_run")
    assert read_audit(tmp_path / "audit.jsonl")[-1]["action"] == "release"
    e.close()


def test_throttle_without_share_in_policy_is_ignored(tmp_path: Path) -> None:
    e = enforcer(tmp_path)
    assert "gpu_time_share" in e.on_webhook(request("throttle", container_id="id-a"))
    e.close()


def test_hostile_alert_names_reach_the_enforcer_log_and_audit_escaped_and_short(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Over real HTTP into the enforcer: a newline in alertname forges no log line in the webhook's
    or the enforcer's log, a 400 kB alertname is no 400 kB line, and the audit names the alert
    escaped; without the token nothing reaches the enforcer."""
    e = enforcer(tmp_path, dry_run=False)
    srv = WebhookServer("127.0.0.1", 0, TOKEN, e.on_webhook)
    srv.start()
    forged = "GpuHog\n2026-01-01 00:00:00,000 WARNING gpuwatch.enforce.enforcer: forged\r\x1b[2J" + "x" * 400_000
    alerts = [{"status": "firing", "labels": {"alertname": forged, "namespace": "ml", "pod": pod}}
              for pod in ("a-pod", "nope-pod")]
    body = json.dumps({"alerts": alerts}).encode()
    try:
        with caplog.at_level(logging.DEBUG, logger="gpuwatch"):
            assert _post(srv.port, body, "wrong-token-0123456789")[0] == 401
            assert not (tmp_path / "audit.jsonl").read_text()
            code, doc = _post(srv.port, body, TOKEN)
        assert code == 200 and [r["result"].split(":")[0] for r in doc["results"]] == ["ok", "ignored"]
        for record in caplog.records:
            text = record.getMessage()
            assert "\n" not in text and "\r" not in text and "\x1b" not in text and len(text) < 2000, text
        webhook_lines = [r for r in caplog.records if r.name == "gpuwatch.enforce.webhook.receiver"]
        assert len(webhook_lines) == 2  # the 401 and one summary line for the two alerts
        (audited,) = read_audit(tmp_path / "audit.jsonl")
        rule = str(audited["rule"])
        assert rule.startswith("webhook:GpuHog\\n2026") and len(rule) < 300
    finally:
        srv.stop()
        e.close()


def _post(port: int, body: bytes, token: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/alerts", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)
