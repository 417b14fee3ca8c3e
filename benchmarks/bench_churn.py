"""Benchmark: the agent's memory and cycle cost under container churn (issue 13, item 5).

    sudo .venv/bin/python benchmarks/bench_churn.py [--rate 50] [--duration 600] [--quick]

On a simulated node (GPUS devices), containers are started and stopped at RATE starts per
second for DURATION seconds, each living LIFETIME_MIN..LIFETIME_MAX seconds. A container is
what a kubelet with containerd and the systemd cgroup driver makes, minus runc: a pod slice
and a `cri-containerd-<id>.scope` cgroup (v2) under a bench-owned parent, a containerd-shaped
OCI bundle `config.json` with the CRI annotations (pod name, namespace, uid, container name;
one in PROGRESS_EVERY also declares a progress file), and one native `simworker` put into
the cgroup before it executes (it holds GPU memory through the stub libcuda, so NVML lists
it). runc itself is not used, so that a small machine reaches the rate; the agent reads the
same cgroups, bundle files and processes either way.

The agent's pipeline runs in its own interpreter (so its RSS is the agent's), wired as
`gpuwatch agent` wires it: `build_sampler` (NVML backend over the fake libnvidia-ml,
IdentityResolver over the real /proc, cgroupfs and the bundle directory, ProgressTracker),
the node signals (health, the sim's kernel log, NICs and pods' network namespaces), the
sampler thread, and the metrics server, scraped over HTTP every SCRAPE_S seconds as
Prometheus would.

Timeline: IDLE seconds with no containers (the idle RSS and cycle) -> BASELINE seconds with N
long-lived containers, N = RATE x mean lifetime (the live count churn keeps), none starting ->
churn for DURATION seconds -> QUIET seconds with no containers -> BASELINE seconds with N
long-lived containers again, now with churn's gone containers still retained. It prints a
table per minute (achieved starts/s, live containers, retained per-container counters, RSS,
cycle CPU percentiles), where each phase's cycle CPU goes (NVML sweep, identity resolution,
signals, progress files, the rest), and checks:

* agent RSS < 60 MiB at every sample;
* RSS at the end of the quiet period within 10 MiB of the idle RSS. Nothing is forced: the
  benchmark calls no gc.collect() or malloc_trim() before it measures (what the agent does
  itself is all); afterwards it asks the agent for both and prints what they would give back;
* cycle CPU grows with live containers, not with recently seen ones: the last minute of churn
  costs no more than the first (same arrivals and live count, many more gone containers
  retained); N live containers without churn cost no more after churn than before it; no
  containers cost no more after churn than before it. "No more" = within TOLERANCE + 1 ms.
  The end of churn itself costs more than the same live count without churn by what new
  containers cost (identifying their pids above all); that is printed, per new container.

Exit status 1 when a target is missed. Needs root (cgroups). Everything it starts is stopped
and removed on exit. `--quick` (CI): 20 starts/s for 20 s, short phases, the agent keeping
256 gone containers' counters instead of 4,096 (so that the cap is reached), under a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TARGET_RSS_MIB = 60.0
TARGET_RSS_RETURN_MIB = 10.0
TOLERANCE = 0.25  # cycle CPU may differ by this fraction (and 1 ms) before it counts as growth
NOISE_MS = 1.0
SCRAPE_S = 15.0
STAGES = ("nvml", "resolve", "signals", "progress")
PROGRESS_EVERY = 10  # one container in this many declares gpuwatch.io/progress-file
NAMESPACES = 16
MIB = 1 << 20


# ---- the agent side (runs in its own interpreter) ---------------------------------------

def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def _trim_test() -> list[float]:
    """RSS now, after gc.collect(), and after malloc_trim(0): how much of the RSS is garbage
    not yet collected, and how much is memory the allocators hold but do not use."""
    import ctypes
    import gc

    sizes = [_rss_mib()]
    gc.collect()
    sizes.append(_rss_mib())
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    sizes.append(_rss_mib())
    return sizes


def _retained(sampler: Any) -> dict[str, int]:
    """Sizes of the per-container state the pipeline keeps (for the table)."""
    state = sampler._state
    sizes = {"counters": len(state.containers), "pod_counters": len(state.pods)}
    resolver = sampler._resolver
    if hasattr(resolver, "cache_sizes"):
        sizes.update({f"resolver_{k}": v for k, v in resolver.cache_sizes().items()})
    progress = sampler._progress_source
    tracks = getattr(progress, "_tracks", None)
    if tracks is not None:
        sizes["progress"] = len(tracks) + len(getattr(progress, "_gone", ()))
    return sizes


class _Stages:
    """Thread CPU per stage of the current cycle, by wrapping the sources' entry points."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.new_pids = 0
        self._known: set[int] = set()

    def wrap(self, obj: Any, method: str, stage: str) -> Any:
        inner = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            c0 = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.cpu[stage] = self.cpu.get(stage, 0.0) + time.thread_time() - c0

        setattr(obj, method, timed)
        return obj

    def count_new(self, pids: Any) -> None:
        """GPU pids the resolver has not been asked about in the previous cycle."""
        current = set(pids)
        self.new_pids = len(current - self._known)
        self._known = current


