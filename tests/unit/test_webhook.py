"""Alertmanager webhook: authentication, safe defaults and payload parsing, over real HTTP."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.core.errors import UnsafeConfiguration
from gpuwatch.enforce.webhook.receiver import (
    MAX_BODY_BYTES,
    WebhookRequest,
    WebhookServer,
    check_bind_address,
    load_token,
    loggable,
    parse_alertmanager_payload,
)

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


def _counts(srv: WebhookServer) -> dict[str, float]:
    return {s.labels["result"]: s.value for fam in srv.metrics.collect()
            if fam.name == "gpuwatch_webhook_requests" for s in fam.samples if s.name.endswith("_total")}


def _raw(port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_every_request_is_counted_once_by_result() -> None:
    """gpuwatch_webhook_requests_total{result}: ok, unauthorized, rejected, too_large, rate_limited."""
    clock = [0.0]
    srv = WebhookServer("127.0.0.1", 0, TOKEN, lambda req: "recorded", rate_per_s=1.0, burst=2,
                        clock=lambda: clock[0])
    srv.start()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    good = json.dumps({"alerts": [_alert(namespace="a", pod="p")]}).encode()
    try:
        assert _counts(srv) == {r: 0.0 for r in ("ok", "unauthorized", "rejected", "too_large", "rate_limited")}
        assert _raw(srv.port, "POST", srv.PATH, good, auth)[0] == 200
        assert _raw(srv.port, "POST", srv.PATH, good)[0] == 401
        code, headers, _ = _raw(srv.port, "GET", srv.PATH)
        assert (code, headers.get("Allow")) == (405, "POST")
        assert _raw(srv.port, "POST", "/other", good, auth)[0] == 404
        assert _raw(srv.port, "POST", srv.PATH, b"[" * 100_000 + b"]" * 100_000, auth)[0] == 400  # deep JSON
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:  # refused before the body
            sock.sendall(f"POST {srv.PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                         f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n{{".encode())
            assert sock.recv(100).startswith(b"HTTP/1.1 413 ")
        code, headers, _ = _raw(srv.port, "POST", srv.PATH, good, auth)  # the burst of 2 is used up
        assert (code, headers.get("Retry-After")) == (503, "1")
        clock[0] += 1.0
        assert _raw(srv.port, "POST", srv.PATH, good, auth)[0] == 200
        assert _counts(srv) == {"ok": 2, "unauthorized": 1, "rejected": 3, "too_large": 1, "rate_limited": 1}
        assert srv.unauthorized_total == 1 and srv.accepted_total == 2
    finally:
        srv.stop()


def test_deeply_nested_json_is_a_400_not_a_dropped_connection(
        server: tuple[WebhookServer, list[WebhookRequest]]) -> None:
    """Issue 13: deeply nested JSON raised RecursionError and dropped the connection."""
    srv, seen = server
    deep: object = "leaf"
    for _ in range(40):  # parses, but deeper than MAX_JSON_DEPTH
        deep = [deep]
    for body in (b"[" * 50_000, b'{"alerts":' * 20_000, b"[" * 5_000 + b"]" * 5_000,
                 json.dumps({"alerts": [_alert(namespace="a", pod="p") | {"x": deep}]}).encode()):
        code, doc = _post(srv.port, body, TOKEN)
        assert code == 400 and ("nested deeper" in str(doc["error"]) or "not JSON" in str(doc["error"])), doc
    assert seen == []


def test_payload_that_is_not_an_alertmanager_document_is_a_400(
        server: tuple[WebhookServer, list[WebhookRequest]]) -> None:
    srv, seen = server
    for body in (b"[]", b"42", b'{"alerts": "x"}', b"\xff\xfe"):
        assert _post(srv.port, body, TOKEN)[0] == 400, body
    assert seen == []


def test_alerts_per_request_are_capped() -> None:
    """Issue 13: 250k alerts in one request were each logged and handled."""
    seen: list[WebhookRequest] = []

    def handler(req: WebhookRequest) -> str:
        seen.append(req)
        return "recorded"

    srv = WebhookServer("127.0.0.1", 0, TOKEN, handler, max_alerts=10)
    srv.start()
    try:
        body = json.dumps({"alerts": [_alert(namespace="a", pod=f"p{i}") for i in range(5000)]}).encode()
        code, doc = _post(srv.port, body, TOKEN)
        assert code == 200 and len(seen) == 10 and len(doc["results"]) == 10  # type: ignore[arg-type]
        assert doc["rejected"] == ["4990 alerts over the cap of 10 per request were not read "
                                   "(set max_alerts: 10 in Alertmanager's webhook_config)"]
    finally:
        srv.stop()


def test_one_summary_line_per_request_values_truncated_control_characters_escaped(
        server: tuple[WebhookServer, list[WebhookRequest]], caplog: pytest.LogCaptureFixture) -> None:
    """Issue 13: a 1 MB alertname was a 1 MB log line, one line per alert, and a newline in
    alertname forged log lines."""
    srv, seen = server
    forged = "Hog\n2026-01-01 00:00:00,000 WARNING gpuwatch.enforce: forged line\r\x1b[31m\u2028"
    alerts = [_alert(namespace="a", pod="p", alertname=forged) for _ in range(50)]
    alerts += [_alert(namespace="a", pod="p", alertname="x" * 450_000)]
    alerts += [_alert(namespace="a", alertname=forged + "no-target")]
    with caplog.at_level(logging.DEBUG, logger="gpuwatch.enforce.webhook.receiver"):
        code, doc = _post(srv.port, json.dumps({"alerts": alerts}).encode(), TOKEN)
    assert code == 200 and len(seen) == 51
    lines = [r.getMessage() for r in caplog.records if r.name == "gpuwatch.enforce.webhook.receiver"]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\u2028" not in line
    assert "Hog\\n2026-01-01" in line and "\\x1b[31m" in line and "\\u2028" in line
    assert len(line) < 2000 and "51 alert(s)" in line and "1 rejected" in line
    assert all("\n" not in r.alert_name and len(r.alert_name) < 200 for r in seen)
    assert "\n" not in json.dumps(doc["results"]).replace("\\n", "")


def test_refused_requests_are_logged_at_most_once_per_interval(
        server: tuple[WebhookServer, list[WebhookRequest]], caplog: pytest.LogCaptureFixture) -> None:
    srv, _ = server
    with caplog.at_level(logging.DEBUG, logger="gpuwatch.enforce.webhook.receiver"):
        for _ in range(30):
            assert _post(srv.port, b"{}", "wrong-token-wrong-token")[0] == 401
    lines = [r.getMessage() for r in caplog.records if r.name == "gpuwatch.enforce.webhook.receiver"]
    assert len(lines) == 1 and "unauthorized" in lines[0]
    assert srv.unauthorized_total == 30


@pytest.mark.parametrize(("alert", "reason"), [
    ({"labels": {"alertname": "A", "namespace": "a", "pod": ["p"]}}, "is not a string"),
    ({"labels": {"alertname": "A", "namespace": "a", "pod": "p"}, "status": "maybe"}, "neither firing"),
    ({"labels": {"alertname": "A", "namespace": "a\nb", "pod": "p"}}, "not a Kubernetes name"),
    ({"labels": {"alertname": "A", "container_id": "x" * 300}}, "not a Kubernetes name"),
    ({"labels": {"alertname": "A", "namespace": "a", "pod": "p", "gpuwatch_action": "k" * 10_000}},
     "unknown gpuwatch_action"),
])
def test_parse_rejects_hostile_label_values(alert: dict[str, object], reason: str) -> None:
    result = parse_alertmanager_payload({"alerts": [alert]})
    assert result.requests == () and reason in result.rejected[0], result.rejected
    assert len(result.rejected[0]) < 400


def test_loggable() -> None:
    assert loggable("plain") == "plain"
    assert loggable("a\nb\tc\x00\u2028") == "a\\nb\\tc\\x00\\u2028"
    assert loggable("x" * 100, 10) == "x" * 10 + "...(+90 chars)"
    assert loggable(["nested"] * 1000, 12).endswith("chars)")


def test_handler_errors_do_not_cost_the_other_alerts_their_answer() -> None:
    def handler(req: WebhookRequest) -> str:
        if req.target_dict()["pod"] == "bad":
            raise RuntimeError("enforcer bug")
        return "recorded"

    srv = WebhookServer("127.0.0.1", 0, TOKEN, handler)
    srv.start()
    try:
        body = json.dumps({"alerts": [_alert(namespace="a", pod="bad"), _alert(namespace="a", pod="p")]}).encode()
        code, doc = _post(srv.port, body, TOKEN)
        assert code == 200 and doc["results"] == [
            {"alert": "GpuMemoryOverLimit", "action": "alert", "result": "error: RuntimeError"},
            {"alert": "GpuMemoryOverLimit", "action": "alert", "result": "recorded"}]
    finally:
        srv.stop()
