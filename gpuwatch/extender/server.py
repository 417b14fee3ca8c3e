"""The extender's HTTP service: a WSGI app served by waitress (gpuwatch.core.httpserve).

waitress (a well-kept pure-Python WSGI server) gives what a webhook kube-scheduler calls
on every scheduling cycle needs: HTTP/1.1 keep-alive, a bounded thread pool (`threads`),
a cap on open connections (`connection_limit`; the longest-idle are closed for new
clients, the rest wait in the listen backlog), a request-body limit enforced while reading
(413 past it), and idle/request deadlines closing idle or stalled connections (a
Content-Length longer than the body cannot hold a thread). This module only routes and
answers:

    POST <prefix>/filter       ExtenderArgs -> ExtenderFilterResult
    POST <prefix>/prioritize   ExtenderArgs -> HostPriorityList
    GET  /metrics              the extender's own metrics (Prometheus text)
    GET  /healthz              200 "ok"

Malformed JSON, too-deep JSON, wrong types -> 400 with the reason; unknown paths 404;
wrong methods 405 (with Allow). No input reaches a traceback: any unexpected error is a
500 with a one-line reason, counted, logged once per kind. Nothing a request says changes
state except a prioritize's promise (gpuwatch.extender.promises).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gpuwatch.core.errors import GpuwatchError
from gpuwatch.core.httpserve import BoundedServer, ByteSemaphore, JsonRejected, ServerLimits, parse_json
from gpuwatch.extender.request import BadRequest
from gpuwatch.extender.service import Extender

log = logging.getLogger(__name__)

MAX_JSON_DEPTH = 64
DEFAULT_MAX_BODY_BYTES = 32 * 2**20
DEFAULT_BODY_BYTES_IN_FLIGHT = 16 * 2**20
"""Request bodies read and parsed at once, all requests together: a parsed Node list is
~6-7x its JSON (measured), so 16 MiB in flight (a body larger than that alone) stays inside
the Deployment's 256 Mi limit, while small (nodeCacheCapable) requests go on beside it."""
BODY_WAIT_S = 5.0  # kube-scheduler's default httpTimeout: past it nobody waits for the answer
TRIM_AFTER_BYTES = 4 * 2**20  # after a body this large, the parse's peak is handed back to the OS
VERBS = ("filter", "prioritize")

StartResponse = Callable[..., Any]


class _CallbackCounters:
    """Counters whose totals live elsewhere (the cluster source counts its own queries):
    exposed as real Prometheus counters (`_total`, TYPE counter) read at scrape time, so
    rate() and increase() apply and resets are seen as resets."""

    def __init__(self, counters: dict[str, tuple[str, Callable[[], float]]]) -> None:
        self._counters = counters

    def collect(self) -> Iterable[CounterMetricFamily]:
        for name, (documentation, read) in self._counters.items():
            yield CounterMetricFamily(name, documentation, value=read())

    def describe(self) -> Iterable[CounterMetricFamily]:
        for name, (documentation, _read) in self._counters.items():
            yield CounterMetricFamily(name, documentation)