def agent_child(args: argparse.Namespace) -> None:
    from gpuwatch.containers import BundleRoots
    from gpuwatch.exporter.metrics_server import registry_for, serve
    from gpuwatch.pipeline.sampler import build_sampler
    from gpuwatch.signals.health import HealthTracker
    from gpuwatch.signals.kmsg import KmsgReader
    from gpuwatch.signals.network import NetworkReader
    from gpuwatch.signals.signal_collector import SignalCollector

    defaults = BundleRoots()
    roots = BundleRoots(containerd_tasks=(args.tasks_dir, *defaults.containerd_tasks))
    signals = SignalCollector(health=HealthTracker(), kmsg=KmsgReader(args.kmsg),
                              network=NetworkReader(max_netns_per_cycle=8))
    sampler = build_sampler(nvml_library=args.nvml_library, interval_s=args.interval, node="churn",
                            bundle_roots=roots, signal_source=signals)
    if args.max_retired is not None:
        sampler.max_retired_counters = args.max_retired
    stages = _Stages()
    factory = sampler._factory
    sampler._factory = lambda: stages.wrap(factory(), "sweep", "nvml")
    resolver = sampler._resolver
    stages.wrap(resolver, "begin_sweep", "resolve")
    stages.wrap(resolver, "resolve_pids", "resolve")
    stages.wrap(signals, "collect", "signals")
    if sampler._progress_source is not None:
        stages.wrap(sampler._progress_source, "collect", "progress")
    resolve_pids = resolver.resolve_pids

    def counted(pids: Any) -> Any:
        pids = list(pids)
        stages.count_new(pids)
        return resolve_pids(pids)

    resolver.resolve_pids = counted  # type: ignore[method-assign]
    sample = sampler._sample

    def cycle() -> Any:
        stages.cpu = {}
        stages.new_pids = 0
        return sample()

    sampler._sample = cycle  # type: ignore[method-assign]
    profiler = None
    if args.profile:  # the sampler thread's cycles only
        import cProfile

        profiler = cProfile.Profile()
        sampler._sample = lambda: profiler.runcall(cycle)  # type: ignore[method-assign]
    registry = registry_for(sampler.latest)
    server = serve(registry, "127.0.0.1", 0, get_snapshot=sampler.latest)
    stop = threading.Event()

    def wait_for_parent() -> None:
        sys.stdin.read()  # EOF: the parent is done (or gone)
        stop.set()

    threading.Thread(target=wait_for_parent, daemon=True).start()
    print(json.dumps({"port": server.port, "rss_mib": _rss_mib()}), flush=True)
    trim = threading.Event()
    signal.signal(signal.SIGUSR1, lambda signum, frame: trim.set())
    sampler.start()
    last = None
    try:
        while not stop.wait(0.05):
            if trim.is_set():
                trim.clear()
                print(json.dumps({"trim": _trim_test()}), flush=True)
            snap = sampler.latest()
            if snap is last or snap.cycle_cpu_seconds is None:
                continue
            last = snap
            live = {c.identity.key for c in snap.containers if c.identity.is_container}
            record = {"t": time.monotonic(), "cpu": snap.cycle_cpu_seconds, "wall": snap.cycle_seconds,
                      "up": snap.gpu_up, "live": len(live),
                      "procs": sum(len(c.processes) for c in snap.containers),
                      "new_pids": stages.new_pids, **{f"{k}_cpu": v for k, v in stages.cpu.items()},
                      "rss": _rss_mib(), **_retained(sampler)}
            print(json.dumps(record), flush=True)
    finally:
        server.stop()
        sampler.stop()
        if profiler is not None:
            import pstats

            pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)
        if args.trace_memory:
            import tracemalloc

            traced = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            print("allocated at the end, by line:", file=sys.stderr)
            for stat in traced.statistics("lineno")[:30]:
                print(f"  {stat}", file=sys.stderr)


