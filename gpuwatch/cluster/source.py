"""The cluster view from a live Prometheus, for placement decisions (the extender).

One refresh = one batch of instant queries (`placement_queries`, plus the pods just placed
and, every `topology_cache_s`, the static pair scores) and one `build_state`. Serving:

* a state younger than `cache_s` (1 s) is served as is: one refresh per scheduling burst;
* a state younger than `revalidate_s` (10 s) is served while one background thread
  refreshes it (stale-while-revalidate): a request never waits for Prometheus or for
  parsing thousands of series once the extender is warm;
* older (or none yet): the request refreshes synchronously, with the reader's timeout,
  and a failure raises (filter turns it into its Error field).
A background refresh that fails is logged once and leaves the state to age into the
synchronous path, so a Prometheus outage shows up as errors within `revalidate_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from gpuwatch.cluster.model import ClusterState
from gpuwatch.cluster.prometheus import PrometheusError, PrometheusReader
from gpuwatch.cluster.state import build_state, placement_queries, pods_queries, topology_queries

log = logging.getLogger(__name__)


class PrometheusCluster:
    """`state(pod_uids)` -> a recent ClusterState (raises PrometheusError when none can be had)."""

    def __init__(self, url: str, timeout_s: float = 2.0, cache_s: float = 1.0, revalidate_s: float = 10.0,
                 topology_cache_s: float = 60.0, wall_clock: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reader = PrometheusReader(url, timeout_s=timeout_s, cache_s=0.0)
        self.cache_s = cache_s
        self.revalidate_s = max(revalidate_s, cache_s)
        self.topology_cache_s = topology_cache_s
        self._wall_clock = wall_clock
        self._clock = clock
        self._lock = threading.Lock()  # guards the fields below
        self._sync = threading.Lock()  # one synchronous refresh at a time
        self._state: ClusterState | None = None
        self._built_at = float("-inf")
        self._topology: dict[str, Any] = {}
        self._topology_at = float("-inf")
        self._pods: frozenset[str] = frozenset()
        self._background: threading.Thread | None = None
        self._warned = False
        self.refreshes_total = 0
        self.last_refresh_seconds = 0.0

    @property
    def errors_total(self) -> int:
        return self.reader.errors_total

    @property
    def queries_total(self) -> int:
        return self.reader.queries_total

    def state(self, pod_uids: Collection[str] = ()) -> ClusterState:
        with self._lock:
            self._pods = frozenset(pod_uids)
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

    def close(self) -> None:
        self.reader.close()

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

    def _refresh(self) -> ClusterState:
        started = time.monotonic()
        with self._lock:
            pods = self._pods
            topology_due = self._clock() - self._topology_at >= self.topology_cache_s
        queries = {**placement_queries(), **pods_queries(pods)}
        if topology_due:
            queries.update(topology_queries())
        results = self.reader.query_batch(queries)
        now = self._clock()
        with self._lock:
            if topology_due:
                self._topology = {"pair_score": results["pair_score"]}
                self._topology_at = now
            merged = {**results, **self._topology}
        state = build_state(merged, self._wall_clock())
        with self._lock:
            self._state, self._built_at = state, now
            self.refreshes_total += 1
            self.last_refresh_seconds = time.monotonic() - started
        return state
