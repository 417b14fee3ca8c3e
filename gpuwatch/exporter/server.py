"""HTTP server for the exporter: `/metrics` from a private CollectorRegistry and, when a
snapshot source is given, `/snapshot.json` (so `gpuwatch top` can attach to a running
agent instead of sampling on its own).

`/metrics` is always the Prometheus text format (0.0.4), rendered by
`exposition.render_text` (prometheus_client's format, several times cheaper at node
scale); Prometheus accepts it whatever it prefers. `?format=openmetrics` (or an Accept
header naming only OpenMetrics) goes to prometheus_client's own WSGI app. Served by a
threading wsgiref server in a daemon thread.
The default address is loopback; exposing it (0.0.0.0 in the DaemonSet) is the caller's
explicit choice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from gpuwatch.exporter.exposition import CONTENT_TYPE, render_text
from gpuwatch.model import Snapshot
from gpuwatch.snapshot_doc import dumps as snapshot_document

DEFAULT_ADDRESS = "127.0.0.1"
DEFAULT_PORT = 9400

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds would flood the log; errors surface as metrics."""


def _app(registry: CollectorRegistry, get_snapshot: Callable[[], Snapshot] | None) -> WsgiApp:
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/snapshot.json" and get_snapshot is not None:
            body = snapshot_document(get_snapshot(), indent=None).encode()
            start_response("200 OK", [("Content-Type", "application/json"),
                                      ("Content-Length", str(len(body)))])
            return [body]
        if path in ("/metrics", "/"):
            accept = environ.get("HTTP_ACCEPT", "")
            if "format=openmetrics" in environ.get("QUERY_STRING", "") or (
                    "openmetrics" in accept and "text/plain" not in accept and "*/*" not in accept):
                return metrics_app(environ, start_response)
            body = render_text(registry)
            start_response("200 OK", [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))])
            return [body]
        body = b"not found: try /metrics" + (b" or /snapshot.json" if get_snapshot else b"") + b"\n"
        start_response("404 Not Found", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]

    return app


@dataclass
class ExporterServer:
    """A running exporter; `port` is the bound port (useful with port=0)."""

    address: str
    port: int
    _server: _ThreadingWSGIServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(5.0)
        self._server.server_close()

    shutdown = stop


def serve(collector_registry: CollectorRegistry, address: str = DEFAULT_ADDRESS, port: int = DEFAULT_PORT,
          get_snapshot: Callable[[], Snapshot] | None = None) -> ExporterServer:
    """Serve /metrics (and /snapshot.json) in a daemon thread; returns the running server.

    Raises OSError (e.g. EADDRINUSE) if the address cannot be bound.
    """
    server_class: type[_ThreadingWSGIServer] = _ThreadingWSGIServer
    if ":" in address:
        import socket

        class _V6(_ThreadingWSGIServer):
            address_family = socket.AF_INET6

        server_class = _V6
    httpd = make_server(address, port, _app(collector_registry, get_snapshot),
                        server_class=server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="gpuwatch-exporter", daemon=True)
    thread.start()
    return ExporterServer(address=address, port=httpd.server_port, _server=httpd, _thread=thread)


def registry_for(get_snapshot: Callable[[], Snapshot]) -> CollectorRegistry:
    """A private registry holding only the gpuwatch SnapshotCollector (no process/GC metrics)."""
    from gpuwatch.exporter.collector import SnapshotCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(get_snapshot))
    return registry