# ---- the node side: containers ------------------------------------------------------------

@dataclass
class _Container:
    index: int
    pod_dir: Path
    cgroup_dir: Path
    bundle_dir: Path
    process: subprocess.Popen[bytes]
    ends_at: float  # when its worker is due to exit (inf: until stopped)
    exited: bool = False


@dataclass
class Churn:
    """Starts containers (cgroup + bundle + simworker) and removes them when they exit."""

    top: Path  # bench-owned parent cgroup (v2)
    tasks_dir: Path  # <containerd task root>; bundles go to <tasks_dir>/k8s.io/<id>
    worker: str
    env: dict[str, str]
    gpus: int
    mib: float
    live: list[_Container] = field(default_factory=list)
    dying: list[_Container] = field(default_factory=list)
    started: int = 0
    start_times: list[float] = field(default_factory=list)
    start_cpu_s: float = 0.0
    failed_removals: int = 0

    def start(self, lifetime_s: float) -> None:
        c0 = time.process_time()
        index = self.started
        self.started += 1
        pod_uid = str(uuid.uuid4())
        container_id = secrets.token_hex(32)
        pod_dir = self.top / f"kubepods-besteffort-pod{pod_uid.replace('-', '_')}.slice"
        cgroup_dir = pod_dir / f"cri-containerd-{container_id}.scope"
        pod_dir.mkdir()
        cgroup_dir.mkdir()
        bundle_dir = self.tasks_dir / "k8s.io" / container_id
        bundle_dir.mkdir()
        annotations = {
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.container-name": "worker",
            "io.kubernetes.cri.sandbox-name": f"churn-{index}",
            "io.kubernetes.cri.sandbox-namespace": f"churn-ns-{index % NAMESPACES}",
            "io.kubernetes.cri.sandbox-uid": pod_uid,
        }
        if index % PROGRESS_EVERY == 0:
            annotations["gpuwatch.io/progress-file"] = "/tmp/gpuwatch-churn-loss"
        (bundle_dir / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "annotations": annotations}))
        procs = os.fsencode(cgroup_dir / "cgroup.procs")

        def enter_cgroup() -> None:  # between fork and exec: raw syscalls only
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)

        argv = [self.worker, "--gpu", str(index % self.gpus), "--mib", str(self.mib)]
        if lifetime_s != float("inf"):
            argv += ["--lifetime-s", f"{lifetime_s:.2f}"]
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, env=self.env, cwd="/", preexec_fn=enter_cgroup)
        self.live.append(_Container(index, pod_dir, cgroup_dir, bundle_dir, process, time.monotonic() + lifetime_s))
        self.start_times.append(time.monotonic())
        self.start_cpu_s += time.process_time() - c0

    def reap(self, now: float) -> None:
        """Remove the containers whose worker exited (their cgroups, their bundles)."""
        still: list[_Container] = []
        for container in self.live:
            if container.ends_at <= now and container.process.poll() is not None:
                self.dying.append(container)
            else:
                still.append(container)
        self.live = still
        self.dying = [c for c in self.dying if not self._remove(c)]

    def stop_all(self) -> None:
        """Kill every live container (cgroup.kill) and remove them all."""
        for container in self.live:
            with contextlib.suppress(OSError):
                (container.cgroup_dir / "cgroup.kill").write_text("1")
        for container in self.live:
            try:
                container.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                container.process.kill()
                container.process.wait()
        self.dying.extend(self.live)
        self.live = []
        deadline = time.monotonic() + 10
        while self.dying and time.monotonic() < deadline:
            self.dying = [c for c in self.dying if not self._remove(c)]
            if self.dying:
                time.sleep(0.05)
        self.failed_removals += len(self.dying)

    def _remove(self, container: _Container) -> bool:
        for directory in (container.cgroup_dir, container.pod_dir):
            try:
                directory.rmdir()
            except FileNotFoundError:
                continue
            except OSError as err:
                if err.errno == errno.EBUSY:
                    return False  # the exited worker is not out of the cgroup yet: next time
                raise
        shutil.rmtree(container.bundle_dir, ignore_errors=True)
        return True


