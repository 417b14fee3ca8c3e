"""HTTP server for the exporter: `/metrics` from a private CollectorRegistry and, when a
snapshot source is given and the listener is on loopback (or `snapshot_remote`),
`/snapshot.json` (so `gpuwatch top` can attach to a running agent instead of sampling on
its own).

`/metrics` is always the Prometheus text format (0.0.4), rendered by
`exposition.render_text` (prometheus_client's format, several times cheaper at node
scale); Prometheus accepts it whatever it prefers. `?format=openmetrics` (or an Accept
header naming only OpenMetrics) goes to prometheus_client's own WSGI app.

Served by gpuwatch.core.httpserve (waitress with limits, METRICS_LIMITS): a few worker threads
whatever the number of connections, idle/request/response deadlines, a connection cap
that closes the longest-idle connections for new clients, bodies limited while read
(no endpoint here takes one). GET and HEAD only: other methods get 405 with Allow.
`/healthz` (liveness: the sampling loop finished a cycle recently) and `/readyz` (the first
cycle is done) answer 200 or 503 with a one-line reason when a `health` judge is given
(gpuwatch.exporter.liveness); the DaemonSet's probes use them.
The default address is loopback; exposing it (0.0.0.0 in the DaemonSet) is the caller's
explicit choice, and then serves the metrics only: /snapshot.json carries host pids,
process names, cgroup paths and pod UIDs, so a non-loopback listener answers it 403
unless the caller passes snapshot_remote=True (`gpuwatch agent --snapshot-remote`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.registry import CollectorRegistry

from gpuwatch.core.httpserve import BoundedServer, ServerLimits, http_url
from gpuwatch.core.model import Snapshot
from gpuwatch.exporter.exposition import CONTENT_TYPE, render_text
from gpuwatch.exporter.liveness import LoopHealth

DEFAULT_ADDRESS = "127.0.0.1"
DEFAULT_PORT = 9400
# Prometheus (an HA pair), the kubelet's probe and a few `top --agent` need a handful of
# connections; rendering is CPU-bound under the GIL, so more threads would not scrape faster.
# An open connection costs a few kB and no thread: 256 lets the longest-idle be closed fast
# enough under a flood that a scrape gets through in about a second (2,000 idle sockets).
# Unsent answers are capped at 32 MiB in all: a client that asks and never reads holds a
# body until the 30 s response deadline, and past the cap new requests get 503 unrendered.
METRICS_LIMITS = ServerLimits(threads=4, connection_limit=256, backlog=128, idle_timeout_s=30,
                              request_timeout_s=10, response_timeout_s=30, max_body_bytes=16 * 1024,
                              max_header_bytes=32 * 1024, max_pending_output_bytes=32 * 2**20)
ALLOW = "GET, HEAD"

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

_REASONS = {200: "OK", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


def _plain(start_response: StartResponse, code: int, text: str, allow: str | None = None) -> list[bytes]:
    body = (text + "\n").encode()
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
    if allow:
        headers.append(("Allow", allow))
    start_response(f"{code} {_REASONS[code]}", headers)
    return [body]


def _app(registry: CollectorRegistry, get_snapshot: Callable[[], Snapshot] | None,
         serve_snapshot: bool, health: LoopHealth | None = None) -> WsgiApp:

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        known = path in ("/metrics", "/") or (path == "/snapshot.json" and get_snapshot is not None) or (
            path in ("/healthz", "/readyz") and health is not None)
        if not known:
            hint = "/metrics" + (" or /snapshot.json" if get_snapshot is not None and serve_snapshot else "")
            return _plain(start_response, 404, f"not found: try {hint}")
        if method not in ("GET", "HEAD"):
            return _plain(start_response, 405, f"{path} takes GET", allow=ALLOW)
        if path in ("/healthz", "/readyz"):
            assert health is not None
            verdict = health.live() if path == "/healthz" else health.ready()
            return _plain(start_response, 200 if verdict.ok else 503, verdict.reason)
        if path == "/snapshot.json":
            assert get_snapshot is not None
            if not serve_snapshot:
                return _plain(start_response, 403, "/snapshot.json (host pids, process names, cgroup paths) is "
                              "served on loopback listeners only; start the agent with --snapshot-remote "
                              "to serve it here")
            from gpuwatch.core.snapshot_doc import dumps as snapshot_document  # only for this endpoint (RSS)

            body = snapshot_document(get_snapshot(), indent=None).encode()
            start_response("200 OK", [("Content-Type", "application/json"),
                                      ("Content-Length", str(len(body)))])
            return [body]
        accept = environ.get("HTTP_ACCEPT", "")
        if "format=openmetrics" in environ.get("QUERY_STRING", "") or (
                "openmetrics" in accept and "text/plain" not in accept and "*/*" not in accept):
            from prometheus_client.exposition import make_wsgi_app

            return make_wsgi_app(registry)(environ, start_response)
        body = render_text(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))])
        return [body]

    return app


class ExporterServer:
    """A running exporter; `port` is the bound port (useful with port=0)."""

    def __init__(self, server: BoundedServer, address: str, serves_snapshot: bool) -> None:
        self._server = server
        self.address = address
        self.port = server.port
        self.serves_snapshot = serves_snapshot

    @property
    def url(self) -> str:
        return http_url(self.address, self.port)

    @property
    def http(self) -> BoundedServer:
        """The underlying server (limits, open connections, evictions, timeouts)."""
        return self._server

    def stop(self) -> None:
        """Stop serving, close every connection and release the port (idempotent)."""
        self._server.stop()

    shutdown = stop


def serve(collector_registry: CollectorRegistry, address: str = DEFAULT_ADDRESS, port: int = DEFAULT_PORT,
          get_snapshot: Callable[[], Snapshot] | None = None, *, snapshot_remote: bool = False,
          limits: ServerLimits = METRICS_LIMITS, health: LoopHealth | None = None) -> ExporterServer:
    """Serve /metrics (and /snapshot.json) in a daemon thread; returns the running server.

    /snapshot.json is served when `get_snapshot` is given and the listener is on loopback, or
    anywhere with `snapshot_remote`; /healthz and /readyz when `health` is given. Raises
    OSError (e.g. EADDRINUSE) if the address cannot be bound.
    """
    holder: dict[str, WsgiApp] = {}

    def dispatch(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        return holder["app"](environ, start_response)

    server = BoundedServer(dispatch, address, port, name="gpuwatch-exporter", limits=limits)
    serves_snapshot = get_snapshot is not None and (snapshot_remote or server.loopback)
    holder["app"] = _app(collector_registry, get_snapshot, serves_snapshot, health)
    server.start()
    return ExporterServer(server, address, serves_snapshot)


def registry_for(get_snapshot: Callable[[], Snapshot]) -> CollectorRegistry:
    """A private registry holding only the gpuwatch SnapshotCollector (no process/GC metrics)."""
    from gpuwatch.exporter.collector import SnapshotCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(get_snapshot))
    return registry
