"""A small reader of Prometheus' HTTP API: one batch of instant queries per cycle, cached.

The Prometheus query API is plain JSON over HTTP (``POST /api/v1/query`` with a
form-encoded ``query``), so this is `gpuwatch.core.httpclient` (bounded: every answer streamed
under a byte cap and one deadline, JSON under a depth limit), not a Prometheus client library
(those pull pandas and matplotlib). One `PrometheusReader` serves one consumer process
(the scheduler extender, `gpuwatch top --prometheus`):

* `query_batch({name: promql})` runs every query of one cycle concurrently on a small
  thread pool, the whole batch bounded by ``timeout_s`` (client side, from connect to the
  last byte of every answer, and Prometheus' own ``timeout`` parameter so the server stops
  evaluating too),
  each answer by ``max_bytes`` and the batch's answers together by ``2 * max_bytes``, and
  returns ``{name: [Sample, ...]}``.
* The whole batch result is cached for ``cache_s``: the same query set asked again within
  that time costs no HTTP at all. Concurrent callers during a refresh wait for that one
  refresh. A failed batch is remembered for ``cache_s`` too, so N callers waiting on a
  dead Prometheus see one timeout, not N in a row.
* Any failure raises a `PrometheusError` (a `GpuwatchError`) whose message names the
  URL and the query and whose ``fix`` says what to check; partial batches are never
  returned (a consumer must not schedule on half the cluster).

Counters (``queries_total``, ``errors_total``, ``batches_total``, ``cache_hits_total``,
``last_batch_seconds``) are plain attributes for the consumer to export.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlencode, urlsplit

from gpuwatch.core.errors import GpuwatchError
from gpuwatch.core.httpclient import (
    DEFAULT_MAX_BYTES,
    BoundedHttpClient,
    ByteBudget,
    HttpBadAnswer,
    HttpTimeout,
    HttpTooLarge,
    HttpUnreachable,
)

MAX_WORKERS = 8
"""Queries in flight at once. A cycle's batch is ~20 queries; Prometheus evaluates each on
its own goroutine, so a few parallel requests cut the batch's wall time without flooding it."""

MAX_JSON_DEPTH = 16
"""Prometheus' query answers are 5 deep."""


class Sample(NamedTuple):
    """One series of an instant-query result: its labels, value and sample timestamp.

    ``timestamp_s`` is what Prometheus returns with the value: the query's evaluation time
    for an instant vector (use PromQL ``timestamp(...)`` for when a sample was scraped).
    Values are floats as Prometheus writes them ("NaN", "+Inf" included).
    """

    labels: dict[str, str]
    value: float
    timestamp_s: float


Results = dict[str, list[Sample]]


class PrometheusError(GpuwatchError):
    """Reading the cluster from Prometheus failed; `message` names the URL (and query)."""

    def __init__(self, message: str, fix: str = "", url: str = "", query: str = "") -> None:
        super().__init__(message, fix)
        self.url = url
        self.query = query


class PrometheusUnreachable(PrometheusError):
    """No HTTP answer: connection refused, DNS, TLS, reset."""


class PrometheusTimeout(PrometheusError):
    """No complete answer within the reader's timeout."""


class PrometheusQueryError(PrometheusError):
    """Prometheus answered with ``status: error`` (bad PromQL, execution failure, overload)."""


class PrometheusResponseError(PrometheusError):
    """An answer that is not the Prometheus API: HTTP error status, non-JSON, unexpected shape."""


FIX_URL = ("check that Prometheus runs and the URL (scheme, host, port, path prefix) is right, "
           "e.g. http://prometheus.monitoring:9090")
FIX_SLOW = "Prometheus is overloaded or far away: raise the timeout, or check its query latency"
FIX_QUERY = "check the Prometheus version (2.x API) and that the gpuwatch queries are valid PromQL there"
FIX_TOO_LARGE = ("the answer is larger than --prometheus-max-bytes: raise it for a very large cluster, or "
                 "check that the URL is Prometheus itself")
FIX_NOT_API = ("the URL does not answer like the Prometheus HTTP API: point it at Prometheus itself "
               "(not Grafana or a login proxy), including any --web.route-prefix")


@dataclass(frozen=True)
class _Outcome:
    key: tuple[tuple[str, str], ...]
    at_s: float
    results: Results | None = None
    error: PrometheusError | None = None


