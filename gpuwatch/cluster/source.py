"""The cluster view from a live Prometheus: one batch of queries, one ClusterState per batch.

Shared by `gpuwatch extender` (per scheduling cycle) and `gpuwatch top --prometheus`. The
reader caches a batch for `cache_s`; the state built from it is cached with it, so the
requests of one scheduling cycle parse Prometheus' answers once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gpuwatch.cluster.model import ClusterState
from gpuwatch.cluster.prometheus import PrometheusReader
from gpuwatch.cluster.state import CLUSTER_QUERIES, build_state


class PrometheusCluster:
    """`state()` -> the ClusterState of the latest (cached) batch. Raises PrometheusError."""

    def __init__(self, url: str, timeout_s: float = 2.0, cache_s: float = 1.0,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.reader = PrometheusReader(url, timeout_s=timeout_s, cache_s=cache_s)
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._built_for = -1
        self._state = ClusterState()

    @property
    def errors_total(self) -> int:
        return self.reader.errors_total

    @property
    def queries_total(self) -> int:
        return self.reader.queries_total

    def state(self) -> ClusterState:
        results = self.reader.query_batch(CLUSTER_QUERIES)
        with self._lock:
            batch = self.reader.batches_total
            if batch != self._built_for:
                self._state = build_state(results, self._wall_clock())
                self._built_for = batch
            return self._state

    def close(self) -> None:
        self.reader.close()
