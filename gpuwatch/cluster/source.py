"""The cluster view from a live Prometheus, for placement decisions (the extender).

A refresh is one batch of instant queries (`placement_queries` plus the pods placed moments
ago; every `static_every_s` also GPU sizes and pair scores) turned into a ClusterState by
`refresher.refresh` -- in a worker process by default, so parsing thousands of series
neither stalls requests on the GIL nor leaves its memory peak in the server. Serving:

* a view younger than `cache_s` (1 s) is served as is: one refresh per scheduling burst;
* a view younger than `revalidate_s` (10 s) is served while one background refresh runs
  (stale-while-revalidate): a request never waits for Prometheus once the extender is warm;
* older (or none yet): the request refreshes synchronously (bounded by the reader's
  timeout) and a failure raises (filter turns it into its Error field).
A background refresh that fails is logged once and leaves the view to age into the
synchronous path, so a Prometheus outage shows up as errors within `revalidate_s`.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from gpuwatch.cluster import refresher
from gpuwatch.cluster.prometheus import PrometheusError, PrometheusTimeout
from gpuwatch.cluster.values import ClusterState
from gpuwatch.core.httpclient import DEFAULT_MAX_BYTES

log = logging.getLogger(__name__)


class PrometheusCluster:
    """`state(pod_uids)` -> a recent ClusterState (raises PrometheusError when none can be had)."""

    def __init__(self, url: str, timeout_s: float = 2.0, cache_s: float = 1.0, revalidate_s: float = 10.0,
                 static_every_s: float = 60.0, *, worker_process: bool = True,
                 wall_clock: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.cache_s = cache_s
        self.revalidate_s = max(revalidate_s, cache_s)
        self.static_every_s = static_every_s
        self._wall_clock = wall_clock
        self._clock = clock
        self._worker_process = worker_process
        self._pool: ProcessPoolExecutor | None = None
        if not worker_process:
            refresher.init_worker(url, timeout_s, max_bytes)
        self._lock = threading.Lock()  # guards the fields below
        self._sync = threading.Lock()  # one synchronous refresh at a time
        self._state: ClusterState | None = None
        self._pairs: dict[str, tuple[tuple[int, int, float], ...]] = {}
        self._built_at = float("-inf")
        self._pods: tuple[str, ...] = ()
        self._background: threading.Thread | None = None
        self._warned = False
        self.refreshes_total = 0
        self.queries_total = 0
        self.errors_total = 0
        self.last_refresh_seconds = 0.0

    def state(self, pod_uids: Collection[str] = ()) -> ClusterState:
        with self._lock:
            self._pods = tuple(sorted(pod_uids))
            state, age = self._state, self._clock() - self._built_at
            if state is not None and age < self.cache_s:
                return state
            if state is not None and age < self.revalidate_s:
                if self._background is None:
                    self._background = threading.Thread(target=self._refresh_in_background, daemon=True,
                                                        name="gpuwatch-cluster-refresh")
                    self._background.start()
                return state
        with self._sync:  # concurrent callers wait for the one refresh
            with self._lock:
                if self._state is not None and self._clock() - self._built_at < self.cache_s:
                    return self._state
            return self._refresh()

    def warm(self, timeout_s: float = 60.0) -> None:
        """Start the worker process now (it takes a second), so no request pays for it."""
        if self._worker_process:
            self._pool_or_new().submit(refresher.ping).result(timeout=timeout_s)

    def _pool_or_new(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=refresher.init_worker,
                                             initargs=(self.url, self.timeout_s, self.max_bytes, True))
        return self._pool

    def close(self) -> None:
        """Stop the worker process now (SIGTERM must end the extender within 2 s): a refresh
        in flight is abandoned, its waiters get an error at once, and the interpreter's exit
        does not wait for the worker to finish reading a slow answer."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            processes = list(getattr(pool, "_processes", {}).values())  # no public handle on them
            pool.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.terminate()
            for process in processes:
                process.join(1.0)
        if not self._worker_process:
            refresher.close_worker()

    # ---- internals ----------------------------------------------------------------------

    def _refresh_in_background(self) -> None:
        try:
            self._refresh()
            self._warned = False
        except PrometheusError as err:
            if not self._warned:
                log.warning("refreshing the cluster view failed (serving the last one while it is younger "
                            "than %.0f s): %s", self.revalidate_s, err)
                self._warned = True
        finally:
            with self._lock:
                self._background = None

    def _run(self, pods: list[str]) -> refresher.Refreshed:
        wall_now = self._wall_clock()
        if not self._worker_process:
            return refresher.refresh(pods, self.static_every_s, wall_now)
        future = self._pool_or_new().submit(refresher.refresh, pods, self.static_every_s, wall_now)
        try:
            # the static batch and a cold worker (spawn + imports) take longer than one query
            return future.result(timeout=4 * self.timeout_s + 10)
        except BrokenProcessPool as err:
            self._pool = None  # a new worker next time
            raise PrometheusError("the cluster-view worker process died", fix="see the extender's log") from err
        except TimeoutError as err:
            raise PrometheusTimeout(f"refreshing the cluster view from {self.url} took too long",
                                    fix="check Prometheus' load; raise --prometheus-timeout") from err

    def _refresh(self) -> ClusterState:
        started = time.monotonic()
        with self._lock:
            pods = list(self._pods)
        try:
            done = self._run(pods)
        except PrometheusError:
            with self._lock:
                self.errors_total += 1
            raise
        with self._lock:
            if done.static is not None:
                self._pairs = done.static.pairs
            pairs = self._pairs
        state = ClusterState(
            nodes={name: dataclasses.replace(node, pair_scores=pairs.get(name, ()))
                   for name, node in done.state.nodes.items()},
            namespace_memory_bytes=done.state.namespace_memory_bytes,
            namespace_quota_bytes=done.state.namespace_quota_bytes, fetched_at_s=done.state.fetched_at_s)
        with self._lock:
            self._state, self._built_at = state, self._clock()
            self.refreshes_total += 1
            self.queries_total += done.queries
            self.last_refresh_seconds = time.monotonic() - started
        return state