# ---- the run ------------------------------------------------------------------------------

@dataclass
class Phase:
    name: str
    start: float
    end: float = float("inf")


class AgentReader:
    """Reads the agent child's per-cycle records in a thread."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        assert process.stdout is not None
        first = process.stdout.readline()
        if not first:
            raise RuntimeError("the agent child exited before it was ready")
        hello = json.loads(first)
        self.port: int = hello["port"]
        self.records: list[dict[str, Any]] = []
        self.trim: list[float] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if "trim" in record:
                    self.trim = record["trim"]
                else:
                    self.records.append(record)

    def latest(self) -> dict[str, Any] | None:
        return self.records[-1] if self.records else None


def _sleep_until(deadline: float, tick: Callable[[], None] | None = None) -> None:
    while True:
        now = time.monotonic()
        if now >= deadline:
            return
        if tick is not None:
            tick()
        time.sleep(min(0.05, deadline - now))


def run(args: argparse.Namespace) -> int:
    from gpuwatch.sim import cgroups, down, sim_env, up

    if os.geteuid() != 0:
        print("bench_churn needs root (it makes cgroups)", file=sys.stderr)
        return 2
    mounts = cgroups.detect()
    if mounts.v2 is None:
        print("bench_churn needs a cgroup v2 hierarchy", file=sys.stderr)
        return 2

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)  # clean up on SIGTERM too (and on SIGINT, also in background)
    signal.signal(signal.SIGINT, interrupted)
    work = Path(tempfile.mkdtemp(prefix="gpuwatch-churn-"))
    name = f"churn{os.getpid()}"
    state = work / "state"
    node = up(devices=args.gpus, name=name, memory_bytes=80 << 30, state_path=state, root=work / "simroot")
    env = sim_env(node)
    worker_env = {"PATH": "/usr/bin:/bin", **{k: env[k] for k in ("LD_LIBRARY_PATH", "GPUWATCH_SIM_STATE",
                                                                    "GPUWATCH_SIM_ROOT", "GPUWATCH_SIM_LIBCUDA")}}
    tasks_dir = work / "tasks"
    (tasks_dir / "k8s.io").mkdir(parents=True)
    top = mounts.v2 / f"gpuwatch-churn-{os.getpid()}"
    top.mkdir()
    churn = Churn(top, tasks_dir, str(node.libraries.worker_path), worker_env, args.gpus, args.mib)
    child: subprocess.Popen[str] | None = None
    phases: list[Phase] = []
    scrapes: list[float] = []
    mean_life = (args.lifetime_min + args.lifetime_max) / 2
    baseline_n = max(1, round(args.rate * mean_life))
    churn_starts = 0
    churn_wall = 0.0
    rng = random.Random(1)
    try:
        child_env = {**os.environ, "GPUWATCH_SIM_STATE": str(state)}
        child_env.pop("LD_LIBRARY_PATH", None)
        child = subprocess.Popen(
            [sys.executable, *(["-X", "tracemalloc=1"] if args.trace_memory else []), __file__, "--agent-child",
             "--nvml-library", str(node.libraries.nvml_path), "--interval", str(args.interval),
             "--tasks-dir", str(tasks_dir), "--kmsg", str(node.kmsg_path),
             *(["--profile"] if args.profile else []), *(["--trace-memory"] if args.trace_memory else []),
             *(["--max-retired", str(args.max_retired)] if args.max_retired is not None else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env)
        agent = AgentReader(child)
        next_scrape = time.monotonic() + SCRAPE_S

        def scrape() -> None:
            nonlocal next_scrape
            if time.monotonic() < next_scrape:
                return
            next_scrape += SCRAPE_S
            w0 = time.perf_counter()
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=10).read()
                scrapes.append(time.perf_counter() - w0)

        def tick() -> None:
            churn.reap(time.monotonic())
            scrape()

        def phase(label: str) -> Phase:
            now = time.monotonic()
            if phases:
                phases[-1].end = now
            phases.append(Phase(label, now))
            print(f"[{now - phases[0].start:6.0f} s] {label}", flush=True)
            return phases[-1]

        phase("idle")
        _sleep_until(time.monotonic() + args.idle, tick)

        phase("baseline")  # the live count churn will keep (rate x mean lifetime), none starting
        for _ in range(baseline_n):
            churn.start(float("inf"))
        _sleep_until(time.monotonic() + args.baseline, tick)
        churn.stop_all()
        phase("settle")
        _sleep_until(time.monotonic() + max(3 * args.interval, 3.0), tick)

        phase("churn")
        t0 = time.monotonic()
        end = t0 + args.duration
        next_start = t0
        gap = 1.0 / args.rate
        while True:
            now = time.monotonic()
            if now >= end:
                break
            while next_start <= now and next_start < end:
                churn.start(rng.uniform(args.lifetime_min, args.lifetime_max))
                next_start += gap
            tick()
            time.sleep(max(0.0, min(next_start, end) - time.monotonic()))
        churn_starts = churn.started - baseline_n
        churn_wall = time.monotonic() - t0
        churn.stop_all()

        phase("quiet")
        _sleep_until(time.monotonic() + args.quiet, tick)
        child.send_signal(signal.SIGUSR1)  # what gc + malloc_trim would give back now (after the RSS check)

        phase("after")  # the baseline's live count again, now with churn's gone containers retained
        for _ in range(baseline_n):
            churn.start(float("inf"))
        _sleep_until(time.monotonic() + args.baseline, tick)
        phases[-1].end = time.monotonic()
        time.sleep(2 * args.interval)  # the last cycle's record
    finally:
        if child is not None:
            assert child.stdin is not None
            with contextlib.suppress(OSError):
                child.stdin.close()
            try:
                child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.send_signal(signal.SIGKILL)
                child.wait()
        churn.stop_all()
        with contextlib.suppress(OSError):
            top.rmdir()
        down(name, state_path=state)
        shutil.rmtree(work, ignore_errors=True)
    if child.returncode not in (0, None) or not agent.records:
        print(f"the agent child failed (exit {child.returncode})", file=sys.stderr)
        return 1
    return report(args, agent.records, phases, churn_starts, churn_wall, churn, scrapes, baseline_n, agent.trim)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _in(records: list[dict[str, Any]], start: float, end: float) -> list[dict[str, Any]]:
    return [r for r in records if start <= r["t"] < end]


def report(args: argparse.Namespace, records: list[dict[str, Any]], phases: list[Phase], churn_starts: int,
           churn_wall: float, churn: Churn, scrapes: list[float], baseline_n: int, trim: list[float]) -> int:
    by_name = {p.name: p for p in phases}
    t0 = phases[0].start
    rate = churn_starts / churn_wall if churn_wall > 0 else 0.0
    print()
    print(f"churn: {churn_starts} containers started in {churn_wall:.0f} s = {rate:.1f} starts/s "
          f"(target {args.rate:g}/s), each living {args.lifetime_min:g}-{args.lifetime_max:g} s; "
          f"start cost in the driver {churn.start_cpu_s / max(churn.started, 1) * 1000:.2f} ms CPU each")
    print(f"{len(records)} agent cycles at {args.interval:g} s; {len(scrapes)} scrapes, "
          f"wall p50 {statistics.median(scrapes) * 1000 if scrapes else 0:.1f} ms")
    print()
    window = 60.0 if not args.quick else 10.0
    print(f"per phase, per {window:.0f} s: starts/s achieved; live = containers in the snapshot (median); "
          "retained = per-container kernel-second counters kept, live + gone (max); agent RSS MiB; "
          "sample cycle thread CPU ms; new GPU pids per cycle (mean)")
    print(f"{'t (s)':>7} {'phase':<9}{'starts/s':>9}{'live':>6}{'retained':>9}{'rss min':>8}{'med':>6}"
          f"{'max':>6}{'cpu p50':>8}{'p95':>6}{'max':>7}{'new/cyc':>8}")
    for ph in phases:
        start = ph.start
        while start < ph.end - 0.5:
            stop = min(start + window, ph.end)
            if ph.end - stop < window / 4:
                stop = ph.end  # a short remainder joins this row
            chunk = _in(records, start, stop)
            if chunk:
                started = sum(1 for t in churn.start_times if start <= t < stop)
                starts = f"{started / (stop - start):.1f}" if ph.name == "churn" else ""
                cpu = [r["cpu"] * 1000 for r in chunk]
                rss = [r["rss"] for r in chunk]
                print(f"{start - t0:>7.0f} {ph.name:<9}{starts:>9}"
                      f"{statistics.median([r['live'] for r in chunk]):>6.0f}"
                      f"{max(r['counters'] for r in chunk):>9}{min(rss):>8.1f}{statistics.median(rss):>6.1f}"
                      f"{max(rss):>6.1f}{_pct(cpu, .5):>8.1f}{_pct(cpu, .95):>6.1f}{max(cpu):>7.1f}"
                      f"{statistics.mean(r['new_pids'] for r in chunk):>8.1f}")
            start = stop
    last = records[-1]
    print("retained at the end: " + ", ".join(f"{k} {v}" for k, v in last.items()
                                              if k not in ("t", "cpu", "wall", "up", "live", "procs", "rss",
                                                           "new_pids") and not k.endswith("_cpu")))
    idle, base, churn_phase, quiet, after = (by_name[n] for n in ("idle", "baseline", "churn", "quiet", "after"))

    def steady(ph: Phase) -> list[dict[str, Any]]:
        """A phase's cycles with its containers all up and none new."""
        return [r for r in _in(records, ph.start, ph.end) if r["live"] >= 0.9 * baseline_n and r["new_pids"] <= 1]

    def second_half(ph: Phase) -> list[dict[str, Any]]:
        return _in(records, ph.start + (ph.end - ph.start) / 2, ph.end) or _in(records, ph.start, ph.end)

    before_rows, after_rows = steady(base), steady(after)
    span = min(window, (churn_phase.end - churn_phase.start) / 3)
    skip = min(10.0, span)  # the first seconds of churn: live containers still ramping up
    early = _in(records, churn_phase.start + skip, churn_phase.start + skip + span)
    late = _in(records, churn_phase.end - span, churn_phase.end)
    idle_rows, quiet_rows = second_half(idle), second_half(quiet)
    if not all((before_rows, after_rows, early, late, idle_rows, quiet_rows)):
        print("too few cycles in a phase to compare", file=sys.stderr)
        return 1

    def med(rows: list[dict[str, Any]], key: str = "cpu") -> float:
        return statistics.median(r.get(key, 0.0) * 1000 for r in rows)

    def rest(row: dict[str, Any]) -> float:
        return row["cpu"] - sum(row.get(f"{n}_cpu", 0.0) for n in STAGES)

    print()
    print("where a cycle's CPU goes (p50 ms): nvml = the GPU sweep (pynvml and the fake libnvidia-ml), resolve =")
    print("pid -> container identity, signals = health, kernel log, network, progress = progress files,")
    print("rest = attribution, probes, snapshot")
    print(f"{'':<30}{'live':>6}{'new/cyc':>8}{'retained':>9}{'cycle':>8}{'nvml':>7}{'resolve':>8}{'signals':>8}"
          f"{'progress':>9}{'rest':>7}")
    rows_by_label = (("idle, before churn", idle_rows), ("no churn, before churn", before_rows),
                     ("churn, start", early), ("churn, end", late), ("idle, after churn", quiet_rows),
                     ("no churn, after churn", after_rows))
    for label, rows in rows_by_label:
        print(f"{label:<30}{statistics.median(r['live'] for r in rows):>6.0f}"
              f"{statistics.mean(r['new_pids'] for r in rows):>8.1f}{max(r['counters'] for r in rows):>9}"
              f"{med(rows):>8.1f}{med(rows, 'nvml_cpu'):>7.1f}{med(rows, 'resolve_cpu'):>8.1f}"
              f"{med(rows, 'signals_cpu'):>8.1f}{med(rows, 'progress_cpu'):>9.1f}"
              f"{statistics.median(rest(r) for r in rows) * 1000:>7.1f}")
    new_late = statistics.mean(r["new_pids"] for r in late)
    arrivals_ms = med(late) - med(before_rows)
    print(f"churn's own cost at its end: {arrivals_ms:.1f} ms per cycle over the same live count without churn, "
          f"for {new_late:.0f} new containers a cycle ({arrivals_ms / max(new_late, 1) * 1000:.0f} us each; "
          f"identifying their pids: {med(late, 'resolve_cpu') - med(before_rows, 'resolve_cpu'):.1f} ms)")
    print()

    ok_all = True

    def check(label: str, ok: bool, detail: str) -> None:
        nonlocal ok_all
        ok_all &= ok
        print(f"{label:<56}{'yes' if ok else 'NO':>4}  {detail}")

    def not_higher(new: float, old: float) -> bool:
        return new <= old * (1 + TOLERANCE) + NOISE_MS

    rss_max = max(r["rss"] for r in records)
    check(f"RSS < {TARGET_RSS_MIB:.0f} MiB throughout", rss_max < TARGET_RSS_MIB, f"max {rss_max:.1f} MiB")
    idle_mib = statistics.median(r["rss"] for r in idle_rows)
    end_mib = statistics.median(r["rss"] for r in quiet_rows[-10:])
    trimmed = (f"; then gc.collect() {trim[1]:.1f}, malloc_trim(0) {trim[2]:.1f} MiB (not counted)"
               if len(trim) == 3 else "")
    check(f"RSS back within {TARGET_RSS_RETURN_MIB:.0f} MiB of idle after churn",
          end_mib - idle_mib <= TARGET_RSS_RETURN_MIB,
          f"idle {idle_mib:.1f} MiB, end of quiet {end_mib:.1f} MiB ({end_mib - idle_mib:+.1f}){trimmed}")
    check("cycle CPU, end of churn vs start of churn", not_higher(med(late), med(early)),
          f"p50 {med(late):.1f} vs {med(early):.1f} ms, retained counters "
          f"{max(r['counters'] for r in early)} -> {max(r['counters'] for r in late)}")
    check("cycle CPU, same live count, after churn vs before", not_higher(med(after_rows), med(before_rows)),
          f"p50 {med(after_rows):.1f} vs {med(before_rows):.1f} ms at "
          f"{statistics.median(r['live'] for r in after_rows):.0f} live, with "
          f"{max(r['counters'] for r in after_rows)} vs {max(r['counters'] for r in before_rows)} counters")
    check("cycle CPU, no live containers, after churn vs before", not_higher(med(quiet_rows), med(idle_rows)),
          f"p50 {med(quiet_rows):.1f} vs {med(idle_rows):.1f} ms, with {max(r['counters'] for r in quiet_rows)} "
          f"vs {max(r['counters'] for r in idle_rows)} counters")
    if rate < args.rate * 0.9:
        print(f"note: {rate:.1f} starts/s reached of {args.rate:g}/s asked: the driver spends "
              f"{churn.start_cpu_s / max(churn.started, 1) * 1000:.1f} ms CPU per start (fork+exec, cgroup "
              f"mkdir, bundle) and shares {os.cpu_count()} CPUs with the workers and the agent")
    print("all targets met" if ok_all else "a target was missed")
    return 0 if ok_all else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=50.0, help="container starts per second")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of churn")
    parser.add_argument("--lifetime-min", type=float, default=2.0)
    parser.add_argument("--lifetime-max", type=float, default=5.0)
    parser.add_argument("--idle", type=float, default=60.0, help="seconds without containers first")
    parser.add_argument("--baseline", type=float, default=60.0,
                        help="seconds with rate x mean lifetime long-lived containers, no churn (before it)")
    parser.add_argument("--quiet", type=float, default=120.0, help="seconds without containers after churn")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--mib", type=float, default=16.0, help="GPU memory per container (MiB)")
    parser.add_argument("--interval", type=float, default=1.0, help="sample interval (s)")
    parser.add_argument("--quick", action="store_true", help="CI: 20 starts/s for 20 s, short phases (< 60 s)")
    parser.add_argument("--max-retired", type=int, default=None,
                        help="counters of gone containers the agent keeps (default: the agent's, 4096; "
                             "--quick: 256, so that a short run reaches the cap)")
    parser.add_argument("--profile", action="store_true",
                        help="print the agent's cProfile of its sample cycles (stderr) at the end")
    parser.add_argument("--trace-memory", action="store_true",
                        help="run the agent under tracemalloc and print what is allocated at the end (by line; "
                             "this slows it and adds to its RSS)")
    parser.add_argument("--agent-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nvml-library", help=argparse.SUPPRESS)
    parser.add_argument("--tasks-dir", help=argparse.SUPPRESS)
    parser.add_argument("--kmsg", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent_child:
        agent_child(args)
        return 0
    if args.quick:
        args.rate, args.duration, args.idle, args.baseline, args.quiet = 20.0, 20.0, 5.0, 7.0, 7.0
        args.lifetime_min, args.lifetime_max = 1.5, 3.0
        if args.max_retired is None:
            args.max_retired = 256
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
