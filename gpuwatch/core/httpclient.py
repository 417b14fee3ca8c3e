"""The one HTTP client for answers gpuwatch did not write: bounded in bytes, time and depth.

Every client read of another server's answer goes through `BoundedHttpClient` (the
extender's Prometheus queries and its worker, `top --prometheus`, `top --agent`), because a
server that answers 200 and then never stops -- endless whitespace, a byte a second,
JSON nested a million deep -- must cost a bounded amount:

* **bytes**: the answer is streamed in chunks and refused (`HttpTooLarge`) past
  `max_bytes`, or at once when its Content-Length says it would be; a `ByteBudget` shared
  by concurrent requests (one Prometheus batch) bounds what they hold together;
* **time**: one deadline per request, `timeout_s` from its start, bounds connecting,
  sending, the status line, headers and body together. Socket timeouts are per operation
  (a byte a second never trips them), so a watchdog thread shuts the socket down at the
  deadline and the blocked read returns at once (`HttpTimeout`);
* **depth**: `get_json` / `post_json` parse with `gpuwatch.core.jsonbounds` (`max_depth`).

Connections are kept alive and reused (a small pool; http.client underneath, stdlib only),
except after a failure or when the server asks to close. Errors are typed
(`HttpUnreachable`, `HttpTimeout`, `HttpTooLarge`, `HttpBadAnswer`) and never quote more
than a short, escaped snippet of what the server sent.
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import itertools
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gpuwatch.core.jsonbounds import JsonRejected, parse_json

DEFAULT_MAX_BYTES = 32 * 2**20
"""Per answer. The largest answer at 1,000 nodes x 8 GPUs is top's per-container series with
4 tenants per GPU, ~9.6 MiB (pair scores ~5.3 MiB, a per-GPU series ~0.7 MiB): 3x headroom."""
DEFAULT_MAX_DEPTH = 32
"""Prometheus' answers are 5 deep, an agent's /snapshot.json under 10."""
CHUNK_BYTES = 64 * 1024
SNIPPET_CHARS = 120


class HttpClientError(Exception):
    """Base of the client's errors; `str()` is one line naming the URL and what went wrong."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.url = url


class HttpUnreachable(HttpClientError):
    """No HTTP exchange: refused, DNS, TLS, reset before an answer."""


class HttpTimeout(HttpClientError):
    """No complete answer within the request's deadline."""


class HttpTooLarge(HttpClientError):
    """The answer is (or would be) more than the byte cap."""


class HttpBadAnswer(HttpClientError):
    """An answer that is not what was asked for: not JSON, too deep, malformed HTTP."""


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    headers: Mapping[str, str]  # lower-case names
    body: bytes

    def snippet(self) -> str:
        """The start of the body, escaped, for an error message."""
        text = self.body[:SNIPPET_CHARS].decode("utf-8", "replace").strip()
        return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


