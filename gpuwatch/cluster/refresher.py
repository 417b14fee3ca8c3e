"""One refresh of the placement view: query Prometheus, build the ClusterState.

Runs in a worker process of the extender (`source.PrometheusCluster`): parsing tens of
thousands of series is CPU work under Python's GIL, and in the serving process it would
stall every request that overlaps it; in its own process it runs on another core and
its memory peak (the raw answers) stays out of the server. The static part (GPU sizes,
pair scores) is fetched every `static_every_s` and kept here, never shipped back raw.
Functions here also run in-process (the tests, `worker_process=False`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from gpuwatch.cluster.prometheus import PrometheusReader
from gpuwatch.cluster.queries import (
    StaticFacts,
    build_state,
    placement_queries,
    pods_queries,
    static_facts,
    static_queries,
)
from gpuwatch.cluster.values import ClusterState
from gpuwatch.core.httpclient import DEFAULT_MAX_BYTES


@dataclass
class _Worker:
    reader: PrometheusReader
    static: StaticFacts | None = None
    static_at: float = float("-inf")


_worker: _Worker | None = None


ORPHAN_CHECK_S = 1.0
"""How often a worker process checks that the extender that started it is still alive."""


def init_worker(url: str, timeout_s: float, max_bytes: int = DEFAULT_MAX_BYTES, exit_with_parent: bool = False
                ) -> None:
    """Process initializer: one pooled reader for the life of the worker (answers bounded by
    `max_bytes` each, 2 x `max_bytes` a batch, `timeout_s` each from connect to last byte).

    `exit_with_parent` (in the worker process only): the worker ends within ORPHAN_CHECK_S of
    the extender's death. A pool worker holds both ends of its task queue, so it would wait on
    it for ever after a SIGKILL of the extender -- and keep multiprocessing's resource tracker,
    and the queue's named semaphores in /dev/shm, alive with it. (PR_SET_PDEATHSIG would fire
    when the *thread* that spawned the worker ends, which may be a short-lived request thread.)"""
    global _worker
    _worker = _Worker(PrometheusReader(url, timeout_s=timeout_s, cache_s=0.0, max_bytes=max_bytes))
    if exit_with_parent:
        parent = os.getppid()
        threading.Thread(target=_exit_when_orphaned, args=(parent,), name="orphan-check", daemon=True).start()


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(ORPHAN_CHECK_S)
    os._exit(0)  # reparented: the extender is gone, nobody will read an answer


def ping() -> bool:
    """Nothing: starting the worker process (spawn + imports) before the first request."""
    return _worker is not None


@dataclass(frozen=True)
class Refreshed:
    state: ClusterState  # without pair scores: `static` carries them when they were read again
    queries: int  # queries this refresh made
    static: StaticFacts | None  # set when the static batch was read in this refresh


def refresh(pod_uids: list[str], static_every_s: float, wall_now_s: float) -> Refreshed:
    """Query the placement batch (and the static batch when due) and build the state."""
    worker = _worker
    if worker is None:
        raise RuntimeError("refresh() before init_worker()")
    static_due = worker.static is None or time.monotonic() - worker.static_at >= static_every_s
    queries = {**placement_queries(), **pods_queries(pod_uids)}
    if static_due:
        queries.update(static_queries())
    results = worker.reader.query_batch(queries)
    if static_due:
        worker.static = static_facts(results)
        worker.static_at = time.monotonic()
    assert worker.static is not None
    state = build_state(results, wall_now_s, health_complete=False, static=worker.static, with_pairs=False)
    del results
    _trim()  # hand the parse's peak back to the OS: this process lives as long as the extender
    return Refreshed(state, len(queries), worker.static if static_due else None)


def _trim() -> None:
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def close_worker() -> None:
    global _worker
    if _worker is not None:
        _worker.reader.close()
        _worker = None
