"""Alertmanager webhook: authentication, safe defaults and payload parsing, over real HTTP."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.enforce.webhook import (
    WebhookRequest,
    WebhookServer,
    check_bind_address,
    load_token,
    parse_alertmanager_payload,
)
from gpuwatch.errors import UnsafeConfiguration

TOKEN = "s3cr3t-token-0123456789"


def _alert(**labels: str) -> dict[str, object]:
    return {"status": "firing", "labels": {"alertname": "GpuMemoryOverLimit", **labels},
            "fingerprint": "abc"}


def test_parse_firing_alert_with_pod_target() -> None:
    result = parse_alertmanager_payload({"version": "4", "alerts": [
        _alert(namespace="team-a", pod="train-0", container="main", gpuwatch_action="pause")]})
    assert result.rejected == ()
    (req,) = result.requests
    assert req.action == "pause" and req.firing
    assert req.target_dict() == {"namespace": "team-a", "pod": "train-0", "container": "main"}


def test_parse_defaults_to_alert_only_and_reads_resolved() -> None:
    alert = _alert(container_id="ab" * 32)
    alert["status"] = "resolved"
    (req,) = parse_alertmanager_payload({"alerts": [alert]}).requests
    assert req.action == "alert" and not req.firing


@pytest.mark.parametrize(("payload", "reason"), [
    ([], "not a JSON object"),
    ({"alerts": "x"}, "no `alerts` list"),
    ({"alerts": [42]}, "no labels"),
    ({"alerts": [_alert(namespace="a", pod="p", gpuwatch_action="nuke")]}, "unknown gpuwatch_action"),
    ({"alerts": [_alert(namespace="a")]}, "no target"),
])
def test_parse_rejects_bad_alerts_with_a_reason(payload: object, reason: str) -> None:
    result = parse_alertmanager_payload(payload)
    assert result.requests == ()
    assert any(reason in r for r in result.rejected), result.rejected


def test_token_file_must_be_private_and_long(tmp_path: Path) -> None:
    f = tmp_path / "token"
    with pytest.raises(UnsafeConfiguration, match="unreadable"):
        load_token(f)
    f.write_text(TOKEN)
    os.chmod(f, 0o644)
    with pytest.raises(UnsafeConfiguration, match="readable by group/others"):
        load_token(f)
    os.chmod(f, 0o600)
    assert load_token(f) == TOKEN
    f.write_text("short")
    with pytest.raises(UnsafeConfiguration, match="shorter than"):
        load_token(f)


def test_remote_bind_refused_unless_allowed() -> None:
    check_bind_address("127.0.0.1", allow_remote=False)
    check_bind_address("::1", allow_remote=False)
    with pytest.raises(UnsafeConfiguration, match="refusing"):
        check_bind_address("0.0.0.0", allow_remote=False)
    check_bind_address("0.0.0.0", allow_remote=True)


@pytest.fixture
def server() -> Iterator[tuple[WebhookServer, list[WebhookRequest]]]:
    seen: list[WebhookRequest] = []

    def handler(req: WebhookRequest) -> str:
        seen.append(req)
        return "recorded"

    srv = WebhookServer("127.0.0.1", 0, TOKEN, handler)
    srv.start()
    try:
        yield srv, seen
    finally:
        srv.stop()


def _post(port: int, body: bytes, token: str | None) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/alerts", data=body, method="POST")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_http_requires_the_token(server: tuple[WebhookServer, list[WebhookRequest]]) -> None:
    srv, seen = server
    body = json.dumps({"alerts": [_alert(namespace="a", pod="p", gpuwatch_action="kill")]}).encode()
    assert _post(srv.port, body, None)[0] == 401
    assert _post(srv.port, body, "wrong-token-wrong-token")[0] == 401
    assert seen == [] and srv.unauthorized_total == 2
    code, doc = _post(srv.port, body, TOKEN)
    assert code == 200 and doc["results"] == [
        {"alert": "GpuMemoryOverLimit", "action": "kill", "result": "recorded"}]
    assert [r.action for r in seen] == ["kill"]


def test_http_bad_json_is_400_and_acts_on_nothing(
        server: tuple[WebhookServer, list[WebhookRequest]]) -> None:
    srv, seen = server
    assert _post(srv.port, b"{not json", TOKEN)[0] == 400
    assert seen == []