class ByteBudget:
    """Bytes that several reads may hold together (one Prometheus batch: its answers are all
    held until parsed); a read that would go past it fails, never waits (readers each waiting
    for the others' bytes would deadlock). `give` returns bytes to it."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("a byte budget must be >= 1")
        self.total = total
        self._used = 0
        self._lock = threading.Lock()

    def take(self, count: int) -> bool:
        with self._lock:
            if self._used + count > self.total:
                return False
            self._used += count
            return True

    def give(self, count: int) -> None:
        with self._lock:
            self._used = max(0, self._used - count)

    @property
    def used(self) -> int:
        return self._used


class _Watchdog:
    """One daemon thread that shuts sockets down at their deadlines (lazily started)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, socket.socket]] = []
        self._armed: set[int] = set()
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, sock: socket.socket) -> int:
        with self._cond:
            ident = next(self._ids)
            heapq.heappush(self._heap, (deadline, ident, sock))
            self._armed.add(ident)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpuwatch-http-deadline", daemon=True)
                self._thread.start()
            self._cond.notify()
            return ident

    def disarm(self, ident: int) -> None:
        """After this returns the socket is never shut down by the watchdog."""
        with self._cond:
            self._armed.discard(ident)

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._armed:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, ident, sock = self._heap[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                self._armed.discard(ident)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


_WATCHDOG = _Watchdog()


class BoundedHttpClient:
    """Requests to one base URL (``http(s)://host:port/prefix``) with a deadline and a byte
    cap each. Thread-safe; `close()` drops the pooled connections."""

    def __init__(self, base_url: str, timeout_s: float, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_depth: int = DEFAULT_MAX_DEPTH, headers: Mapping[str, str] | None = None,
                 pool_size: int = 8) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{base_url!r} is not an http(s) URL")
        if not timeout_s > 0 or max_bytes < 1 or max_depth < 1:
            raise ValueError("timeout_s, max_bytes and max_depth must be positive")
        self.base_url = base_url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_depth = max_depth
        self._headers = dict(headers or {})
        self._pool: list[http.client.HTTPConnection] = []
        self._pool_size = pool_size
        self._lock = threading.Lock()

    # ---- public -------------------------------------------------------------------------

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: Mapping[str, str] | None = None, *, budget: ByteBudget | None = None,
                deadline: float | None = None) -> HttpAnswer:
        """One exchange within `timeout_s` (or by `deadline`, a time.monotonic() value, when
        that is sooner: one deadline for a batch of requests), its body at most `max_bytes`
        (and within `budget`)."""
        url = self.base_url + path
        own = time.monotonic() + self.timeout_s
        deadline = own if deadline is None else min(deadline, own)
        if time.monotonic() >= deadline:
            raise self._timeout(url)
        all_headers = {**self._headers, **(headers or {})}
        for attempt in (0, 1):
            conn, reused = self._take()
            try:
                answer = self._exchange(conn, method, self._prefix + path, body, all_headers, deadline, url, budget)
            except _StaleConnection:
                conn.close()
                if attempt == 0 and reused and time.monotonic() < deadline:
                    continue  # the server closed a kept-alive connection: once more on a fresh one
                raise HttpUnreachable(f"{url}: the connection was closed before an answer", url) from None
            except BaseException:
                conn.close()
                raise
            return answer
        raise AssertionError("unreachable")

    def get_json(self, path: str, *, budget: ByteBudget | None = None) -> tuple[HttpAnswer, Any]:
        """GET and parse; (answer, document). HttpBadAnswer when the body is not JSON within `max_depth`."""
        answer = self.request("GET", path, headers={"Accept": "application/json"}, budget=budget)
        return answer, self.decode(answer, self.base_url + path)

    def decode(self, answer: HttpAnswer, url: str) -> Any:
        try:
            return parse_json(answer.body, self.max_depth)
        except JsonRejected as err:
            raise HttpBadAnswer(f"{url} answered HTTP {answer.status} with a document that is not usable JSON "
                                f"({err}): {answer.snippet()!r}", url) from err

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, []
        for conn in pool:
            conn.close()

    # ---- internals ----------------------------------------------------------------------

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._pool:
                return self._pool.pop(), True
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self.timeout_s), False

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._pool) < self._pool_size:
                self._pool.append(conn)
                return
        conn.close()

    def _exchange(self, conn: http.client.HTTPConnection, method: str, target: str, body: bytes | None,
                  headers: dict[str, str], deadline: float, url: str, budget: ByteBudget | None) -> HttpAnswer:
        fresh = conn.sock is None
        if fresh:
            conn.timeout = max(0.001, deadline - time.monotonic())
            try:
                conn.connect()
            except TimeoutError:
                raise HttpTimeout(f"{url}: no connection within {self.timeout_s:g}s", url) from None
            except OSError as err:
                raise HttpUnreachable(f"{url} unreachable: {err.strerror or err}", url) from None
        sock = conn.sock
        assert sock is not None
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        guard = _WATCHDOG.arm(deadline, sock)
        try:
            try:
                conn.request(method, target, body=body, headers=headers)
                response = conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as err:
                if not fresh and time.monotonic() < deadline:
                    raise _StaleConnection() from err
                raise self._failed(err, deadline, url) from None
            except (OSError, http.client.HTTPException) as err:
                raise self._failed(err, deadline, url) from None
            length = response.getheader("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) > self.max_bytes:
                raise HttpTooLarge(f"{url} answered {int(length)} bytes, more than the {self.max_bytes}-byte "
                                   "limit", url)
            chunks: list[bytes] = []
            total = 0
            while True:
                try:
                    chunk = response.read1(CHUNK_BYTES)
                except (OSError, http.client.HTTPException) as err:
                    raise self._failed(err, deadline, url) from None
                if not chunk:
                    if time.monotonic() >= deadline:  # shut down by the watchdog mid-body
                        raise self._timeout(url)
                    break
                total += len(chunk)
                if total > self.max_bytes:
                    raise HttpTooLarge(f"{url} answered more than the {self.max_bytes}-byte limit "
                                       "(the answer was cut off)", url)
                if budget is not None and not budget.take(len(chunk)):
                    raise HttpTooLarge(f"{url}: the answers of this batch together are more than "
                                       f"{budget.total} bytes (the answer was cut off)", url)
                chunks.append(chunk)
                if time.monotonic() >= deadline:
                    raise self._timeout(url)
        finally:
            _WATCHDOG.disarm(guard)
        answer = HttpAnswer(response.status, {k.lower(): v for k, v in response.getheaders()}, b"".join(chunks))
        response.close()  # read to its end: the connection may send the next request
        if response.will_close:
            conn.close()
        else:
            sock.settimeout(self.timeout_s)
            self._give(conn)
        return answer

    def _timeout(self, url: str) -> HttpTimeout:
        return HttpTimeout(f"{url}: no complete answer within {self.timeout_s:g}s", url)

    def _failed(self, err: BaseException, deadline: float, url: str) -> HttpClientError:
        if time.monotonic() >= deadline or isinstance(err, TimeoutError):
            return self._timeout(url)
        if isinstance(err, http.client.HTTPException) and not isinstance(err, http.client.RemoteDisconnected):
            return HttpBadAnswer(f"{url} answered malformed HTTP ({type(err).__name__})", url)
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        return HttpUnreachable(f"{url} unreachable: {reason}", url)


class _StaleConnection(Exception):
    """A kept-alive connection the server had closed: retried once on a fresh one."""
