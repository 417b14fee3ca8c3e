"""Alertmanager webhook: firing alerts become enforcement requests.

This is the agent's only *acting* endpoint, so it is locked down by default:
* it needs a bearer token (read from a file that only root may read; >= 16 characters);
* it binds to loopback unless the operator explicitly allows a remote address;
* it refuses to start when either rule is broken (UnsafeConfiguration), instead of
  starting open;
* it runs on gpuwatch.core.httpserve (waitress with WEBHOOK_LIMITS): 2 worker threads, at most 64
  connections, idle/request/response deadlines, bodies over 1 MiB refused while read (413);
* authenticated requests are rate limited (a token bucket: DEFAULT_RATE_PER_S a second,
  bursts of DEFAULT_BURST); over it the answer is 503 with Retry-After, which Alertmanager
  retries with back-off (it does not retry a 4xx), so a burst delays alerts, never drops them;
* bodies are parsed defensively: JSON nested deeper than MAX_JSON_DEPTH is a 400, at most
  MAX_ALERTS_PER_REQUEST alerts are read per request (set `max_alerts` in Alertmanager's
  webhook_config to match), label values must be strings, target labels must look like
  Kubernetes names or container ids, a malformed alert is rejected with a reason and never
  turns into an action;
* targets match exactly (gpuwatch.enforce.webhook.requests.find_target): a target naming no
  container or several is refused and counted (gpuwatch_webhook_alerts_total{result="no_target"
  | "ambiguous_target"}); identical alert actions repeated within a minute are acted on and
  audited once ("duplicate", counted, one audit record with the count when the window ends);
* every request is logged once, as one summary line (values truncated, control characters
  escaped, so an alertname cannot forge log lines); refused requests (unauthorized,
  rejected, too large, rate limited) are logged at most once per LOG_INTERVAL_S per kind,
  and every request is counted in gpuwatch_webhook_requests_total{result}.

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
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatch.core.errors import UnsafeConfiguration
from gpuwatch.core.httpserve import BoundedServer, JsonRejected, ServerLimits, parse_json
from gpuwatch.enforce.metrics import WebhookMetrics

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
MAX_JSON_DEPTH = 32  # Alertmanager's payload is 4 deep
MAX_ALERTS_PER_REQUEST = 100
MIN_TOKEN_CHARS = 16
DEFAULT_RATE_PER_S = 5.0
DEFAULT_BURST = 20
LOG_VALUE_CHARS = 80  # a label value in a log line
LOG_INTERVAL_S = 10.0  # refused requests: one log line per kind per interval
ALERT_NAME_CHARS = 128
ACTIONS = frozenset({"alert", "pause", "resume", "throttle", "checkpoint_kill", "kill"})
TARGET_LABELS = ("namespace", "pod", "pod_uid", "container", "container_id")
# Kubernetes names (DNS labels/subdomains) and container ids (hex, or runtime://hex)
_TARGET_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,252}")
WEBHOOK_LIMITS = ServerLimits(threads=2, connection_limit=64, backlog=64, idle_timeout_s=30,
                              request_timeout_s=10, response_timeout_s=30, max_body_bytes=MAX_BODY_BYTES,
                              max_header_bytes=16 * 1024)


def loggable(value: object, limit: int = LOG_VALUE_CHARS) -> str:
    """`value` safe for one log line: at most `limit` characters (the rest counted), control
    and other non-printable characters escaped (a newline cannot start a forged line)."""
    text = value if isinstance(value, str) else repr(value)[: limit + 1]
    extra = len(text) - limit
    if extra > 0:
        text = text[:limit]
    shown = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return shown + (f"...(+{extra} chars)" if extra > 0 else "")


@dataclass(frozen=True)
class WebhookRequest:
    """One alert turned into a request for the enforcer."""

    action: str
    firing: bool
    alert_name: str  # loggable(): truncated, control characters escaped
    fingerprint: str
    target: tuple[tuple[str, str], ...]  # sorted (label, value) pairs naming the target
    labels: tuple[tuple[str, str], ...]

    def target_dict(self) -> dict[str, str]:
        return dict(self.target)


@dataclass(frozen=True)
class ParseResult:
    requests: tuple[WebhookRequest, ...]
    rejected: tuple[str, ...]  # one reason per alert that could not become a request
    payload_error: str | None = None  # the payload as a whole is unusable (nothing was read)


def _parse_alert(i: int, alert: Any) -> WebhookRequest | str:
    """One alert -> a request, or the reason it is rejected (loggable)."""
    if not isinstance(alert, Mapping) or not isinstance(alert.get("labels"), Mapping):
        return f"alert {i}: no labels"
    labels: dict[str, str] = {}
    for key, value in alert["labels"].items():
        if not isinstance(value, str):
            return f"alert {i}: label {loggable(key, 40)} is not a string"
        labels[str(key)] = value
    name = loggable(labels.get("alertname") or f"alert {i}", ALERT_NAME_CHARS)
    action = labels.get("gpuwatch_action", "alert")
    if action not in ACTIONS:
        return f"{name}: unknown gpuwatch_action {loggable(action, 40)!r} (one of {', '.join(sorted(ACTIONS))})"
    status = alert.get("status", "firing")
    if status not in ("firing", "resolved"):
        return f"{name}: status {loggable(status, 40)!r} is neither firing nor resolved"
    target = {k: labels[k] for k in TARGET_LABELS if labels.get(k)}
    for key, value in target.items():
        if not _TARGET_VALUE.fullmatch(value):
            return f"{name}: label {key} {loggable(value, 40)!r} is not a Kubernetes name or container id"
    if not (target.get("container_id") or target.get("pod_uid") or (target.get("namespace") and target.get("pod"))):
        return f"{name}: no target: needs container_id, pod_uid, or namespace and pod labels"
    return WebhookRequest(
        action=action,
        firing=status == "firing",
        alert_name=name,
        fingerprint=loggable(alert.get("fingerprint", ""), 64),
        target=tuple(sorted(target.items())),
        labels=tuple(sorted(labels.items())),
    )


def parse_alertmanager_payload(payload: Any, max_alerts: int = MAX_ALERTS_PER_REQUEST) -> ParseResult:
    """Alertmanager webhook JSON (version 4) -> requests; never raises on bad alerts.

    At most `max_alerts` alerts are read; the rest are rejected with one reason."""
    if not isinstance(payload, Mapping):
        reason = "payload is not a JSON object"
        return ParseResult((), (reason,), reason)
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        reason = "payload has no `alerts` list"
        return ParseResult((), (reason,), reason)
    requests: list[WebhookRequest] = []
    rejected: list[str] = []
    for i, alert in enumerate(alerts[:max_alerts]):
        parsed = _parse_alert(i, alert)
        if isinstance(parsed, str):
            rejected.append(parsed)
        else:
            requests.append(parsed)
    if len(alerts) > max_alerts:
        rejected.append(f"{len(alerts) - max_alerts} alerts over the cap of {max_alerts} per request were not "
                        f"read (set max_alerts: {max_alerts} in Alertmanager's webhook_config)")
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
StartResponse = Callable[..., Any]


class TokenBucket:
    """`rate_per_s` requests a second on average, bursts of `burst` (thread-safe)."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self.rate_per_s, self.burst, self._clock = float(rate_per_s), float(burst), clock
        self._tokens = float(burst)
        self._last = clock()
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate_per_s)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False


