"""The cluster's one batch of PromQL, and the pure step from its results to a ClusterState.

`cluster_queries()` (or the default `CLUSTER_QUERIES`) is every instant query a consumer
needs per cycle; `PrometheusReader.query_batch` runs them; `build_state(results, now_s)`
regroups the samples per node into the immutable model of gpuwatch/cluster/values.py.
No I/O here, so every rule below is unit-tested on hand-written results.

Rules (what the queries and `build_state` guarantee together):

* **Aggregated in PromQL.** Every query ends in ``max by (...)``/``sum by (...)`` over only
  the labels the model keeps, so the answer carries no ``job``, ``instance`` or other
  target labels: less JSON to ship and parse at 1,000 nodes, and
* **no double counting.** Two scrape jobs of one agent, or the two halves of an HA
  Prometheus pair behind one URL, give series that differ only in target labels; ``max by``
  folds them into one before anything is summed. `build_state` also keeps the largest of
  samples with identical labels, so hand-made or federated results cannot double count.
* **MIG.** A ``gpu`` label ``"<index>/mig<slot>"`` is a MIG instance, never a physical GPU:
  the GPU-level queries exclude them (``gpu!~".+/.+"``) and `build_state` skips any that
  still arrive. A container's series on a MIG instance are added to its parent GPU (memory,
  SM share and kernel seconds summed over the instances of that parent), and counted as a
  tenant of the parent.
* **Missing is None.** A value no series gave stays ``None`` (memory, utilisation, network
  speed, throughput, freshness); nothing is made up. A GPU with no gpuwatch_gpu_healthy
  series is reported unhealthy with reason ``"unknown"``; a node with no
  gpuwatch_gpu_backend_up series has ``backend_up=False``.
* **Freshness.** ``ClusterNode.last_scrape_s`` is the newest scrape time of the node's
  gpuwatch_gpu_backend_up (PromQL ``timestamp()``); a node Prometheus stopped scraping
  drops out of instant queries after its staleness marker or the 5 min lookback, and
  `stale_nodes` names those whose data is older than a consumer's limit before that.
* **Tenants** come from ``gpuwatch_gpu_tenants`` where the agent exports it, else from the
  number of container series on the GPU (MIG instances counted on their parent).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwatch.cluster.values import ClusterContainer, ClusterGpu, ClusterNode, ClusterState, OutsidePod

CONTAINER_BY = "node, gpu, namespace, pod, pod_uid, container, container_id"
PHYSICAL = 'gpu!~".+/.+"'  # not a MIG instance ("0/mig1")
THROUGHPUT_WINDOW = "1m"
RDMA_NIC = 'rdma="true"'  # a NIC with an RDMA device bound to it


def cluster_queries(node: str | None = None, *, containers: bool = True) -> dict[str, str]:
    """The batch of instant queries `build_state` reads, by name.

    ``node`` restricts every query to one node (``node="..."`` matcher; namespace totals
    then cover that node only). ``containers=False`` leaves out the per-container series
    (the bulk of the data at scale) for consumers that only need per-GPU tenants.
    """
    scope = [f"node={json.dumps(node)}"] if node else []  # a JSON string is a valid PromQL string

    def sel(metric: str, *matchers: str) -> str:
        parts = [*scope, *matchers]
        return f"{metric}{{{', '.join(parts)}}}" if parts else metric

    def gpu(metric: str) -> str:
        return f"max by (node, gpu) ({sel(metric, PHYSICAL)})"

    rx = f"max by (node, device) (rate({sel('gpuwatch_node_network_receive_bytes_total')}[{THROUGHPUT_WINDOW}]))"
    tx = f"max by (node, device) (rate({sel('gpuwatch_node_network_transmit_bytes_total')}[{THROUGHPUT_WINDOW}]))"
    queries = {
        "gpu_healthy": f"max by (node, gpu, uuid, model, reason, xid) ({sel('gpuwatch_gpu_healthy', PHYSICAL)})",
        "gpu_memory_total": gpu("gpuwatch_gpu_memory_total_bytes"),
        "gpu_memory_used": gpu("gpuwatch_gpu_memory_used_bytes"),
        "gpu_memory_free": gpu("gpuwatch_gpu_memory_free_bytes"),
        "gpu_utilization": gpu("gpuwatch_gpu_utilization_ratio"),
        "gpu_tenants": gpu("gpuwatch_gpu_tenants"),
        "gpu_exclusive": gpu("gpuwatch_gpu_exclusive"),
        "gpu_outside_pod": (f"max by (node, gpu, pid, comm, cgroup) "
                            f"({sel('gpuwatch_gpu_process_outside_pod_memory_bytes', PHYSICAL)})"),
        "gpu_container_series": (f"count by (node, gpu) (max by ({CONTAINER_BY}) "
                                 f"({sel('gpuwatch_container_memory_bytes')}))"),
        "pair_score": f"max by (node, gpu, peer) ({sel('gpuwatch_gpu_pair_score')})",
        "backend_up": f"max by (node, simulated) ({sel('gpuwatch_gpu_backend_up')})",
        "last_scrape": f"max by (node) (timestamp({sel('gpuwatch_gpu_backend_up')}))",
        "network_speed": (f"max by (node) ({sel('gpuwatch_node_network_speed_bytes')} "
                          f"and on (node, device) ({sel('gpuwatch_node_network_up')} == 1))"),
        "network_throughput": f"sum by (node) ({rx} + {tx})",
        "rdma": (f"count by (node) ({sel('gpuwatch_node_rdma_port_up')} == 1) "
                 f"or count by (node) ({sel('gpuwatch_node_network_up', RDMA_NIC)})"),
        "namespace_memory": (f"sum by (namespace) (max by (node, namespace) "
                             f"({sel('gpuwatch_namespace_memory_bytes')}))"),
        "namespace_quota": f"max by (namespace) ({sel('gpuwatch_namespace_gpu_memory_quota_bytes')})",
    }
    if containers:
        for name, metric in (("container_memory", "gpuwatch_container_memory_bytes"),
                             ("container_sm", "gpuwatch_container_sm_utilization_ratio"),
                             ("container_kernel", "gpuwatch_container_kernel_seconds_total")):
            queries[name] = f"max by ({CONTAINER_BY}) ({sel(metric)})"
    return queries


CLUSTER_QUERIES: dict[str, str] = cluster_queries()
"""Every node, containers included: the batch `gpuwatch top --prometheus` runs."""


def placement_queries() -> dict[str, str]:
    """The small batch a placement decision needs every scheduling cycle (the extender's).

    Shaped to ship as few series as possible at 1,000 nodes: free memory (one series per
    GPU), and only the exceptions -- unhealthy GPUs, GPUs with tenants, exclusive holders --
    plus node freshness, network and namespace totals. No per-container series (the bulk of
    the data; see `pods_queries`) and nothing static (`static_queries`). `build_state` must be
    called with ``health_complete=False`` on it: a GPU without a health series is healthy.
    """
    full = cluster_queries(containers=False)
    keep = ("gpu_memory_free", "backend_up", "last_scrape", "network_speed", "network_throughput", "rdma",
            "namespace_memory", "namespace_quota")
    queries = {name: full[name] for name in keep}
    queries["gpu_healthy"] = f"max by (node, gpu, reason, xid) (gpuwatch_gpu_healthy{{{PHYSICAL}}}) == 0"
    queries["gpu_tenants"] = f"max by (node, gpu) (gpuwatch_gpu_tenants{{{PHYSICAL}}}) > 0"
    queries["gpu_exclusive"] = f"max by (node, gpu) (gpuwatch_gpu_exclusive{{{PHYSICAL}}}) > 0"
    queries["gpu_outside_pod"] = full["gpu_outside_pod"]  # rare: processes outside any pod on a GPU
    return queries


def static_queries() -> dict[str, str]:
    """What changes only with the hardware: GPU sizes, and the pair scores (n*(n-1) series per node)."""
    full = cluster_queries(containers=False)
    return {"gpu_memory_total": full["gpu_memory_total"], "pair_score": full["pair_score"]}


def pods_queries(pod_uids: Iterable[str]) -> dict[str, str]:
    """Container memory series of these pods only (to see that pods placed moments ago arrived)."""
    uids = sorted({u for u in pod_uids if u})
    if not uids:
        return {}
    pattern = "|".join(re.escape(u) for u in uids)
    return {"container_memory": f"max by ({CONTAINER_BY}) "
                                f"(gpuwatch_container_memory_bytes{{pod_uid=~{json.dumps(pattern)}}})"}

SampleLike = Sequence[Any]  # (labels dict, value float, timestamp float): prometheus.Sample or a plain tuple
ResultsLike = Mapping[str, Iterable[SampleLike]]


# --------------------------------------------------------------------------- parsing helpers

_GPU_LABELS: dict[str, tuple[int, bool] | None] = {}


def parse_gpu_label(text: str) -> tuple[int, bool] | None:
    """``"3"`` -> (3, False); ``"0/mig1"`` -> (0, True) (parent index, is MIG); else None."""
    cached = _GPU_LABELS.get(text)
    if cached is not None or text in _GPU_LABELS:
        return cached
    head, sep, tail = text.partition("/")
    parsed: tuple[int, bool] | None = None
    if head.isdigit() and head.isascii() and (not sep or tail):
        parsed = (int(head), bool(sep))
    if len(_GPU_LABELS) < 4096:  # a handful of distinct labels in practice; bounded anyway
        _GPU_LABELS[text] = parsed
    return parsed


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _per_node(results: ResultsLike, name: str) -> dict[str, float]:
    """node -> value (the largest of duplicates), finite values only."""
    out: dict[str, float] = {}
    for labels, value, _ in results.get(name, ()):
        node = labels.get("node")
        if node and math.isfinite(value) and (node not in out or value > out[node]):
            out[node] = value
    return out


def _per_gpu(results: ResultsLike, name: str) -> dict[tuple[str, int], float]:
    """(node, physical gpu) -> value (largest of duplicates); MIG and non-finite skipped."""
    out: dict[tuple[str, int], float] = {}
    for labels, value, _ in results.get(name, ()):
        node = labels.get("node")
        parsed = parse_gpu_label(labels.get("gpu", ""))
        if not node or parsed is None or parsed[1] or not math.isfinite(value):
            continue
        key = (node, parsed[0])
        if key not in out or value > out[key]:
            out[key] = value
    return out


def _outside_pod(results: ResultsLike) -> dict[tuple[str, int], tuple[OutsidePod, ...]]:
    """(node, physical gpu) -> its processes outside any pod, largest memory first."""
    out: dict[tuple[str, int], list[OutsidePod]] = {}
    for labels, value, _ in results.get("gpu_outside_pod", ()):
        node = labels.get("node")
        parsed = parse_gpu_label(labels.get("gpu", ""))
        if not node or parsed is None or parsed[1] or not labels.get("pid", "").isdigit():
            continue
        memory = value if math.isfinite(value) else 0.0
        out.setdefault((node, parsed[0]), []).append(
            OutsidePod(int(labels["pid"]), labels.get("comm", ""), labels.get("cgroup", ""), memory))
    return {key: tuple(sorted(found, key=lambda p: (-p.memory_bytes, p.pid))) for key, found in out.items()}


def _per_namespace(results: ResultsLike, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value, _ in results.get(name, ()):
        namespace = labels.get("namespace")
        if namespace is not None and math.isfinite(value):
            out[namespace] = max(value, out.get(namespace, value))
    return out


def simulated_nodes(results: ResultsLike) -> frozenset[str]:
    """Nodes whose agent reads a simulated GPU node (gpuwatch_gpu_backend_up{simulated="true"})."""
    return frozenset(labels["node"] for labels, _, _ in results.get("backend_up", ())
                     if labels.get("simulated") == "true" and labels.get("node"))


def stale_nodes(state: ClusterState, max_age_s: float) -> list[str]:
    """Nodes whose newest sample is older than ``max_age_s`` at ``state.fetched_at_s`` (or
    unknown), sorted."""
    limit = state.fetched_at_s - max_age_s
    return sorted(name for name, node in state.nodes.items()
                  if node.last_scrape_s is None or node.last_scrape_s < limit)


# --------------------------------------------------------------------------- build


class _Health:
    __slots__ = ("healthy", "model", "reason", "uuid", "xid")

    def __init__(self, uuid: str, model: str, healthy: bool, reason: str, xid: int | None) -> None:
        self.uuid, self.model, self.healthy, self.reason, self.xid = uuid, model, healthy, reason, xid


def _health(results: ResultsLike) -> dict[tuple[str, int], _Health]:
    """(node, gpu) -> health; of duplicates an unhealthy verdict wins (then the first seen)."""
    out: dict[tuple[str, int], _Health] = {}
    for labels, value, _ in results.get("gpu_healthy", ()):
        node = labels.get("node")
        parsed = parse_gpu_label(labels.get("gpu", ""))
        if not node or parsed is None or parsed[1]:
            continue
        key = (node, parsed[0])
        healthy = value > 0  # NaN counts as not healthy
        previous = out.get(key)
        if previous is not None and (healthy or not previous.healthy):
            continue
        xid_text = labels.get("xid", "")
        out[key] = _Health(labels.get("uuid", ""), labels.get("model", ""), healthy,
                           labels.get("reason") or ("ok" if healthy else "unhealthy"),
                           int(xid_text) if xid_text.isdigit() else None)
    return out


_ContainerKey = tuple[str, int, str, str, str, str, str]  # node, parent gpu, namespace, pod, pod_uid, container, id


def _container_values(results: ResultsLike, name: str) -> dict[_ContainerKey, float]:
    """Per container and physical GPU: the largest of identical series; a container's series
    on the MIG instances of one parent are summed (and a series on the parent itself, should
    an agent export both, is not added to them: the larger of the two wins)."""
    physical: dict[_ContainerKey, float] = {}
    mig: dict[tuple[_ContainerKey, str], float] = {}
    for labels, value, _ in results.get(name, ()):
        node = labels.get("node")
        gpu = labels.get("gpu", "")
        parsed = parse_gpu_label(gpu)
        if not node or parsed is None or not math.isfinite(value):
            continue
        key: _ContainerKey = (node, parsed[0], labels.get("namespace", ""), labels.get("pod", ""),
                              labels.get("pod_uid", ""), labels.get("container", ""),
                              labels.get("container_id", ""))
        if parsed[1]:
            previous = mig.get((key, gpu))
            if previous is None or value > previous:
                mig[(key, gpu)] = value
        else:
            previous = physical.get(key)
            if previous is None or value > previous:
                physical[key] = value
    if not mig:
        return physical
    summed: dict[_ContainerKey, float] = {}
    for (key, _), value in mig.items():
        summed[key] = summed.get(key, 0.0) + value
    for key, value in summed.items():
        physical[key] = max(value, physical.get(key, value))
    return physical


def _container_counts(results: ResultsLike) -> dict[tuple[str, int], int]:
    """(node, physical gpu) -> container series on it (its MIG instances' series added up;
    the larger of that and the parent's own count)."""
    physical: dict[tuple[str, int], int] = {}
    summed: dict[tuple[str, int], int] = {}
    for labels, value, _ in results.get("gpu_container_series", ()):
        node = labels.get("node")
        parsed = parse_gpu_label(labels.get("gpu", ""))
        if not node or parsed is None or not math.isfinite(value):
            continue
        key = (node, parsed[0])
        if parsed[1]:
            summed[key] = summed.get(key, 0) + int(value)
        else:
            physical[key] = max(int(value), physical.get(key, 0))
    for key, count in summed.items():
        physical[key] = max(count, physical.get(key, 0))
    return physical


@dataclass(frozen=True)
class StaticFacts:
    """What `static_queries` reads, parsed once: GPU sizes and per-node pair scores."""

    totals: dict[tuple[str, int], float]
    pairs: dict[str, tuple[tuple[int, int, float], ...]]


def static_facts(results: ResultsLike) -> StaticFacts:
    return StaticFacts(totals=_per_gpu(results, "gpu_memory_total"), pairs=_pair_scores(results))


def _pair_scores(results: ResultsLike) -> dict[str, tuple[tuple[int, int, float], ...]]:
    pairs_by_node: dict[str, dict[tuple[int, int], float]] = {}
    for labels, value, _ in results.get("pair_score", ()):
        node = labels.get("node")
        gpu = parse_gpu_label(labels.get("gpu", ""))
        peer = parse_gpu_label(labels.get("peer", ""))
        if not node or gpu is None or peer is None or gpu[1] or peer[1] or not math.isfinite(value):
            continue
        scores = pairs_by_node.setdefault(node, {})
        pair = (gpu[0], peer[0])
        scores[pair] = max(value, scores.get(pair, value))

    return {node: tuple((a, b, s) for (a, b), s in sorted(scores.items())) for node, scores in pairs_by_node.items()}


def build_state(results: ResultsLike, now_s: float, *, health_complete: bool = True,
                static: StaticFacts | None = None, with_pairs: bool = True) -> ClusterState:
    """The ClusterState of one batch of `cluster_queries()` results read at Unix time ``now_s``.

    Pure. ``results`` maps query names to samples ``(labels, value, timestamp)``; a query
    that is absent or empty means "no data" for what it feeds. Nodes are every node label
    seen in any query; nodes, GPUs and containers come out sorted. ``health_complete=False``
    (the `placement_queries` batch, which asks only for unhealthy GPUs): a GPU with no health
    series is healthy instead of "unknown". ``static``: GPU sizes and pair scores parsed before
    (`static_facts`) instead of read from ``results``; ``with_pairs=False`` leaves pair scores
    out of the nodes (the extender attaches them itself, so they are not shipped every refresh).
    """
    health = _health(results)
    totals = static.totals if static is not None else _per_gpu(results, "gpu_memory_total")
    used = _per_gpu(results, "gpu_memory_used")
    free = _per_gpu(results, "gpu_memory_free")
    util = _per_gpu(results, "gpu_utilization")
    tenants = _per_gpu(results, "gpu_tenants")
    exclusive = _per_gpu(results, "gpu_exclusive")
    outside = _outside_pod(results)
    counted = _container_counts(results)
    memory = _container_values(results, "container_memory")
    sm = _container_values(results, "container_sm")
    kernel = _container_values(results, "container_kernel")
    up = _per_node(results, "backend_up")
    last_scrape = _per_node(results, "last_scrape")
    speed = _per_node(results, "network_speed")
    throughput = _per_node(results, "network_throughput")
    rdma = _per_node(results, "rdma")

    gpu_keys = set(health) | set(totals) | set(used) | set(free) | set(util) | set(tenants) | set(exclusive)
    gpus_by_node: dict[str, list[ClusterGpu]] = {}
    for key in sorted(gpu_keys):
        node, index = key
        verdict = health.get(key)
        count = tenants.get(key)
        gpus_by_node.setdefault(node, []).append(ClusterGpu(
            node=node, index=index,
            uuid=verdict.uuid if verdict else "", model=verdict.model if verdict else "",
            memory_total_bytes=totals.get(key), memory_used_bytes=used.get(key),
            memory_free_bytes=free.get(key), utilization_ratio=util.get(key),
            healthy=verdict.healthy if verdict else not health_complete,
            reason=verdict.reason if verdict else ("unknown" if health_complete else "ok"),
            xid=verdict.xid if verdict else None,
            tenants=int(count) if count is not None else counted.get(key, 0),
            exclusive=exclusive.get(key, 0.0) > 0,
            outside_pod=outside.get(key, ()),
        ))

    pairs_by_node = (static.pairs if static is not None else _pair_scores(results)) if with_pairs else {}

    containers_by_node: dict[str, list[ClusterContainer]] = {}
    for ckey in sorted(memory):
        node, gpu_index, namespace, pod, pod_uid, container, container_id = ckey
        containers_by_node.setdefault(node, []).append(ClusterContainer(
            node=node, gpu=gpu_index, namespace=namespace, pod=pod, pod_uid=pod_uid, container=container,
            container_id=container_id, memory_bytes=memory[ckey], sm_utilization_ratio=sm.get(ckey),
            kernel_seconds_total=kernel.get(ckey)))

    names = (set(gpus_by_node) | set(containers_by_node) | set(up) | set(last_scrape) | set(pairs_by_node)
             | set(speed) | set(throughput) | set(rdma))
    nodes = {
        name: ClusterNode(
            name=name,
            gpus=tuple(gpus_by_node.get(name, ())),
            pair_scores=pairs_by_node.get(name, ()),
            backend_up=up.get(name, 0.0) > 0,
            last_scrape_s=last_scrape.get(name),
            network_speed_bytes=speed.get(name),
            network_throughput_bytes=throughput.get(name),
            rdma=rdma.get(name, 0.0) > 0,
            containers=tuple(containers_by_node.get(name, ())),
        )
        for name in sorted(names)
    }
    return ClusterState(nodes=nodes, namespace_memory_bytes=_per_namespace(results, "namespace_memory"),
                        namespace_quota_bytes=_per_namespace(results, "namespace_quota"), fetched_at_s=now_s)
