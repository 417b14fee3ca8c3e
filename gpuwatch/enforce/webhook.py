"""Alertmanager webhook: firing alerts become enforcement requests.

This is the agent's only *acting* endpoint, so it is locked down by default:
* it needs a bearer token (read from a file that only root may read; >= 16 characters);
* it binds to loopback unless the operator explicitly allows a remote address;
* it refuses to start when either rule is broken (UnsafeConfiguration), instead of
  starting open;
* bodies are size-limited and parsed defensively: a malformed alert is rejected with a
  reason and never turns into an action.

An alert asks for an action through its labels (Prometheus rule labels, see
dashboards/gpuwatch-rules.yml): `gpuwatch_action` (alert|pause|resume|throttle|
checkpoint_kill|kill) and the target's `namespace`/`pod`/`container` or `container_id`.
The handler (the enforcer) decides whether and how to act; the webhook only authenticates,
parses and forwards.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import stat
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from gpuwatch.errors import UnsafeConfiguration

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
MIN_TOKEN_CHARS = 16
ACTIONS = frozenset({"alert", "pause", "resume", "throttle", "checkpoint_kill", "kill"})
TARGET_LABELS = ("namespace", "pod", "container", "container_id")


@dataclass(frozen=True)
class WebhookRequest:
    """One alert turned into a request for the enforcer."""

    action: str
    firing: bool
    alert_name: str
    fingerprint: str
    target: tuple[tuple[str, str], ...]  # sorted (label, value) pairs naming the target
    labels: tuple[tuple[str, str], ...]

    def target_dict(self) -> dict[str, str]:
        return dict(self.target)


@dataclass(frozen=True)
class ParseResult:
    requests: tuple[WebhookRequest, ...]
    rejected: tuple[str, ...]  # one reason per alert that could not become a request


def parse_alertmanager_payload(payload: Any) -> ParseResult:
    """Alertmanager webhook JSON (version 4) -> requests; never raises on bad alerts."""
    if not isinstance(payload, Mapping):
        return ParseResult((), ("payload is not a JSON object",))
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        return ParseResult((), ("payload has no `alerts` list",))
    requests: list[WebhookRequest] = []
    rejected: list[str] = []
    for i, alert in enumerate(alerts):
        if not isinstance(alert, Mapping) or not isinstance(alert.get("labels"), Mapping):
            rejected.append(f"alert {i}: no labels")
            continue
        labels = {str(k): str(v) for k, v in alert["labels"].items()}
        name = labels.get("alertname", f"alert {i}")
        action = labels.get("gpuwatch_action", "alert")
        if action not in ACTIONS:
            rejected.append(f"{name}: unknown gpuwatch_action {action!r} (one of {', '.join(sorted(ACTIONS))})")
            continue
        target = {k: labels[k] for k in TARGET_LABELS if labels.get(k)}
        if not (target.get("container_id") or (target.get("namespace") and target.get("pod"))):
            rejected.append(f"{name}: no target: needs container_id, or namespace and pod labels")
            continue
        requests.append(
            WebhookRequest(
                action=action,
                firing=alert.get("status", "firing") == "firing",
                alert_name=name,
                fingerprint=str(alert.get("fingerprint", "")),
                target=tuple(sorted(target.items())),
                labels=tuple(sorted(labels.items())),
            )
        )
    return ParseResult(tuple(requests), tuple(rejected))


def load_token(path: str | Path) -> str:
    """Read the shared secret; refuse files others can read and tokens that are too short."""
    p = Path(path)
    try:
        st = p.stat()
        token = p.read_text().strip()
    except OSError as err:
        raise UnsafeConfiguration(
            f"webhook token file {p} unreadable: {err.strerror}",
            fix=f"create it: head -c 32 /dev/urandom | base64 > {p}; chmod 600 {p}",
        ) from err
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UnsafeConfiguration(
            f"webhook token file {p} is readable by group/others (mode {stat.S_IMODE(st.st_mode):o})",
            fix=f"chmod 600 {p}",
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise UnsafeConfiguration(
            f"webhook token in {p} is shorter than {MIN_TOKEN_CHARS} characters",
            fix=f"head -c 32 /dev/urandom | base64 > {p}",
        )
    return token


def check_bind_address(host: str, allow_remote: bool) -> None:
    """Acting endpoints listen on loopback unless the operator says otherwise, loudly."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not allow_remote:
        raise UnsafeConfiguration(
            f"refusing to serve the enforcement webhook on {host}: it can pause and kill containers",
            fix="keep the default 127.0.0.1, or pass --webhook-allow-remote to accept remote callers "
            "(the token is still required)",
        )


