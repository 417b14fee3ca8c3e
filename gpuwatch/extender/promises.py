"""Memory the extender has promised to pods that have not shown up in the metrics yet.

Between the moment the extender scores a node for a pod and the moment that pod's
process holds memory (and the agent's next scrape shows it), the node still looks free;
a burst of pods would all be sent to the same GPU. So `prioritize` records, for its
top-scored node, the GPUs and bytes it expects the pod to take. Filter and prioritize
subtract them. A promise ends when the pod's UID appears in that node's container series,
when the same pod is scored again (it is replaced), or after `ttl_s` (default 10 s: a few
scrape intervals). The extender cannot know which node kube-scheduler finally picks (the
extender has no bind verb: it needs no API permissions), so a promise on the wrong node
only makes that node look fuller for a few seconds -- conservative, never optimistic.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuwatch.cluster.values import ClusterState


@dataclass(frozen=True)
class Promise:
    pod_uid: str
    namespace: str
    node: str
    gpus: tuple[int, ...]
    bytes_per_gpu: int
    exclusive: bool
    made_s: float


class Promises:
    """Thread-safe, bounded ledger of recent promises (at most `max_entries`, oldest dropped)."""

    def __init__(self, ttl_s: float = 10.0, max_entries: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._max = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._by_pod: dict[str, Promise] = {}
        self.version = 0  # bumps whenever a promise is added or dropped

    def add(self, pod_uid: str, namespace: str, node: str, gpus: tuple[int, ...], bytes_per_gpu: int,
            exclusive: bool) -> None:
        if not pod_uid:
            return  # nothing to settle it by: do not promise
        with self._lock:
            self._by_pod.pop(pod_uid, None)
            self._by_pod[pod_uid] = Promise(pod_uid, namespace, node, gpus, bytes_per_gpu, exclusive, self._clock())
            self.version += 1
            while len(self._by_pod) > self._max:
                del self._by_pod[next(iter(self._by_pod))]

    def settle(self, state: ClusterState) -> None:
        """Drop promises that expired or whose pod now shows in its node's metrics."""
        now = self._clock()
        with self._lock:
            for uid, promise in list(self._by_pod.items()):
                node = state.nodes.get(promise.node)
                arrived = node is not None and any(c.pod_uid == uid for c in node.containers)
                if arrived or now - promise.made_s > self.ttl_s:
                    del self._by_pod[uid]
                    self.version += 1

    def current(self, exclude_pod: str = "") -> list[Promise]:
        """Live promises (optionally without one pod's own: re-scoring a pod must not block it)."""
        now = self._clock()
        with self._lock:
            return [p for p in self._by_pod.values() if now - p.made_s <= self.ttl_s and p.pod_uid != exclude_pod]

    def __len__(self) -> int:
        return len(self.current())