class ExtenderMetrics:
    """The extender's own metrics, in a private registry (no global side effects)."""

    def __init__(self, prometheus_errors: Callable[[], float] | None = None,
                 prometheus_queries: Callable[[], float] | None = None,
                 promises: Callable[[], float] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("gpuwatch_extender_requests", "Extender requests by verb and result.",
                                ["verb", "result"], registry=self.registry)
        self.latency = Histogram("gpuwatch_extender_request_duration_seconds", "Time to answer a verb.",
                                 ["verb"], registry=self.registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
        # counters named without the suffix: CounterMetricFamily appends `_total`
        self.registry.register(_CallbackCounters({
            "gpuwatch_extender_prometheus_errors": ("Failed Prometheus queries since start.",
                                                    prometheus_errors or (lambda: 0.0)),
            "gpuwatch_extender_prometheus_queries": ("Prometheus queries made since start.",
                                                     prometheus_queries or (lambda: 0.0)),
        }))
        self.promised = Gauge("gpuwatch_extender_promises", "Pods with memory promised but not seen yet.",
                              registry=self.registry)
        if promises is not None:
            self.promised.set_function(promises)


class ExtenderApp:
    """WSGI application over one Extender."""

    def __init__(self, extender: Extender, metrics: ExtenderMetrics, url_prefix: str = "",
                 body_bytes_in_flight: int = DEFAULT_BODY_BYTES_IN_FLIGHT) -> None:
        self.extender = extender
        self.metrics = metrics
        self.bodies = ByteSemaphore(body_bytes_in_flight)
        self.prefix = "/" + url_prefix.strip("/") if url_prefix.strip("/") else ""
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        if path in ("/metrics", "/healthz"):
            if method not in ("GET", "HEAD"):
                return self._plain(start_response, 405, f"{path} takes GET", allow="GET, HEAD")
            if path == "/healthz":
                return self._plain(start_response, 200, "ok")
            body = generate_latest(self.metrics.registry)
            start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
            return [body]
        verb = path.rsplit("/", 1)[-1]
        if verb not in VERBS or path != f"{self.prefix}/{verb}":
            return self._plain(start_response, 404, f"unknown path {path[:200]!r}: the verbs are "
                                                    f"{self.prefix}/filter and {self.prefix}/prioritize")
        if method != "POST":
            return self._plain(start_response, 405, f"{verb} takes POST (kube-scheduler's extender call)",
                               allow="POST")
        started = time.perf_counter()
        status, payload, result = self._answer(verb, environ)
        self.metrics.latency.labels(verb).observe(time.perf_counter() - started)
        self.metrics.requests.labels(verb, result).inc()
        data = json.dumps(payload, separators=(",", ":")).encode()
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]

    def _answer(self, verb: str, environ: dict[str, Any]) -> tuple[str, Any, str]:
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return "400 Bad Request", {"Error": "bad Content-Length"}, "bad_request"
        if length <= 0:
            return "400 Bad Request", {"Error": f"{verb} needs a JSON ExtenderArgs body"}, "bad_request"
        if not self.bodies.acquire(length, BODY_WAIT_S):
            return ("503 Service Unavailable", {"Error": "gpuwatch extender: busy parsing other large requests "
                                                "(request bytes in flight at the limit); retry"}, "busy")
        try:
            return self._parse_and_answer(verb, environ, length)
        finally:
            self.bodies.release(length)
            if length >= TRIM_AFTER_BYTES:
                _trim()

    def _parse_and_answer(self, verb: str, environ: dict[str, Any], length: int) -> tuple[str, Any, str]:
        raw = environ["wsgi.input"].read(length)
        try:
            body = parse_json(raw, MAX_JSON_DEPTH)
        except JsonRejected as err:
            return "400 Bad Request", {"Error": f"request {err}"}, "bad_request"
        del raw
        try:
            if verb == "filter":
                result = self.extender.filter(body)
                return "200 OK", result, "error" if result.get("Error") else "ok"
            return "200 OK", self.extender.prioritize(body), "ok"
        except BadRequest as err:
            return "400 Bad Request", {"Error": str(err)}, "bad_request"
        except GpuwatchError as err:  # no usable data: kube-scheduler ignores a failed prioritize
            return "503 Service Unavailable", {"Error": f"gpuwatch extender: {err}"}, "error"
        except Exception as err:  # the service never crashes on input; say what broke, once per kind
            self._log_once(f"{verb}:{type(err).__name__}", f"{verb} failed: {err!r}")
            return "500 Internal Server Error", {"Error": f"internal error: {type(err).__name__}"}, "internal"

    def _log_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._logged or len(self._logged) > 100:
                return
            self._logged.add(key)
        log.exception(message)

    @staticmethod
    def _plain(start_response: StartResponse, code: int, text: str, allow: str | None = None) -> list[bytes]:
        reasons = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}
        data = (text + "\n").encode()
        headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))]
        if allow:
            headers.append(("Allow", allow))
        start_response(f"{code} {reasons[code]}", headers)
        return [data]


def _trim() -> None:
    """Hand freed heap back to the OS (glibc): a large request's parse would otherwise stay in
    the process's RSS for good."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class ExtenderServer:
    """An ExtenderApp on gpuwatch.core.httpserve (waitress with limits) in a background thread
    (`start`/`stop`) or the foreground (`run`)."""

    def __init__(self, app: ExtenderApp, host: str, port: int, *, threads: int = 8, connection_limit: int = 200,
                 channel_timeout_s: int = 30, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 request_timeout_s: int = 60) -> None:
        limits = ServerLimits(threads=threads, connection_limit=connection_limit, backlog=1024,
                              idle_timeout_s=channel_timeout_s, request_timeout_s=request_timeout_s,
                              response_timeout_s=max(60, channel_timeout_s), max_body_bytes=max_body_bytes,
                              max_header_bytes=64 * 1024)
        self.http = BoundedServer(app, host, port, name="gpuwatch-extender", limits=limits)
        self.port = self.http.port
        self.host = host

    @property
    def url(self) -> str:
        return self.http.url

    def run(self) -> None:
        self.http.run()

    def start(self) -> None:
        self.http.start()

    def stop(self) -> None:
        """Close the listener and every open (keep-alive) connection, then the worker threads."""
        self.http.stop()