Handler = Callable[[WebhookRequest], str]


class WebhookServer:
    """Threaded HTTP server for POST /api/v1/alerts (Alertmanager webhook_config url)."""

    PATH = "/api/v1/alerts"

    def __init__(self, host: str, port: int, token: str, handler: Handler, allow_remote: bool = False) -> None:
        check_bind_address(host, allow_remote)
        if len(token) < MIN_TOKEN_CHARS:
            raise UnsafeConfiguration("webhook token too short", fix="use at least 16 random characters")
        self._token = token.encode()
        self._handler = handler
        self.accepted_total = 0
        self.rejected_total = 0
        self.unauthorized_total = 0
        self._httpd = ThreadingHTTPServer((host, port), self._request_class())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="gpuwatch-webhook", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def authorized(self, header: str | None) -> bool:
        if not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), self._token)

    def handle_payload(self, body: bytes) -> tuple[int, dict[str, Any]]:
        try:
            payload = json.loads(body)
        except ValueError as err:
            self.rejected_total += 1
            return 400, {"error": f"body is not JSON: {err}"}
        parsed = parse_alertmanager_payload(payload)
        self.rejected_total += len(parsed.rejected)
        results = []
        for req in parsed.requests:
            self.accepted_total += 1
            results.append({"alert": req.alert_name, "action": req.action, "result": self._handler(req)})
        for reason in parsed.rejected:
            log.warning("webhook: rejected alert: %s", reason)
        return 200, {"results": results, "rejected": list(parsed.rejected)}

    def _request_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class _Request(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                log.debug("webhook %s: " + format, self.client_address[0], *args)

            def _reply(self, code: int, doc: Mapping[str, Any]) -> None:
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._reply(405, {"error": "POST Alertmanager webhook payloads to " + server.PATH})

            def do_POST(self) -> None:
                if self.path != server.PATH:
                    self._reply(404, {"error": f"unknown path; use {server.PATH}"})
                    return
                if not server.authorized(self.headers.get("Authorization")):
                    server.unauthorized_total += 1
                    log.warning("webhook: unauthorized request from %s", self.client_address[0])
                    self._reply(401, {"error": "missing or wrong bearer token"})
                    return
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                except ValueError:
                    length = -1
                if length < 0 or length > MAX_BODY_BYTES:
                    self._reply(413, {"error": f"body must be 0..{MAX_BODY_BYTES} bytes"})
                    return
                code, doc = server.handle_payload(self.rfile.read(length))
                self._reply(code, doc)

        return _Request


def token_from_env_or_file(path: str | None) -> str | None:
    """The token file path wins; GPUWATCH_WEBHOOK_TOKEN is accepted for tests and containers."""
    if path:
        return load_token(path)
    token = os.environ.get("GPUWATCH_WEBHOOK_TOKEN", "").strip()
    if token and len(token) < MIN_TOKEN_CHARS:
        raise UnsafeConfiguration(
            f"GPUWATCH_WEBHOOK_TOKEN is shorter than {MIN_TOKEN_CHARS} characters",
            fix="use a random token: head -c 32 /dev/urandom | base64",
        )
    return token or None
