"""Per-container GPU attribution -- a pure function, no I/O.

    attribute(sweep, identities, state, node) -> AttributionResult

Input: one GPU sweep (devices, per-pid memory and SM utilisation), the identity of each
host pid (which container/pod it runs in), and the previous `AttributionState`.
Output: per container per GPU usage, rollups per pod and per namespace, and the next
state. Processes without an identity go to the `HOST_IDENTITY` bucket -- nothing is
dropped.

Kernel seconds are a counter: the integral over time of the container's SM
utilisation ratio on that GPU (a container keeping one GPU fully busy for 10 s gains
10 s). The integral is kept per (container key, GPU uuid) in the state, so it survives
processes starting and exiting inside the container, and it never goes backwards. The
rectangle rule uses the utilisation read *now* over the time since the previous sweep,
because NVML's per-process utilisation describes the period that just ended. `dt` is
clamped to [0, max_dt_s] so a clock jump or a long stall (e.g. the GPU backend was down)
cannot add a burst of made-up seconds. Counters of containers not seen for
`retention_s` are forgotten (their series are gone from the exporter long before).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuwatch.model import (
    HOST_IDENTITY,
    ContainerIdentity,
    ContainerUsage,
    GpuProcess,
    GpuSweep,
    GroupUsage,
    ProcessIdentity,
    ProcessUsage,
)

CounterKey = tuple[str, ...]
"""(container key, gpu uuid) for containers; (namespace, pod, pod uid) for pods; (namespace,)."""


def _frozen(mapping: dict[CounterKey, tuple[float, float]]) -> Mapping[CounterKey, tuple[float, float]]:
    return MappingProxyType(mapping)


def _empty() -> Mapping[CounterKey, tuple[float, float]]:
    return _frozen({})


@dataclass(frozen=True)
class AttributionState:
    """What attribution remembers between sweeps: an immutable value, passed in and returned.

    Each counter maps a key to (kernel_seconds_total, last_seen_timestamp_s).
    """

    last_timestamp_s: float | None = None
    containers: Mapping[CounterKey, tuple[float, float]] = field(default_factory=_empty)
    pods: Mapping[CounterKey, tuple[float, float]] = field(default_factory=_empty)
    namespaces: Mapping[CounterKey, tuple[float, float]] = field(default_factory=_empty)


@dataclass(frozen=True)
class AttributionResult:
    containers: tuple[ContainerUsage, ...]
    pods: tuple[GroupUsage, ...]
    namespaces: tuple[GroupUsage, ...]
    state: AttributionState


@dataclass
class _Acc:
    """Mutable accumulator, local to one attribute() call."""

    identity: ContainerIdentity
    gpu_index: int
    gpu_uuid: str
    memory_bytes: int = 0
    sm_utilization: float = 0.0
    processes: list[ProcessUsage] = field(default_factory=list)


@dataclass
class _GroupAcc:
    namespace: str
    pod: str
    pod_uid: str
    memory_bytes: int = 0
    sm_utilization: float = 0.0
    increment_s: float = 0.0
    containers: set[str] = field(default_factory=set)


def _advance(previous: Mapping[CounterKey, tuple[float, float]], increments: Mapping[CounterKey, float],
             now_s: float, retention_s: float) -> dict[CounterKey, tuple[float, float]]:
    """Add increments to counters; keep unseen counters until they are `retention_s` old."""
    updated: dict[CounterKey, tuple[float, float]] = {}
    for key, (total, seen_s) in previous.items():
        if key not in increments and now_s - seen_s <= retention_s:
            updated[key] = (total, seen_s)
    for key, increment in increments.items():
        total = previous[key][0] if key in previous else 0.0
        updated[key] = (total + increment, now_s)
    return updated


def attribute(sweep: GpuSweep, identities: Mapping[int, ProcessIdentity], state: AttributionState,
              node: str, *, max_dt_s: float = 10.0, retention_s: float = 600.0) -> AttributionResult:
    """Attribute one sweep to containers, pods and namespaces; return usages and next state.

    `node` names the node the sweep came from (kept for callers that attribute several
    nodes; usages themselves carry no node).
    """
    del node  # usages are per node by construction; the Snapshot carries the node name
    now_s = sweep.timestamp_s
    dt_s = 0.0 if state.last_timestamp_s is None else min(max(now_s - state.last_timestamp_s, 0.0), max_dt_s)

    accs = _accumulate(sweep.processes, identities)

    increments: dict[CounterKey, float] = {}
    usages_by_key: dict[CounterKey, _Acc] = {}
    for key, acc in accs.items():
        acc.sm_utilization = min(acc.sm_utilization, 1.0)
        increments[key] = acc.sm_utilization * dt_s
        usages_by_key[key] = acc
    container_counters = _advance(state.containers, increments, now_s, retention_s)

    containers = tuple(
        ContainerUsage(identity=acc.identity, gpu_index=acc.gpu_index, gpu_uuid=acc.gpu_uuid,
                       memory_bytes=acc.memory_bytes, sm_utilization_ratio=acc.sm_utilization,
                       kernel_seconds_total=container_counters[key][0],
                       processes=tuple(sorted(acc.processes, key=lambda p: p.pid)))
        for key, acc in sorted(usages_by_key.items(), key=lambda kv: _order(kv[1]))
    )

    pod_groups: dict[CounterKey, _GroupAcc] = {}
    ns_groups: dict[CounterKey, _GroupAcc] = {}
    for key, acc in usages_by_key.items():
        ident = acc.identity
        if ident.pod_name:
            pod_key = (ident.pod_namespace, ident.pod_name, ident.pod_uid)
            _add(pod_groups, pod_key, ident.pod_namespace, ident.pod_name, ident.pod_uid, acc,
                 increments[key])
        if ident.pod_namespace:
            _add(ns_groups, (ident.pod_namespace,), ident.pod_namespace, "", "", acc, increments[key])
    pod_counters = _advance(state.pods, {k: g.increment_s for k, g in pod_groups.items()}, now_s, retention_s)
    ns_counters = _advance(state.namespaces, {k: g.increment_s for k, g in ns_groups.items()},
                           now_s, retention_s)

    return AttributionResult(
        containers=containers,
        pods=_groups(pod_groups, pod_counters),
        namespaces=_groups(ns_groups, ns_counters),
        state=AttributionState(last_timestamp_s=now_s, containers=_frozen(container_counters),
                               pods=_frozen(pod_counters), namespaces=_frozen(ns_counters)),
    )


def _accumulate(processes: Iterable[GpuProcess], identities: Mapping[int, ProcessIdentity]
                ) -> dict[CounterKey, _Acc]:
    accs: dict[CounterKey, _Acc] = {}
    for proc in processes:
        pident = identities.get(proc.pid)
        identity = pident.identity if pident is not None else HOST_IDENTITY
        key = (identity.key, proc.gpu_uuid)
        acc = accs.get(key)
        if acc is None:
            acc = accs[key] = _Acc(identity=identity, gpu_index=proc.gpu_index, gpu_uuid=proc.gpu_uuid)
        if proc.memory_bytes is not None:
            acc.memory_bytes += proc.memory_bytes
        if proc.sm_utilization_ratio is not None:
            acc.sm_utilization += proc.sm_utilization_ratio
        acc.processes.append(ProcessUsage(
            pid=proc.pid,
            container_pid=pident.container_pid if pident is not None else None,
            comm=pident.comm if pident is not None else "",
            memory_bytes=proc.memory_bytes,
            sm_utilization_ratio=proc.sm_utilization_ratio,
        ))
    return accs


def _add(groups: dict[CounterKey, _GroupAcc], key: CounterKey, namespace: str, pod: str, pod_uid: str,
         acc: _Acc, increment_s: float) -> None:
    group = groups.get(key)
    if group is None:
        group = groups[key] = _GroupAcc(namespace=namespace, pod=pod, pod_uid=pod_uid)
    group.memory_bytes += acc.memory_bytes
    group.sm_utilization += acc.sm_utilization
    group.increment_s += increment_s
    group.containers.add(acc.identity.key)


def _groups(groups: Mapping[CounterKey, _GroupAcc], counters: Mapping[CounterKey, tuple[float, float]]
            ) -> tuple[GroupUsage, ...]:
    """Rollups. sm_utilization_ratio is summed over GPUs: 2.0 = two GPUs' worth of SM time."""
    return tuple(
        GroupUsage(namespace=g.namespace, pod=g.pod, pod_uid=g.pod_uid, memory_bytes=g.memory_bytes,
                   sm_utilization_ratio=g.sm_utilization, kernel_seconds_total=counters[key][0],
                   containers=len(g.containers))
        for key, g in sorted(groups.items())
    )


def _order(acc: _Acc) -> tuple[int, str, str, str, str, str]:
    ident = acc.identity
    return (acc.gpu_index, acc.gpu_uuid, ident.pod_namespace, ident.pod_name, ident.container_name,
            ident.key)
