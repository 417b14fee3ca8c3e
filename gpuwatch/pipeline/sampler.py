"""The sampling loop: read sources, attribute, publish one immutable Snapshot.

Each cycle: one GPU backend sweep -> identities of the pids it listed -> probe counters
(optional) -> `attribute()` -> node signals and progress files (optional) -> a new
`Snapshot`, published by a single attribute assignment (`latest()` is a plain read, no
lock: the Snapshot is immutable).

Failure handling: a sweep that fails (driver gone, simulated node down) or a backend
that cannot be created publishes a snapshot with ``gpu_up=False``, ``gpu_error`` set and
no devices; the backend is closed and recreated through the factory, with exponential
backoff (interval .. `max_backoff_s`). Attribution counters are kept across the outage
(kernel seconds never go backwards) and the first sweep after recovery integrates
nothing, because nothing is known about the time the GPU could not be read.

Cycle cost is measured on every cycle: wall time into `Snapshot.cycle_seconds`, thread
CPU time into `Snapshot.cycle_cpu_seconds`.

Between ticks, `wake()` asks for a cycle now (the agent's event pump calls it when the kernel
stops an allocation or a GPU process exits, so a waiting container is admitted within one
cycle instead of up to one interval later); woken cycles are at least `wake_gap_s` apart, so
a storm of events costs at most one cycle per gap. `wait_newer()` lets a consumer run on
each snapshot as soon as it is published.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from gpuwatch.core.errors import GpuwatchError
from gpuwatch.core.model import (
    ContainerIdentity,
    ContainerProgress,
    ContainerUsage,
    DeviceInfo,
    GpuSweep,
    GpuTopology,
    NodeSignals,
    ProbeCounters,
    ProcessIdentity,
    ProcessProbe,
    Snapshot,
)
from gpuwatch.core.probe_nvml import compare_probe_nvml
from gpuwatch.gpu.backend import GpuBackend
from gpuwatch.pipeline.attribution import DEFAULT_MAX_RETIRED, AttributionState, attribute
from gpuwatch.pipeline.probe_join import join_process_probes, needs_process_join
from gpuwatch.signals.health import apply_health

if TYPE_CHECKING:
    from gpuwatch.containers import BundleRoots

log = logging.getLogger(__name__)

MIN_WAKE_GAP_S = 0.05
"""Woken cycles are at least max(this, interval / 10) apart (and never more than an interval)."""


class IdentitySource(Protocol):
    """What the sampler needs from the container identity resolver (gpuwatch.containers)."""

    def begin_sweep(self) -> None: ...

    def resolve_pids(self, pids: Iterable[int]) -> Mapping[int, ProcessIdentity]: ...

    def identity_for_cgroup_id(self, cgroup_id: int) -> ContainerIdentity | None: ...


class ProbeSource(Protocol):
    """Kernel probe counters, read once per interval (gpuwatch.probes). A source that also
    has `read_processes() -> tuple[ProcessProbe, ...]` (the ProbeManager) gets its counters
    joined per process where cgroups cannot be joined whole (probe_join.py)."""

    def read(self) -> tuple[ProbeCounters, ...]: ...


class SignalSource(Protocol):
    """Node signals for schedulers, built once per cycle (gpuwatch.signals.signal_collector)."""

    def collect(self, devices: Sequence[DeviceInfo] | None, topology: GpuTopology | None,
                containers: Sequence[ContainerUsage], identities: Mapping[int, ProcessIdentity],
                resolve: Callable[[int], ProcessIdentity | None] | None = None) -> NodeSignals: ...

    def close(self) -> None: ...


class ProgressSource(Protocol):
    """Containers' evaluation functions, read once per cycle (gpuwatch.signals.progress)."""

    def collect(self, containers: Sequence[ContainerUsage], now_s: float | None = None
                ) -> tuple[ContainerProgress, ...]: ...


