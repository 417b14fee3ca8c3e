"""Per-container GPU attribution -- a pure function, no I/O.

    attribute(sweep, identities, state, node) -> AttributionResult

Input: one GPU sweep (devices, per-pid memory and SM utilisation), the identity of each
host pid (which container/pod it runs in), and the previous `AttributionState`.
Output: per container per GPU usage, rollups per pod and per namespace, and the next
state. Processes without an identity go to the `HOST_IDENTITY` bucket -- nothing is
dropped.

Kernel seconds are a counter: the GPU time the container's processes ran on that GPU (a
container keeping one GPU fully busy for 10 s gains 10 s). Where the backend integrates
NVML's process samples by the time each covers (`GpuProcess.kernel_seconds`, gpu/samples.py)
those seconds are added as they are; otherwise the rectangle rule takes the utilisation read
*now* over the time since the previous sweep. Per GPU, the containers' seconds in one sweep
never exceed the GPU's busy time (its utilisation x the interval, unspent busy time carried
to the next sweeps for at most BUSY_CARRY_S): where they would, they are scaled down
proportionally and the sweep is counted (`AttributionState.kernel_time_scaled`, exported as
gpuwatch_gpu_kernel_time_scaled_total). A container's SM utilisation ratio is the sum of its
processes' shares of the time their latest samples cover. The integral is kept per (container key, GPU uuid) in the
state, so it survives processes starting and exiting inside the container, and it never goes
backwards. `dt` is clamped to [0, max_dt_s] so a clock jump or a long stall (e.g. the GPU
backend was down) cannot add a burst of made-up seconds.

Counters of keys that are no longer in the sweeps (a container between two GPU processes,
or gone for good) are retired, not dropped: a container whose process restarts continues
its counter. What retirement costs is bounded, whatever the churn (`CounterTable`):
* per sweep, the work is proportional to the keys in this sweep and the last one (live
  containers), not to the retired ones: a key the last sweep did not have is looked up in
  each retired batch (a few dozen at most), the keys that left are added to a copy of the
  newest batch (at most 256 keys), and older batches are shared with the previous state,
  neither copied nor walked;
* retired keys are kept as one float each, in batches of keys retired close together
  (at most `retention_s` / 8 apart, at most 256 or `max_retired` / 8 of them); a whole
  batch is dropped once its newest key is older than `retention_s`, and the oldest batches
  once more than `max_retired` keys are retired. So a counter is kept at least
  `retention_s` after its key was last seen unless `max_retired` newer keys were retired
  since (at 50 container starts/s and the default 4,096: about 80 s), and at most
  `retention_s` x 9/8.
Their series are gone from the exporter from the first sweep without them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import islice
from types import MappingProxyType

from gpuwatch.core.model import (
    HOST_IDENTITY,
    ContainerIdentity,
    ContainerUsage,
    DeviceInfo,
    GpuProcess,
    GpuSweep,
    GroupUsage,
    ProcessIdentity,
    ProcessUsage,
)

BUSY_CARRY_S = 6.0  # busy seconds a GPU carries to later sweeps (the NVML backend's longest gap between sample reads)

CounterKey = tuple[str, ...]
"""(container key, gpu uuid) for containers; (namespace, pod, pod uid) for pods; (namespace,)."""


DEFAULT_RETENTION_S = 600.0
DEFAULT_MAX_RETIRED = 4096
_BATCHES = 8  # a retired batch spans at most retention / 8 ...
_BATCH_KEYS = 256  # ... and holds at most this many keys (or max_retired / 8 if fewer): a sweep copies one


@dataclass(frozen=True)
class _Batch:
    """Totals of keys retired close together: last seen between first_s and last_s."""

    first_s: float
    last_s: float
    totals: Mapping[CounterKey, float]  # never changed once the batch is built


class CounterTable(Mapping[CounterKey, tuple[float, float]]):
    """Kernel-second counters: an immutable value, read as key -> (total, last seen s).

    The keys of the last sweep are "live"; the others are retired into batches (module
    docstring). `advance()` returns the next table and leaves this one as it was, sharing
    the batches it did not change. The last-seen time of a retired key is its batch's
    newest (the batch's resolution)."""

    __slots__ = ("_live", "_retired", "_retired_count", "_seen_s")

    def __init__(self, live: Mapping[CounterKey, float] | None = None, seen_s: float = 0.0,
                 retired: tuple[_Batch, ...] = (), retired_count: int = 0) -> None:
        self._live: Mapping[CounterKey, float] = MappingProxyType(dict(live or {}))
        self._seen_s = seen_s
        self._retired = retired
        self._retired_count = retired_count

    @classmethod
    def _owning(cls, live: dict[CounterKey, float], seen_s: float, retired: tuple[_Batch, ...],
                retired_count: int) -> CounterTable:
        """A table over `live` without copying it (advance() hands over a dict nobody else holds)."""
        table = cls.__new__(cls)
        table._live = MappingProxyType(live)
        table._seen_s = seen_s
        table._retired = retired
        table._retired_count = retired_count
        return table

    def __getitem__(self, key: CounterKey) -> tuple[float, float]:
        total = self._live.get(key)
        if total is not None:
            return total, self._seen_s
        for batch in reversed(self._retired):
            total = batch.totals.get(key)
            if total is not None:
                return total, batch.last_s
        raise KeyError(key)

    def __iter__(self) -> Iterator[CounterKey]:
        yield from self._live
        for batch in self._retired:
            yield from batch.totals

    def __len__(self) -> int:
        return len(self._live) + self._retired_count

    def __repr__(self) -> str:
        return f"CounterTable(live={len(self._live)}, retired={self._retired_count} in {len(self._retired)} batches)"

    @property
    def live_count(self) -> int:
        return len(self._live)

    @property
    def retired_count(self) -> int:
        return self._retired_count

    @property
    def retired_batches(self) -> int:
        return len(self._retired)

    def total(self, key: CounterKey) -> float:
        """A live key's total (0.0 for a key that is not live)."""
        return self._live.get(key, 0.0)

    def advance(self, increments: Mapping[CounterKey, float], now_s: float, *,
                retention_s: float = DEFAULT_RETENTION_S, max_retired: int = DEFAULT_MAX_RETIRED
                ) -> CounterTable:
        """The next table: `increments` are this sweep's keys (live from now on); the live
        keys not among them are retired, last seen at this table's time."""
        live = self._live
        batches = list(self._retired)
        count = self._retired_count
        revived: dict[int, list[CounterKey]] = {}
        new_live: dict[CounterKey, float] = {}
        for key, increment in increments.items():
            total = live.get(key)
            if total is None:
                total = 0.0
                for i in range(len(batches) - 1, -1, -1):  # a key that was away: continue its counter
                    found = batches[i].totals.get(key)
                    if found is not None:
                        total = found
                        revived.setdefault(i, []).append(key)
                        break
            new_live[key] = total + increment
        for i, keys in revived.items():
            batch = batches[i]
            totals = dict(batch.totals)
            for key in keys:
                del totals[key]
            batches[i] = _Batch(batch.first_s, batch.last_s, MappingProxyType(totals))
            count -= len(keys)
        gone = {key: total for key, total in live.items() if key not in increments}
        if gone and max_retired > 0:
            if len(gone) > max_retired:
                gone = dict(islice(gone.items(), max_retired))
            count += len(gone)
            seen_s = self._seen_s
            newest = batches[-1] if batches else None
            if (newest is not None and seen_s - newest.first_s < retention_s / _BATCHES
                    and len(newest.totals) + len(gone) <= max(min(max_retired // _BATCHES, _BATCH_KEYS), 1)):
                merged = dict(newest.totals)
                merged.update(gone)
                batches[-1] = _Batch(newest.first_s, max(newest.last_s, seen_s), MappingProxyType(merged))
            else:
                batches.append(_Batch(seen_s, seen_s, MappingProxyType(gone)))
        # Expire oldest first, whole batches: O(batches) per sweep, the entries freed once.
        drop = 0
        while drop < len(batches) and (count > max_retired or now_s - batches[drop].last_s > retention_s):
            count -= len(batches[drop].totals)
            drop += 1
        kept = tuple(batch for batch in batches[drop:] if batch.totals)
        return CounterTable._owning(new_live, now_s, kept, count)


@dataclass(frozen=True)
class AttributionState:
    """What attribution remembers between sweeps: an immutable value, passed in and returned.

    Each table maps a key to (kernel_seconds_total, last_seen_timestamp_s).
    """

    last_timestamp_s: float | None = None
    containers: CounterTable = field(default_factory=CounterTable)
    pods: CounterTable = field(default_factory=CounterTable)
    namespaces: CounterTable = field(default_factory=CounterTable)
    # per GPU uuid: sweeps whose containers' kernel seconds were scaled down to the GPU's busy time
    kernel_time_scaled: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # per GPU uuid: busy seconds (utilisation x interval) not yet matched by charged kernel seconds
    busy_unspent_s: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))


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
    kernel_seconds: float | None = None  # from NVML samples; None: none of its processes has them
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


def attribute(sweep: GpuSweep, identities: Mapping[int, ProcessIdentity], state: AttributionState,
              node: str, *, max_dt_s: float = 10.0, retention_s: float = DEFAULT_RETENTION_S,
              max_retired: int = DEFAULT_MAX_RETIRED) -> AttributionResult:
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
        if acc.kernel_seconds is not None and state.last_timestamp_s is not None:
            increments[key] = acc.kernel_seconds
        else:
            increments[key] = min(acc.sm_utilization, 1.0) * dt_s
        usages_by_key[key] = acc
    scaled, unspent = _cap_to_device_busy(increments, usages_by_key, sweep.devices, dt_s, state)
    for acc in usages_by_key.values():
        acc.sm_utilization = min(acc.sm_utilization, 1.0)
    container_counters = state.containers.advance(increments, now_s, retention_s=retention_s,
                                                  max_retired=max_retired)

    containers = tuple(
        ContainerUsage(identity=acc.identity, gpu_index=acc.gpu_index, gpu_uuid=acc.gpu_uuid,
                       memory_bytes=acc.memory_bytes, sm_utilization_ratio=acc.sm_utilization,
                       kernel_seconds_total=container_counters.total(key),
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
    pod_counters = state.pods.advance({k: g.increment_s for k, g in pod_groups.items()}, now_s,
                                      retention_s=retention_s, max_retired=max_retired)
    ns_counters = state.namespaces.advance({k: g.increment_s for k, g in ns_groups.items()}, now_s,
                                           retention_s=retention_s, max_retired=max_retired)

    return AttributionResult(
        containers=containers,
        pods=_groups(pod_groups, pod_counters),
        namespaces=_groups(ns_groups, ns_counters),
        state=AttributionState(last_timestamp_s=now_s, containers=container_counters, pods=pod_counters,
                               namespaces=ns_counters, kernel_time_scaled=scaled, busy_unspent_s=unspent),
    )


def _cap_to_device_busy(increments: dict[CounterKey, float], accs: Mapping[CounterKey, _Acc],
                        devices: Iterable[DeviceInfo], dt_s: float, state: AttributionState
                        ) -> tuple[Mapping[str, int], Mapping[str, float]]:
    """Per GPU, the containers' kernel seconds never exceed the GPU's busy time (NVML
    utilisation x interval): where this sweep's seconds would exceed the busy time not yet
    matched by earlier sweeps' seconds, they are scaled down proportionally (in place) and the
    sweep is counted for that GPU. Busy time carries over (at most BUSY_CARRY_S) because the
    samples of a period arrive with a later read: a backend that reads process samples every
    few sweeps charges their seconds at once. GPUs without a utilisation reading are left as
    they are. Returns the updated (counts, unspent busy seconds)."""
    on_gpu: dict[str, list[CounterKey]] = {}
    for key, acc in accs.items():
        on_gpu.setdefault(acc.gpu_uuid, []).append(key)
    counts, unspent = dict(state.kernel_time_scaled), {}
    for d in devices:
        if d.utilization_gpu_ratio is None:
            continue
        budget = min(state.busy_unspent_s.get(d.uuid, 0.0) + d.utilization_gpu_ratio * dt_s, BUSY_CARRY_S)
        keys = on_gpu.get(d.uuid, ())
        total = sum(increments[k] for k in keys)
        if total > budget + 1e-9:
            factor = budget / total
            for k in keys:
                increments[k] *= factor
            counts[d.uuid] = counts.get(d.uuid, 0) + 1
            total = budget
        unspent[d.uuid] = budget - total
    return MappingProxyType(counts), MappingProxyType(unspent)


def _accumulate(processes: Iterable[GpuProcess], identities: Mapping[int, ProcessIdentity]
                ) -> dict[CounterKey, _Acc]:
    accs: dict[CounterKey, _Acc] = {}
    for proc in processes:
        pident = identities.get(proc.pid)
        identity = pident.identity if pident is not None else HOST_IDENTITY
        key = (identity.key, proc.gpu_uuid)
        acc = accs.get(key)
        if acc is None:
            # one string per GPU in the counters, not one per counter (a sweep's strings are new)
            key = (identity.key, sys.intern(proc.gpu_uuid))
            acc = accs[key] = _Acc(identity=identity, gpu_index=proc.gpu_index, gpu_uuid=proc.gpu_uuid)
        if proc.memory_bytes is not None:
            acc.memory_bytes += proc.memory_bytes
        if proc.sm_utilization_ratio is not None:
            acc.sm_utilization += proc.sm_utilization_ratio
        if proc.kernel_seconds is not None:
            acc.kernel_seconds = (acc.kernel_seconds or 0.0) + proc.kernel_seconds
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


def _groups(groups: Mapping[CounterKey, _GroupAcc], counters: CounterTable) -> tuple[GroupUsage, ...]:
    """Rollups. sm_utilization_ratio is summed over GPUs: 2.0 = two GPUs' worth of SM time."""
    return tuple(
        GroupUsage(namespace=g.namespace, pod=g.pod, pod_uid=g.pod_uid, memory_bytes=g.memory_bytes,
                   sm_utilization_ratio=g.sm_utilization, kernel_seconds_total=counters.total(key),
                   containers=len(g.containers))
        for key, g in sorted(groups.items())
    )


def _order(acc: _Acc) -> tuple[int, str, str, str, str, str]:
    ident = acc.identity
    return (acc.gpu_index, acc.gpu_uuid, ident.pod_namespace, ident.pod_name, ident.container_name,
            ident.key)
