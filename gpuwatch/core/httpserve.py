"""A WSGI app on a waitress server that bounds itself, in a background thread.

The agent's metrics port (0.0.0.0 in the DaemonSet, unauthenticated), its webhook and the
extender all listen with this. waitress (a well-kept pure-Python WSGI server) does the HTTP:
a fixed pool of worker threads (`threads`) that only ever runs complete requests — idle or
half-sent connections wait in its event loop and cost no thread — bodies limited while they
are read (413 past `max_body_bytes`, before the app runs), header size limited (431), and
idle connections closed after `idle_timeout_s`. This module adds what waitress leaves open:

* a **request deadline**: a request (headers and body) must arrive within
  `request_timeout_s` of its first byte — a client that trickles a byte a second, or sends a
  Content-Length longer than its body, is cut off instead of holding a connection for ever;
* a **response deadline**: a client that does not take its answer within
  `response_timeout_s` is disconnected (its buffered answer freed);
* a **connection cap that does not lock out real clients**: at `connection_limit` open
  connections, when a new one is waiting, the connections that have been idle (or stuck in
  an unfinished request) the longest — at least EVICTABLE_AFTER_S — are closed to make
  room: 2,000 idle sockets cannot keep Prometheus out; the rest wait in the listen backlog
  (`backlog`), never a thread each;
* a **budget for unsent answers** (`max_pending_output_bytes`, a quarter of it per client
  address): clients that ask and do not read cannot make the server hold a rendered body
  each — past the budget a request gets 503 (Retry-After) without running the app, and one
  address that does not read does not cost the others their answers;
* logs that cannot be flooded from outside (waitress's per-event warnings are limited to
  one a minute each), and a hook that tells the app's owner about requests waitress refused
  itself (`on_refused("too_large" | "bad_request" | "internal" | "busy")`).

`parse_json` (gpuwatch.core.jsonbounds) reads a request body with a nesting limit, so no input reaches a
RecursionError.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ErrorTask, ThreadedTaskDispatcher

from gpuwatch.core.jsonbounds import JsonRejected, parse_json

__all__ = ["BoundedServer", "ByteSemaphore", "JsonRejected", "ServerLimits", "is_loopback", "parse_json"]

log = logging.getLogger(__name__)

EVICTABLE_AFTER_S = 0.5  # at the connection cap, connections idle this long make room for new ones

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


@dataclass(frozen=True)
class ServerLimits:
    """What one listener may cost. Timeouts are whole seconds (waitress's resolution)."""

    threads: int = 4  # worker threads: requests served at once (complete requests only)
    connection_limit: int = 64  # open connections; more wait in the listen backlog
    backlog: int = 128  # the kernel's queue of not-yet-accepted connections
    idle_timeout_s: int = 30  # a connection with no request in flight and no bytes either way
    request_timeout_s: int = 10  # from a request's first byte to its last
    response_timeout_s: int = 60  # a client must take its answer within this
    max_body_bytes: int = 16 * 1024  # enforced while reading: 413 past it
    max_header_bytes: int = 32 * 1024  # 431 past it
    # answers written but not yet taken by their clients, all connections together: past it,
    # or past a quarter of it for one client address, new requests get 503 without running
    # the app (a client that asks and never reads costs this much at most, not a body each;
    # requests checked at the same moment may each add one answer past it: one per thread)
    max_pending_output_bytes: int = 32 * 2**20

    def __post_init__(self) -> None:
        for name in ("threads", "connection_limit", "backlog", "idle_timeout_s", "request_timeout_s",
                     "response_timeout_s", "max_body_bytes", "max_header_bytes", "max_pending_output_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ServerLimits.{name} must be >= 1")


class _OncePerInterval(logging.Filter):
    """Let a given message template through once per `interval_s` (waitress logs per event:
    "Task queue depth is N", socket errors... — a client could flood the log with them)."""

    def __init__(self, interval_s: float = 60.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        key = str(record.msg)[:200]
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                return False
            if len(self._last) > 200:
                self._last.clear()
            self._last[key] = now
        return True


_FILTER = _OncePerInterval()


def _quiet_waitress() -> None:
    for name in ("waitress", "waitress.queue"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def _refusal_kind(error: Any) -> str:
    name = type(error).__name__
    if name in ("RequestEntityTooLarge", "RequestHeaderFieldsTooLarge"):
        return "too_large"
    if name == "InternalServerError":
        return "internal"
    return "bad_request"


class _ErrorTask(ErrorTask):
    """waitress's own error answer (413, 431, 400, 500), reported to the server's owner first."""

    def execute(self) -> None:
        hook = getattr(self.channel.server, "on_refused", None)
        if hook is not None:
            try:
                hook(_refusal_kind(self.request.error))
            except Exception:  # a counting hook never stops the answer
                log.debug("on_refused hook failed", exc_info=True)
        super().execute()


class _Channel(HTTPChannel):
    error_task_class = _ErrorTask


class _Server(TcpWSGIServer):
    """One listener with deadlines and connection eviction (runs in the event-loop thread)."""

    channel_class = _Channel

    def __init__(self, app: WsgiApp, sock: socket.socket, limits: ServerLimits,
                 on_refused: Callable[[str], None] | None, ident: str) -> None:
        self.limits = limits
        self.on_refused = on_refused
        self.evicted_total = 0
        self.timed_out_total = 0
        self._reading: dict[Any, tuple[Any, float]] = {}  # channel -> (partial request, first seen)
        self._writing: dict[Any, float] = {}  # channel -> first seen with unsent output
        self._last_full_log = 0.0
        self._next_cleanup = 0.0
        self._trigger_lock = threading.Lock()
        self._closing = False
        adj = Adjustments(sockets=[sock], threads=limits.threads, backlog=limits.backlog,
                          connection_limit=limits.connection_limit,  # checked by readable() below
                          channel_timeout=limits.idle_timeout_s, cleanup_interval=1,
                          max_request_body_size=limits.max_body_bytes,
                          max_request_header_size=limits.max_header_bytes,
                          ident=ident, clear_untrusted_proxy_headers=True, log_socket_errors=False,
                          asyncore_use_poll=True,  # select() fails past fd 1023
                          outbuf_overflow=min(limits.max_pending_output_bytes, 4 * 2**20),  # RAM, then a file
                          expose_tracebacks=False)
        dispatcher = ThreadedTaskDispatcher()
        dispatcher.set_thread_count(limits.threads)
        super().__init__(app, {}, True, sock, dispatcher=dispatcher, adj=adj, bind_socket=False,
                         sockinfo=(sock.family, sock.type, sock.proto, sock.getsockname()))

    # -- shutdown --------------------------------------------------------------------------
    def pull_trigger(self) -> None:
        """Wake the event loop from a worker thread, unless the server is closing.

        A worker that finishes a request while stop() tears the loop down would otherwise
        write to the trigger pipe after it is closed: EBADF (a traceback in the log), or worse
        a byte written into whatever file reused that descriptor number."""
        with self._trigger_lock:
            if not self._closing:
                super().pull_trigger()

    def begin_close(self) -> None:
        """From now on workers no longer wake the loop; the trigger can be closed safely."""
        with self._trigger_lock:
            self._closing = True

    # -- deadlines -------------------------------------------------------------------------
    def maintenance(self, now: float) -> None:
        super().maintenance(now)  # idle connections: waitress's channel_timeout
        reading: dict[Any, tuple[Any, float]] = {}
        writing: dict[Any, float] = {}
        for channel in list(self.active_channels.values()):
            partial = channel.request
            if partial is not None and not channel.will_close:
                seen = self._reading.get(channel)
                since = seen[1] if seen is not None and seen[0] is partial else now
                if now - since > self.limits.request_timeout_s:
                    self._cut(channel)
                    continue
                reading[channel] = (partial, since)
            if channel.total_outbufs_len:
                since = self._writing.get(channel, now)
                if now - since > self.limits.response_timeout_s:
                    self._cut(channel)
                    continue
                writing[channel] = since
        self._reading, self._writing = reading, writing

    def _cut(self, channel: Any) -> None:
        self.timed_out_total += 1
        channel.will_close = True
        if channel.total_outbufs_len:
            # will_close is acted on when the socket is writable, which a client that does
            # not read never makes it: close from the event loop's next turn instead
            self.trigger.pull_trigger(lambda: channel.connected and channel.handle_close())

    # -- connection cap ----------------------------------------------------------------------
    def readable(self) -> bool:
        now = time.time()
        if now >= self._next_cleanup:
            self._next_cleanup = now + self.adj.cleanup_interval
            self.maintenance(now)
        if not self.accepting:
            return False
        if len(self.active_channels) < self.limits.connection_limit:
            return True
        self._make_room(now)
        return False

    def _make_room(self, now: float) -> None:
        """At the cap with a connection waiting: close the ones idle (or stuck mid-request)
        the longest. Connections with a request being served or an answer being sent stay."""
        channels = list(self.active_channels.values())
        if any(c.will_close or c.close_when_flushed for c in channels) or not self._connection_waiting():
            return
        candidates = []
        for channel in channels:
            if channel.requests or channel.total_outbufs_len:
                continue
            if channel.request is not None:
                seen = self._reading.get(channel)
                since = seen[1] if seen is not None and seen[0] is channel.request else now
            else:
                since = channel.last_activity
            if now - since >= EVICTABLE_AFTER_S:  # a fresh connection is being read, not idle
                candidates.append((since, id(channel), channel))
        candidates.sort(key=lambda item: (item[0], item[1]))
        for _, _, channel in candidates[: max(1, self.limits.connection_limit // 4)]:
            channel.will_close = True
            self.evicted_total += 1
        if candidates and now - self._last_full_log > 60:
            self._last_full_log = now
            log.warning("%s: %d open connections (the limit): closing the longest-idle ones for new "
                        "clients (%d closed so far)", self.adj.ident, len(channels), self.evicted_total)

    def _connection_waiting(self) -> bool:
        try:
            poller = select.poll()
            poller.register(self.socket.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return False


class ByteSemaphore:
    """Bytes of request bodies in flight, all requests together: a request holds its body's
    length from reading it until its answer is built (the parsed body is many times the raw
    bytes), so N concurrent large bodies cannot take the process past its memory limit; a
    request that cannot get its bytes within `wait_s` is refused (the caller answers 503)."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("a byte semaphore must be >= 1")
        self.total = total
        self._free = total
        self._cond = threading.Condition()

    def acquire(self, count: int, wait_s: float) -> bool:
        """Take `count` bytes (at most `total`), waiting up to `wait_s`; False when not granted."""
        count = min(count, self.total)
        deadline = time.monotonic() + wait_s
        with self._cond:
            while self._free < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            self._free -= count
            return True

    def release(self, count: int) -> None:
        with self._cond:
            self._free = min(self.total, self._free + min(count, self.total))
            self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        return self.total - self._free


def _bind(host: str, port: int) -> socket.socket:
    """One listening socket for host:port (the first address host resolves to)."""
    infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    family, socktype, proto, _, address = infos[0]
    sock = socket.socket(family, socktype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def is_loopback(address: str) -> bool:
    """Whether a numeric address (IPv4, IPv6, IPv4-mapped IPv6) is a loopback address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(mapped.is_loopback if mapped is not None else ip.is_loopback)


def http_url(host: str, port: int) -> str:
    """http://host:port, an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class BoundedServer:
    """A WSGI app served by waitress with ServerLimits: `start()`/`stop()` in a daemon thread,
    or `run()` in the foreground. Binding happens in the constructor (OSError if it cannot)."""

    def __init__(self, app: WsgiApp, host: str, port: int, *, name: str, limits: ServerLimits | None = None,
                 on_refused: Callable[[str], None] | None = None) -> None:
        _quiet_waitress()
        self.name = name
        self.limits = limits or ServerLimits()
        self.busy_total = 0
        self._app = app
        self._on_refused = on_refused
        sock = _bind(host, port)
        try:
            self.server = _Server(self._guarded, sock, self.limits, on_refused, ident=name)
        except Exception:
            sock.close()
            raise
        bound = sock.getsockname()
        self.address = str(bound[0])
        self.port = int(bound[1])
        self.host = host
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    @property
    def loopback(self) -> bool:
        """Whether the listener is on a loopback address (only this host can connect)."""
        return is_loopback(self.address)

    @property
    def evicted_total(self) -> int:
        return int(self.server.evicted_total)

    @property
    def timed_out_total(self) -> int:
        return int(self.server.timed_out_total)

    def open_connections(self) -> int:
        return len(self.server.active_channels)

    def pending_output_bytes(self, peer: str | None = None) -> int:
        """Bytes of answers written and not yet sent, all connections together (or one
        client address's)."""
        return sum(int(c.total_outbufs_len) for c in list(self.server.active_channels.values())
                   if peer is None or (c.addr and c.addr[0] == peer))

    def _over_budget(self, peer: str) -> bool:
        total = mine = 0
        for channel in list(self.server.active_channels.values()):
            pending = int(channel.total_outbufs_len)
            total += pending
            if channel.addr and channel.addr[0] == peer:
                mine += pending
        budget = self.limits.max_pending_output_bytes
        return total > budget or mine > budget // 4

    def _guarded(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if self._over_budget(str(environ.get("REMOTE_ADDR", ""))):
            self.busy_total += 1
            if self._on_refused is not None:
                try:
                    self._on_refused("busy")
                except Exception:
                    log.debug("on_refused hook failed", exc_info=True)
            body = b"busy: earlier answers have not been taken by their clients yet; retry\n"
            start_response("503 Service Unavailable", [("Content-Type", "text/plain; charset=utf-8"),
                                                       ("Content-Length", str(len(body))), ("Retry-After", "1")])
            return [body]
        return self._app(environ, start_response)

    def run(self) -> None:
        self.server.run()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.server.run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close the listener and every open (keep-alive) connection, then the worker threads
        (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        server = self.server

        def close_all() -> None:  # runs in the event-loop thread, where the channel map lives
            for dispatcher in list(server._map.values()):
                dispatcher.close()

        if self._thread is not None and self._thread.is_alive():
            try:
                server.begin_close()
                server.trigger.pull_trigger(close_all)
            except OSError:  # the loop is already closing its channels (trigger gone): finish here
                with contextlib.suppress(OSError):
                    server.close()
            self._thread.join(5)
            self._thread = None
        else:
            server.begin_close()
            with contextlib.suppress(OSError):
                server.close()
        server.task_dispatcher.shutdown(timeout=5)