class Sampler:
    """Builds and publishes one Snapshot per interval; survives GPU backend failures."""

    def __init__(self, backend_factory: Callable[[], GpuBackend], resolver: IdentitySource, node: str,
                 interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 probe_source: ProbeSource | None = None, *, max_backoff_s: float = 30.0,
                 signal_source: SignalSource | None = None, progress_source: ProgressSource | None = None,
                 max_retired_counters: int = DEFAULT_MAX_RETIRED) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.max_retired_counters = max_retired_counters  # gone containers' counters kept (attribution.py)
        self._factory = backend_factory
        self._resolver = resolver
        self.node = node
        self.interval_s = interval_s
        self._clock = clock
        self._probe_source = probe_source
        self._signal_source = signal_source
        self._progress_source = progress_source
        self._max_backoff_s = max(max_backoff_s, interval_s)
        self._backend: GpuBackend | None = None
        self._backoff_s = interval_s
        self._retry_at_s = float("-inf")
        self._last_error: str | None = None
        self._gpu_errors_total = 0
        self._state = AttributionState()
        self._identities: dict[int, ProcessIdentity] = {}
        self._latest = Snapshot(timestamp_s=clock(), node=node, devices=(), containers=(), gpu_up=False,
                                gpu_error="no sample taken yet", interval_s=interval_s)
        self._unsampled_s = self._latest.timestamp_s  # the placeholder's: follow() skips it
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self.wake_gap_s = min(interval_s, max(MIN_WAKE_GAP_S, interval_s / 10))
        self._published = threading.Condition()
        self._cycle_lock = threading.Lock()  # run_once from the loop and a caller never interleave
        self._loop_beat_s: float | None = None  # time.monotonic() when the loop last finished a cycle

    # ---- public -----------------------------------------------------------------------

    def latest(self) -> Snapshot:
        """The most recently published snapshot (never blocks)."""
        return self._latest

    def wait_newer(self, timestamp_s: float, timeout_s: float) -> Snapshot:
        """The latest snapshot once one newer than `timestamp_s` is published, or after
        `timeout_s` whatever it is (the caller compares timestamps)."""
        with self._published:
            self._published.wait_for(lambda: self._latest.timestamp_s != timestamp_s, timeout=timeout_s)
            return self._latest

    def follow(self, stop: threading.Event, poll_s: float) -> Iterator[Snapshot]:
        """Each snapshot as soon as it is published (none twice), until `stop` is set: the
        consumer's side of the loop (the agent's enforcer, and the benchmark's and tests' copies
        of it), never the placeholder published before the first sample. `poll_s` bounds how
        long a set `stop` goes unnoticed."""
        last = self._unsampled_s
        while not stop.is_set():
            snapshot = self.wait_newer(last, timeout_s=poll_s)
            if stop.is_set():
                return
            if snapshot.timestamp_s == last:
                continue
            last = snapshot.timestamp_s
            yield snapshot

    def wake(self) -> None:
        """Take a cycle now rather than at the next tick (at most one per `wake_gap_s`); a
        no-op when the loop is not running."""
        self._wake.set()

    def run_once(self) -> Snapshot:
        """Take one sample, publish it and return it."""
        with self._cycle_lock:
            wall0 = time.perf_counter()
            cpu0 = time.thread_time()
            snapshot = self._sample()
            comparison = tuple(compare_probe_nvml(snapshot).values())  # once per interval, for every reader
            snapshot = dataclasses.replace(snapshot, probe_nvml=comparison, cycle_seconds=time.perf_counter() - wall0,
                                           cycle_cpu_seconds=time.thread_time() - cpu0)
            self._publish(snapshot)
            return snapshot

    def start(self) -> None:
        """Run the loop in a daemon thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="gpuwatch-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and close the backend."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        with self._cycle_lock:
            self._drop_backend()
            if self._signal_source is not None:
                self._signal_source.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def loop_beat_s(self) -> float | None:
        """time.monotonic() at which the sampling loop last finished a cycle, failed or not
        (None before the first): what the agent's /healthz judges liveness by."""
        return self._loop_beat_s

    # ---- internals --------------------------------------------------------------------

    def _publish(self, snapshot: Snapshot) -> None:
        with self._published:
            self._latest = snapshot
            self._published.notify_all()

    def _loop(self) -> None:
        next_at = time.monotonic()
        while not self._stopping.is_set():
            self._wake.clear()  # a wake during this cycle asks for the next one
            try:
                self.run_once()
            except Exception as err:  # a bug in a source must not kill the agent: log, publish, go on
                log.exception("sampler cycle failed")
                self._publish(dataclasses.replace(self._latest, gpu_up=False,
                                                  gpu_error=f"sampler cycle failed: {err!r}"))
            next_at += self.interval_s
            now = time.monotonic()
            self._loop_beat_s = now
            if next_at < now:  # overran: skip missed ticks instead of bursting
                next_at = now + self.interval_s
            if self._wake.wait(next_at - now) and not self._stopping.is_set():
                self._stopping.wait(now + self.wake_gap_s - time.monotonic())  # woken: not sooner than the gap
                next_at = time.monotonic()  # the ticks go on an interval after this cycle

    def _drop_backend(self) -> None:
        if self._backend is not None:
            backend, self._backend = self._backend, None
            backend.close()

    def _failed(self, now_s: float, message: str) -> None:
        if message != self._last_error:
            log.warning("GPU backend down (%s); retrying in %.1f s", message, self._backoff_s)
        self._last_error = message
        self._drop_backend()
        self._retry_at_s = now_s + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)
        # Nothing is known about the outage: do not integrate across it.
        self._state = dataclasses.replace(self._state, last_timestamp_s=None)

    def _sweep(self, now_s: float) -> GpuSweep | None:
        if self._backend is None:
            if now_s < self._retry_at_s:
                return None
            try:
                self._backend = self._factory()
            except GpuwatchError as err:
                self._failed(now_s, str(err))
                return None
        try:
            sweep = self._backend.sweep()
        except GpuwatchError as err:
            self._failed(now_s, str(err))
            return None
        if self._last_error is not None:
            log.warning("GPU backend back up")
        self._last_error = None
        self._backoff_s = self.interval_s
        self._gpu_errors_total += len(sweep.errors)
        return sweep

    def _read_probes(self) -> tuple[tuple[ProbeCounters, ...], bool, str | None]:
        if self._probe_source is None:
            return (), False, None
        try:
            return tuple(self._probe_source.read()), True, None
        except (GpuwatchError, OSError) as err:
            return (), False, f"probe counters unavailable: {err}"

    def _sample(self) -> Snapshot:
        now_s = self._clock()
        sweep = self._sweep(now_s)
        counters, probes_up, probe_note = self._read_probes()
        notes = (probe_note,) if probe_note else ()
        if sweep is None:
            return Snapshot(timestamp_s=now_s, node=self.node, devices=(), containers=(), gpu_up=False,
                            gpu_error=self._last_error or "GPU backend unavailable",
                            probes_up=probes_up, probe_counters=counters,
                            probe_identities=self._probe_identities(counters), interval_s=self.interval_s,
                            notes=notes, gpu_errors_total=self._gpu_errors_total,
                            signals=self._signals(None, None, (), {}))
        self._resolver.begin_sweep()
        pids = {proc.pid for proc in sweep.processes}
        identities = dict(self._resolver.resolve_pids(pids))
        # A process that has just exited can still be listed by NVML (its memory is being
        # released) while /proc no longer has it: keep last sweep's identity for it rather
        # than charging its memory to the host for one interval.
        for pid in pids - identities.keys():
            previous = self._identities.get(pid)
            if previous is not None:
                identities[pid] = previous
        self._identities = identities
        result = attribute(sweep, identities, self._state, self.node, max_retired=self.max_retired_counters)
        self._state = result.state
        probe_identities = self._probe_identities(counters)
        if counters and needs_process_join(identities.values()):
            counters, probe_identities = self._join_per_process(counters, probe_identities, identities)
        containers = _merge_probes(result.containers, counters, probe_identities)
        signals = self._signals(sweep.devices, sweep.topology, containers, identities)
        progress = self._progress(containers, now_s)
        devices = apply_health(sweep.devices, signals.health) if signals is not None else sweep.devices
        return Snapshot(
            timestamp_s=sweep.timestamp_s, node=self.node, devices=devices, containers=containers,
            pods=result.pods, namespaces=result.namespaces, gpu_up=True, gpu_error=None,
            probes_up=probes_up, probe_counters=counters, probe_identities=probe_identities,
            interval_s=self.interval_s, simulated=any(d.simulated for d in sweep.devices),
            notes=notes + sweep.errors, gpu_errors_total=self._gpu_errors_total, signals=signals,
            driver_version=sweep.driver_version, cuda_driver_version=sweep.cuda_driver_version,
            progress=progress, kernel_time_scaled=tuple(sorted(result.state.kernel_time_scaled.items())),
        )

    def _signals(self, devices: Sequence[DeviceInfo] | None, topology: GpuTopology | None,
                 containers: Sequence[ContainerUsage], identities: Mapping[int, ProcessIdentity]
                 ) -> NodeSignals | None:
        if self._signal_source is None:
            return None
        try:
            return self._signal_source.collect(devices, topology, containers, identities, self._resolve_one)
        except (GpuwatchError, OSError, ValueError) as err:  # signals are optional: the usage snapshot goes on
            log.warning("node signals failed this cycle: %s", err)
            return None

    def _progress(self, containers: Sequence[ContainerUsage], now_s: float) -> tuple[ContainerProgress, ...]:
        if self._progress_source is None:
            return ()
        try:
            return self._progress_source.collect(containers, now_s)
        except (GpuwatchError, OSError, ValueError) as err:  # progress is optional: the snapshot goes on
            log.warning("progress files failed this cycle: %s", err)
            return ()

    def _resolve_one(self, pid: int) -> ProcessIdentity | None:
        return self._resolver.resolve_pids((pid,)).get(pid)

    def _join_per_process(self, counters: tuple[ProbeCounters, ...],
                          probe_identities: tuple[tuple[int, ContainerIdentity], ...],
                          identities: Mapping[int, ProcessIdentity]
                          ) -> tuple[tuple[ProbeCounters, ...], tuple[tuple[int, ContainerIdentity], ...]]:
        """Counters re-joined one process at a time (probe_join.py): the probe source's
        per-process bytes, each process named by the resolver as NVML's processes are."""
        read_processes: Callable[[], Sequence[ProcessProbe]] | None = getattr(
            self._probe_source, "read_processes", None)
        if read_processes is None:
            return counters, probe_identities
        try:
            processes = tuple(read_processes())
        except (GpuwatchError, OSError) as err:
            log.warning("per-process probe counters unavailable: %s", err)
            return counters, probe_identities
        named = dict(identities)
        missing = [p.tgid for p in processes if p.tgid not in named]
        if missing:
            named.update(self._resolver.resolve_pids(missing))
        return join_process_probes(counters, probe_identities, processes, named)

    def _probe_identities(self, counters: Sequence[ProbeCounters]
                          ) -> tuple[tuple[int, ContainerIdentity], ...]:
        found: list[tuple[int, ContainerIdentity]] = []
        for counter in counters:
            identity = self._resolver.identity_for_cgroup_id(counter.cgroup_id)
            if identity is not None:
                found.append((counter.cgroup_id, identity))
        return tuple(found)