class _LogGate:
    """One log line per kind per interval; the lines left out are counted into the next."""

    def __init__(self, interval_s: float, clock: Callable[[], float]) -> None:
        self.interval_s, self._clock = interval_s, clock
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}
        self._lock = threading.Lock()

    def admit(self, kind: str) -> int | None:
        """None: stay quiet; else log now, mentioning this many left out since the last line."""
        now = self._clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval_s:
                self._skipped[kind] = self._skipped.get(kind, 0) + 1
                return None
            self._last[kind] = now
            return self._skipped.pop(kind, 0)


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


class WebhookServer:
    """HTTP server for POST /api/v1/alerts (Alertmanager webhook_config url).

    `metrics` (a prometheus Collector, gpuwatch_webhook_*) counts every request once by
    result; register it in the exporter's registry to export it."""

    PATH = "/api/v1/alerts"

    def __init__(self, host: str, port: int, token: str, handler: Handler, allow_remote: bool = False, *,
                 limits: ServerLimits = WEBHOOK_LIMITS, rate_per_s: float = DEFAULT_RATE_PER_S,
                 burst: int = DEFAULT_BURST, max_alerts: int = MAX_ALERTS_PER_REQUEST,
                 metrics: WebhookMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        check_bind_address(host, allow_remote)
        if len(token) < MIN_TOKEN_CHARS:
            raise UnsafeConfiguration("webhook token too short", fix="use at least 16 random characters")
        self._token = token.encode()
        self._handler = handler
        self.max_alerts = max_alerts
        self.metrics = metrics if metrics is not None else WebhookMetrics()
        self._bucket = TokenBucket(rate_per_s, burst, clock)
        self._gate = _LogGate(LOG_INTERVAL_S, clock)
        self._http = BoundedServer(self._app, host, port, name="gpuwatch-webhook", limits=limits,
                                   on_refused=self._refused)

    @property
    def port(self) -> int:
        return self._http.port

    @property
    def http(self) -> BoundedServer:
        """The underlying server (limits, open connections, evictions, timeouts)."""
        return self._http

    @property
    def accepted_total(self) -> int:
        return int(self.metrics.alerts["accepted"])

    @property
    def rejected_total(self) -> int:
        return int(self.metrics.alerts["rejected"] + self.metrics.requests["rejected"])

    @property
    def unauthorized_total(self) -> int:
        return int(self.metrics.requests["unauthorized"])

    def start(self) -> None:
        self._http.start()

    def stop(self) -> None:
        self._http.stop()

    def authorized(self, header: str | None) -> bool:
        """`Authorization: Bearer <token>`; the scheme is case-insensitive (RFC 7235 2.1)."""
        scheme, _, credentials = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            return False
        return hmac.compare_digest(credentials.strip().encode(), self._token)

    # -- requests ------------------------------------------------------------------------
    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        client = str(environ.get("REMOTE_ADDR") or "?")
        path = environ.get("PATH_INFO") or "/"
        method = environ.get("REQUEST_METHOD", "")
        if path != self.PATH:
            return self._refuse(start_response, 404, f"unknown path; use {self.PATH}", "rejected", client,
                                f"{loggable(method, 16)} {loggable(path)}: unknown path")
        if method != "POST":
            return self._refuse(start_response, 405, f"POST Alertmanager webhook payloads to {self.PATH}",
                                "rejected", client, f"{loggable(method, 16)}: not POST",
                                [("Allow", "POST")])
        if not self.authorized(environ.get("HTTP_AUTHORIZATION")):
            return self._refuse(start_response, 401, "missing or wrong bearer token", "unauthorized", client,
                                "missing or wrong bearer token", [("WWW-Authenticate", "Bearer")])
        if not self._bucket.take():
            return self._refuse(start_response, 503, "rate limited: retry later", "rate_limited", client,
                                f"over {self._bucket.rate_per_s:g} requests/s (bursts of "
                                f"{self._bucket.burst:g})", [("Retry-After", "1")])
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if length <= 0:
            return self._refuse(start_response, 400, "POST an Alertmanager webhook JSON body", "rejected",
                                client, "empty body")
        if length > MAX_BODY_BYTES:  # waitress refuses these first (413 while reading); kept as a guard
            return self._refuse(start_response, 413, f"body over {MAX_BODY_BYTES} bytes", "too_large", client,
                                f"body of {length} bytes")
        raw = environ["wsgi.input"].read(length)
        try:
            payload = parse_json(raw, MAX_JSON_DEPTH)
        except JsonRejected as err:
            return self._refuse(start_response, 400, str(err), "rejected", client, str(err))
        parsed = parse_alertmanager_payload(payload, self.max_alerts)
        if parsed.payload_error is not None:
            return self._refuse(start_response, 400, parsed.payload_error, "rejected", client,
                                parsed.payload_error)
        results = [{"alert": req.alert_name, "action": req.action, "result": self._act(req)}
                   for req in parsed.requests]
        self.metrics.count_request("ok")
        self.metrics.count_alerts(len(parsed.requests), len(parsed.rejected))
        self.metrics.count_outcomes(r["result"] for r in results)
        self._summary(client, parsed, results)
        return self._reply(start_response, 200, {"results": results, "rejected": list(parsed.rejected)})

    def _act(self, req: WebhookRequest) -> str:
        try:
            return str(self._handler(req))
        except Exception as err:  # an enforcer bug must not cost the other alerts their answer
            if self._gate.admit(f"handler:{type(err).__name__}") is not None:
                log.exception("webhook: handling %s failed", req.alert_name)
            return f"error: {type(err).__name__}"

    def _summary(self, client: str, parsed: ParseResult, results: list[dict[str, str]]) -> None:
        """One line per authenticated request, whatever the number of alerts."""
        shown = []
        for req, result in zip(parsed.requests[:5], results[:5], strict=False):
            target = "/".join(v for _, v in req.target)
            shown.append(f"{req.alert_name} {req.action}{'' if req.firing else ' (resolved)'} {loggable(target)}"
                         f" -> {loggable(result['result'], 120)}")
        if len(parsed.requests) > 5:
            shown.append(f"... {len(parsed.requests) - 5} more")
        text = f"webhook from {loggable(client, 64)}: {len(parsed.requests)} alert(s)"
        if shown:
            text += ": " + "; ".join(shown)
        if parsed.rejected:
            text += f"; {len(parsed.rejected)} rejected (first: {loggable(parsed.rejected[0], 200)})"
        log.log(logging.WARNING if parsed.rejected else logging.INFO, "%s", text)

    def _refuse(self, start_response: StartResponse, code: int, message: str, result: str, client: str,
                why: str, headers: list[tuple[str, str]] | None = None) -> list[bytes]:
        self.metrics.count_request(result)
        self._log_refusal(result, f"{loggable(client, 64)}: {loggable(why, 200)}")
        return self._reply(start_response, code, {"error": message}, headers)

    def _refused(self, kind: str) -> None:
        """The HTTP server answered itself (413/431, malformed HTTP, 500; 503 busy) before the app ran."""
        result = {"too_large": "too_large", "busy": "rate_limited"}.get(kind, "rejected")
        self.metrics.count_request(result)
        why = "body or headers over the limit" if kind == "too_large" else f"{kind.replace('_', ' ')} (HTTP)"
        self._log_refusal(result, f"{why}, answered by the HTTP server")

    def _log_refusal(self, result: str, text: str) -> None:
        skipped = self._gate.admit(result)
        if skipped is not None:
            more = f" ({skipped} more like it since the last line)" if skipped else ""
            log.warning("webhook: %s request: %s%s", result.replace("_", " "), text, more)

    @staticmethod
    def _reply(start_response: StartResponse, code: int, doc: Mapping[str, Any],
               headers: list[tuple[str, str]] | None = None) -> list[bytes]:
        data = json.dumps(doc).encode()
        start_response(f"{code} {_REASONS[code]}", [("Content-Type", "application/json"),
                                                     ("Content-Length", str(len(data))), *(headers or [])])
        return [data]


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
