"""Runs the node-signal sources once per sample interval and builds `NodeSignals`.

The sampler calls `SignalCollector.collect()` after attribution, with what it already has
(this sweep's devices and topology, the per-container usages, the pid identities), so no
source reads /proc or NVML a second time. Per cycle:
* the kernel log is polled (non-blocking, bounded) for Xid lines; each Xid is put on its
  GPU by PCI address (an address no GPU has is counted, never a GPU's) and on the
  container of the pid it names -- only when that pid had that GPU open this cycle or the
  last (the process an Xid killed is often gone already), and only when the record is at
  most `xid_max_age_s` old (after a flood the pid may have been reused): otherwise the Xid
  counts for the GPU's health and as unattributed (`xid_unattributed`, `xid_stale`);
* the health tracker turns the devices plus the kernel-log Xids into verdicts;
* the network reader reads the node's NICs (without pods' veths, bridges and tunnels:
  `nic_exclude`), RDMA ports and the network namespaces of the containers that use a GPU
  (one pid each).
Per-container Xid counters are kept while their container is seen and for
`xid_retention_s` after, at most `max_xid_series` of them (gone containers' first, oldest
first). A cycle touches only the counters of the containers in it; the others are expired
in one pass every `xid_retention_s` / 8, and the exported list is rebuilt only when a
counter changed or was dropped.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpuwatch.core.model import (
    ContainerIdentity,
    ContainerNetwork,
    ContainerUsage,
    ContainerXid,
    DeviceInfo,
    GpuTopology,
    NicStats,
    NodeSignals,
    ProcessIdentity,
    RdmaPort,
)
from gpuwatch.signals.health import HealthTracker
from gpuwatch.signals.kmsg import KmsgReader, XidRecord, pci_address

log = logging.getLogger(__name__)


class NetworkSource(Protocol):
    """What the collector needs from gpuwatch.signals.network.NetworkReader."""

    errors_total: dict[str, int]

    def read_nics(self) -> tuple[NicStats, ...]: ...

    def read_rdma(self) -> tuple[RdmaPort, ...]: ...

    def read_containers(self, targets: Sequence[tuple[ContainerIdentity, int]]) -> tuple[ContainerNetwork, ...]: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class _ContainerXids:
    identity: ContainerIdentity
    counts: dict[tuple[int, int], int]  # (gpu index, xid) -> count
    seen_s: float  # last time its container was seen or an Xid counted


# Interfaces that are not the node's own links: pods' veth ends and CNI plumbing (a
# hostNetwork agent sees one per pod), bridges, tunnels, the IFB devices of traffic shaping.
DEFAULT_NIC_EXCLUDE = r"^(lo|veth.*|cali.*|cilium_.*|lxc.*|flannel.*|cni.*|docker.*|br-.*|virbr.*|vxlan.*|tunl.*|"\
                      r"kube-.*|nodelocaldns|weave.*|genev.*|ifb.*|gre.*|gretap.*|erspan.*|sit.*|ip6tnl.*)$"


class SignalCollector:
    """Health, Xid attribution, topology and network for one node, once per interval."""

    def __init__(self, health: HealthTracker | None = None, kmsg: KmsgReader | None = None,
                 network: NetworkSource | None = None, *, xid_retention_s: float = 3600.0,
                 max_xid_series: int = 1024, clock: Callable[[], float] = time.monotonic,
                 nic_exclude: str | None = DEFAULT_NIC_EXCLUDE, xid_max_age_s: float = 30.0) -> None:
        self.health = health or HealthTracker()
        self.kmsg = kmsg
        self.network = network
        self._xid_retention_s = xid_retention_s
        self._max_xid_series = max_xid_series
        self._clock = clock
        self._nic_exclude = re.compile(nic_exclude) if nic_exclude else None
        self._xids: dict[str, _ContainerXids] = {}  # container key -> its counters
        self._xid_series = 0  # (container, gpu, xid) counters in _xids
        self._xid_view: tuple[ContainerXid, ...] | None = ()  # None: rebuild
        self._xid_expire_at_s: float | None = None
        self._previous_identities: Mapping[int, ProcessIdentity] = {}
        self._previous_gpus: dict[int, set[int]] = {}  # pid -> GPU indexes it had open last cycle
        self._xid_max_age_s = xid_max_age_s
        self.xid_stale_total = 0
        self._topology: GpuTopology | None = None
        self.xid_unattributed_total = 0
        self.xid_unknown_gpu_total = 0

    def close(self) -> None:
        if self.kmsg is not None:
            self.kmsg.close()
        if self.network is not None:
            self.network.close()

    def collect(self, devices: Sequence[DeviceInfo] | None, topology: GpuTopology | None,
                containers: Sequence[ContainerUsage], identities: Mapping[int, ProcessIdentity],
                resolve: Callable[[int], ProcessIdentity | None] | None = None) -> NodeSignals:
        """`devices` None: no GPU sweep this cycle (NVML down)."""
        now_s = self._clock()
        if topology is not None:
            self._topology = topology
        records = self.kmsg.poll() if self.kmsg is not None else []
        known = devices if devices is not None else self.health.last_devices()
        gpus = _gpus_by_pid(containers)
        kernel_xids = self._attribute_xids(records, known, identities, resolve, now_s, gpus)
        health = self.health.update(devices, kernel_xids)
        self._expire_xids(containers, now_s)
        self._previous_identities = identities
        self._previous_gpus = gpus
        nics: tuple[NicStats, ...] = ()
        rdma: tuple[RdmaPort, ...] = ()
        networks: tuple[ContainerNetwork, ...] = ()
        if self.network is not None:
            nics = self.network.read_nics()
            if self._nic_exclude is not None:
                nics = tuple(nic for nic in nics if not self._nic_exclude.match(nic.device))
            rdma = self.network.read_rdma()
            networks = self.network.read_containers(_network_targets(containers))
        return NodeSignals(
            health=health, topology=self._topology, nics=nics, rdma_ports=rdma,
            container_xids=self._xid_list(),
            container_network=networks, errors_total=self._errors(),
            kmsg_malformed_total=self.kmsg.malformed_total if self.kmsg is not None else 0,
        )

    # ---- Xid attribution ----------------------------------------------------------------

    def _attribute_xids(self, records: Sequence[XidRecord], devices: Sequence[DeviceInfo],
                        identities: Mapping[int, ProcessIdentity],
                        resolve: Callable[[int], ProcessIdentity | None] | None,
                        now_s: float, gpus: Mapping[int, set[int]]) -> list[tuple[int, int]]:
        if not records:
            return []
        by_pci = {pci_address(d.pci_bus_id): d.index for d in devices if not d.is_mig}
        found: list[tuple[int, int]] = []
        for record in records:
            gpu = by_pci.get(record.pci_address)
            if gpu is None:
                self.xid_unknown_gpu_total += 1
                continue
            found.append((gpu, record.xid))
            if record.pid is None:
                continue  # the driver did not know the process: GPU-level only
            if record.age_s is not None and record.age_s > self._xid_max_age_s:
                self.xid_stale_total += 1  # read long after it was logged: the pid may be another process now
                continue
            if gpu not in gpus.get(record.pid, ()) and gpu not in self._previous_gpus.get(record.pid, ()):
                self.xid_unattributed_total += 1  # that pid did not use that GPU: never charge it
                continue
            process = identities.get(record.pid) or self._previous_identities.get(record.pid)
            if process is None and resolve is not None:
                process = resolve(record.pid)
            if process is None:
                self.xid_unattributed_total += 1
                continue
            key = process.identity.key
            entry = self._xids.get(key)
            if entry is None:
                entry = self._xids[key] = _ContainerXids(process.identity, {}, now_s)
            series = (gpu, record.xid)
            if series not in entry.counts:
                self._xid_series += 1
            entry.counts[series] = entry.counts.get(series, 0) + 1
            entry.seen_s = now_s
            self._xid_view = None
        return found

    def _expire_xids(self, containers: Sequence[ContainerUsage], now_s: float) -> None:
        if not self._xids:
            return
        xids = self._xids
        present: set[str] = set()
        for usage in containers:  # O(live): only the containers of this cycle are touched
            entry = xids.get(usage.identity.key)
            if entry is not None:
                entry.seen_s = now_s
                present.add(usage.identity.key)
        retention = self._xid_retention_s
        due = self._xid_expire_at_s
        if due is None or now_s >= due or now_s < due - retention:
            self._xid_expire_at_s = now_s + max(retention / 8, 1.0)
            kept = {key: e for key, e in xids.items() if now_s - e.seen_s <= retention}
            if len(kept) < len(xids):
                self._xids = kept
                self._xid_series = sum(len(e.counts) for e in kept.values())
                self._xid_view = None
        if self._xid_series > self._max_xid_series:
            # gone containers first, oldest first; a container's series go together (the last partly)
            excess = self._xid_series - self._max_xid_series
            for key in sorted(self._xids, key=lambda k: (k in present, self._xids[k].seen_s)):
                counts = self._xids[key].counts
                if len(counts) <= excess:
                    excess -= len(counts)
                    del self._xids[key]
                else:
                    for series in list(counts)[:excess]:
                        del counts[series]
                    excess = 0
                if excess == 0:
                    break
            self._xid_series = self._max_xid_series
            self._xid_view = None

    def _xid_list(self) -> tuple[ContainerXid, ...]:
        if self._xid_view is None:
            self._xid_view = tuple(ContainerXid(identity=e.identity, gpu_index=gpu, xid=xid, count=count)
                                   for e in self._xids.values() for (gpu, xid), count in e.counts.items())
        return self._xid_view

    def _errors(self) -> tuple[tuple[str, int], ...]:
        errors: list[tuple[str, int]] = []
        if self.kmsg is not None:
            errors += [("kmsg", self.kmsg.errors_total), ("kmsg_lost_records", self.kmsg.lost_records_total)]
        errors += [("xid_unattributed", self.xid_unattributed_total),
                   ("xid_unknown_gpu", self.xid_unknown_gpu_total), ("xid_stale", self.xid_stale_total)]
        if self.kmsg is not None:
            errors += [("kmsg_misplaced_xid", self.kmsg.misplaced_total)]
        if self.network is not None:
            errors += [(f"network_{source}", count) for source, count in sorted(self.network.errors_total.items())]
        return tuple(errors)


def _gpus_by_pid(containers: Sequence[ContainerUsage]) -> dict[int, set[int]]:
    """pid -> the GPU indexes it had open this cycle (NVML's per-process lists)."""
    gpus: dict[int, set[int]] = {}
    for usage in containers:
        for process in usage.processes:
            gpus.setdefault(process.pid, set()).add(usage.gpu_index)
    return gpus


def _network_targets(containers: Sequence[ContainerUsage]) -> list[tuple[ContainerIdentity, int]]:
    """One live pid per container that uses a GPU (host processes have no network of their own)."""
    targets: dict[str, tuple[ContainerIdentity, int]] = {}
    for usage in containers:
        identity = usage.identity
        if not identity.is_container or identity.key in targets or not usage.processes:
            continue
        targets[identity.key] = (identity, usage.processes[0].pid)
    return list(targets.values())