def _merge_probes(containers: tuple[ContainerUsage, ...], counters: Sequence[ProbeCounters],
                  probe_identities: Sequence[tuple[int, ContainerIdentity]]) -> tuple[ContainerUsage, ...]:
    """Attach each cgroup's probe counters to the usages of the container it belongs to."""
    if not counters:
        return containers
    by_cgroup = {c.cgroup_id: c for c in counters}
    by_key = {identity.key: by_cgroup[cgid] for cgid, identity in probe_identities if cgid in by_cgroup}
    merged: list[ContainerUsage] = []
    for usage in containers:
        ident = usage.identity
        probe = by_key.get(ident.key)
        if probe is None and ident.cgroup_id is not None:
            probe = by_cgroup.get(ident.cgroup_id)
        merged.append(dataclasses.replace(usage, probe=probe) if probe is not None else usage)
    return tuple(merged)


def default_node_name() -> str:
    """NODE_NAME (set from the downward API in the DaemonSet) or the host name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


def build_sampler(nvml_library: str | None = None, interval_s: float = 1.0, node: str | None = None,
                  proc_root: str = "/proc", bundle_roots: BundleRoots | None = None,
                  probe_source: ProbeSource | None = None, signal_source: SignalSource | None = None,
                  progress_source: ProgressSource | None = None, progress: bool = True) -> Sampler:
    """The production wiring used by `gpuwatch top` and `gpuwatch agent`.

    The NVML backend is created lazily by the sampler (and recreated after failures),
    so a host whose driver is missing still gets snapshots saying why (`gpu_error`).
    Containers' progress files (gpuwatch.io/progress-file) are read by a
    `ProgressTracker` over `proc_root` unless `progress_source` replaces it or `progress`
    is False; it costs nothing for containers that declare none.
    """
    from gpuwatch.containers import IdentityResolver
    from gpuwatch.gpu.nvml import NvmlBackend
    from gpuwatch.signals.progress import ProgressTracker

    def factory() -> GpuBackend:
        return NvmlBackend(library_path=nvml_library)

    resolver = IdentityResolver(proc_root=proc_root, bundle_roots=bundle_roots)
    if progress_source is None and progress:
        progress_source = ProgressTracker(proc_root=proc_root)
    return Sampler(factory, resolver, node or default_node_name(), interval_s=interval_s,
                   probe_source=probe_source, signal_source=signal_source, progress_source=progress_source)