class PrometheusReader:
    """Instant queries against one Prometheus, batched, concurrent and briefly cached.

    ``url`` is Prometheus' base URL (``http://host:9090`` or with a route prefix,
    ``http://host/prometheus``). ``headers`` are sent with every request (e.g. an
    ``Authorization`` header for a proxy in front of Prometheus). ``clock`` is only used for
    the cache's age (inject a fake one in tests). Thread-safe; `close()` releases the
    connection pool and the worker threads.
    """

    def __init__(self, url: str, timeout_s: float = 2.0, cache_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, headers: Mapping[str, str] | None = None,
                 max_workers: int = MAX_WORKERS, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise PrometheusError(f"Prometheus URL {url!r} is not an http(s) URL",
                                  fix="pass the base URL, e.g. http://prometheus.monitoring:9090", url=url)
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.cache_s = cache_s
        self._clock = clock
        self.max_bytes = max_bytes
        self._max_workers = max(1, max_workers)
        self._http = BoundedHttpClient(self.url, timeout_s, max_bytes=max_bytes, max_depth=MAX_JSON_DEPTH,
                                       headers={"Accept": "application/json", **(headers or {})},
                                       pool_size=self._max_workers)
        self._pool: ThreadPoolExecutor | None = None
        self._refresh = threading.Lock()  # one batch in flight; waiters then read its outcome
        self._counts = threading.Lock()
        self._last: _Outcome | None = None
        self._closed = False
        self.queries_total = 0
        self.errors_total = 0
        self.batches_total = 0
        self.cache_hits_total = 0
        self.last_batch_seconds = 0.0

    # ---- public -------------------------------------------------------------------------

    def query_batch(self, queries: Mapping[str, str]) -> Results:
        """``{name: promql}`` -> ``{name: [Sample, ...]}``, every query evaluated now (or
        the cached batch when the same set was read less than ``cache_s`` ago).

        Raises `PrometheusError` (the first failure of the batch) when any query fails.
        The lists are shared with the cache: read them, do not mutate them.
        """
        key = tuple(sorted(queries.items()))
        with self._refresh:
            last = self._last
            if last is not None and last.key == key and self._clock() - last.at_s < self.cache_s:
                with self._counts:
                    self.cache_hits_total += 1
                if last.error is not None:
                    raise last.error
                assert last.results is not None
                return dict(last.results)
            started = time.monotonic()
            try:
                results = self._run(dict(queries))
            except PrometheusError as err:
                self._last = _Outcome(key, self._clock(), error=err)
                raise
            finally:
                self.last_batch_seconds = time.monotonic() - started
                self.batches_total += 1
            self._last = _Outcome(key, self._clock(), results=results)
            return dict(results)

    def query(self, promql: str) -> list[Sample]:
        """One instant query, uncached (errors name the query by its first 60 characters)."""
        return self._query_one(repr(promql[:60]), promql, None, None)

    def close(self) -> None:
        """Release the worker threads and the pooled connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> PrometheusReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------

    def _run(self, queries: dict[str, str]) -> Results:
        if not queries:
            return {}
        if self._closed:
            raise PrometheusError("the Prometheus reader is closed", fix="create a new PrometheusReader",
                                  url=self.url)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="gpuwatch-prom")
        budget = ByteBudget(2 * self.max_bytes)  # the batch's answers are all held until parsed
        deadline = time.monotonic() + self.timeout_s  # one deadline for the batch, queued queries included
        futures: dict[Future[list[Sample]], str] = {
            self._pool.submit(self._query_one, name, promql, budget, deadline): name
            for name, promql in queries.items()}
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for future in pending:
            future.cancel()  # not started yet: the batch has failed already
        wait(pending)  # the running ones end within the timeout; then no thread of this batch is left
        failed = [f for f in futures if not f.cancelled() and f.exception() is not None]
        if failed:
            # the first failing query in the caller's order, so the message is deterministic
            order = {name: i for i, name in enumerate(queries)}
            first = min(failed, key=lambda f: order[futures[f]])
            error = first.exception()
            if isinstance(error, PrometheusError):
                raise error
            raise PrometheusError(f"query {futures[first]} to Prometheus at {self.url} failed: {error!r}",
                                  fix=FIX_URL, url=self.url, query=futures[first]) from error
        return {name: future.result() for future, name in futures.items()}

    def _count(self, error: bool) -> None:
        with self._counts:
            self.queries_total += 1
            if error:
                self.errors_total += 1

    def _query_one(self, name: str, promql: str, budget: ByteBudget | None,
                   deadline: float | None) -> list[Sample]:
        try:
            samples = self._post(name, promql, budget, deadline)
        except PrometheusError:
            self._count(error=True)
            raise
        self._count(error=False)
        return samples

    def _post(self, name: str, promql: str, budget: ByteBudget | None, deadline: float | None) -> list[Sample]:
        fields = {"query": promql, "timeout": f"{max(1, round(self.timeout_s * 1000))}ms"}
        body = urlencode(fields).encode()
        try:
            answer = self._http.request("POST", "/api/v1/query", body,
                                        {"Content-Type": "application/x-www-form-urlencoded"}, budget=budget,
                                        deadline=deadline)
        except HttpTimeout as err:
            raise PrometheusTimeout(
                f"Prometheus at {self.url} did not answer query {name} within {self.timeout_s:g}s",
                fix=FIX_SLOW, url=self.url, query=name) from err
        except HttpTooLarge as err:
            raise PrometheusResponseError(f"Prometheus at {self.url} answered query {name} with too much: "
                                          f"{_after_url(err)}", fix=FIX_TOO_LARGE, url=self.url, query=name) from err
        except HttpBadAnswer as err:
            raise PrometheusResponseError(f"Prometheus at {self.url} answered query {name}: {_after_url(err)}",
                                          fix=FIX_NOT_API, url=self.url, query=name) from err
        except HttpUnreachable as err:
            raise PrometheusUnreachable(f"Prometheus at {self.url} unreachable: {_reason(err)}",
                                        fix=FIX_URL, url=self.url, query=name) from err
        why = "not an object"
        try:
            document = self._http.decode(answer, self.url + "/api/v1/query")
        except HttpBadAnswer as err:
            document, why = None, str(err.__cause__ or "") or "not JSON"
        body_doc = document if isinstance(document, dict) else None
        if body_doc is None:
            raise PrometheusResponseError(
                f"Prometheus at {self.url} answered query {name} with HTTP {answer.status} and "
                f"non-JSON ({answer.headers.get('content-type', 'no content type')}; {why}): {answer.snippet()!r}",
                fix=FIX_NOT_API, url=self.url, query=name)
        if body_doc.get("status") == "error" or answer.status != 200:
            api_error = str(body_doc.get("error") or f"HTTP {answer.status}")[:300]
            error_type = body_doc.get("errorType")
            kind = f" ({str(error_type)[:40]})" if error_type else ""
            fix = FIX_SLOW if error_type in ("timeout", "canceled", "unavailable") else FIX_QUERY
            if body_doc.get("status") != "error":
                raise PrometheusResponseError(
                    f"Prometheus at {self.url} answered query {name} with HTTP {answer.status}",
                    fix=FIX_NOT_API, url=self.url, query=name)
            raise PrometheusQueryError(f"query {name} failed at Prometheus {self.url}{kind}: {api_error}",
                                       fix=fix, url=self.url, query=name)
        try:
            return _samples(body_doc["data"])
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise PrometheusResponseError(
                f"Prometheus at {self.url} answered query {name} with an unexpected document: {str(err)[:200]}",
                fix=FIX_NOT_API, url=self.url, query=name) from err


def _samples(data: dict[str, Any]) -> list[Sample]:
    """The `data` member of a successful answer -> samples (vector or scalar results)."""
    kind = data["resultType"]
    result = data["result"]
    if kind == "vector":
        return [Sample(item["metric"], float(item["value"][1]), float(item["value"][0])) for item in result]
    if kind == "scalar":
        return [Sample({}, float(result[1]), float(result[0]))]
    raise ValueError(f"resultType {kind!r}: the cluster queries are instant vectors (no range selectors)")


def _after_url(err: HttpTooLarge | HttpBadAnswer) -> str:
    """The client's message without its leading URL (the caller names Prometheus itself)."""
    text = str(err)
    return text[len(err.url):].lstrip(": ") if text.startswith(err.url) else text


def _reason(err: HttpUnreachable) -> str:
    """The cause of an unreachable server, in a few words ("Connection refused")."""
    text = str(err)
    marker = " unreachable: "
    return text.split(marker, 1)[1] if marker in text else text
