"""The node agent: wires sources, the sampler and the consumers together, and tears them down.

Start order: the node lock (one agent per node; a second one exits here, having touched
nothing) -> recovery (thaw what a gone agent left frozen: freeze markers on the cgroups +
the state file) -> probes (optional) -> sampler -> exporter -> enforcer (optional; its
policy is read and checked in a worker meanwhile) -> webhook (optional). Stop order is the
reverse, on every exit path: the webhook stops accepting, the enforcer thaws what it froze,
the exporter stops, the sampler stops, the probes detach, the lock is released.
Each optional part that cannot start is logged once with what the user loses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuwatch.core.errors import GpuwatchError, ProbesUnavailable

if TYPE_CHECKING:  # the probes meet the enforcer's protocol here, where the agent wires them
    from gpuwatch.enforce.kernel_limits import KernelProbes
    from gpuwatch.probes.manager import ProbeManager

log = logging.getLogger("gpuwatch.agent")



# Packages whose `__init__` imports far more than the agent uses: prometheus_client's pulls
# in its HTTP servers, push gateway client and ASGI/WSGI apps (http.server, wsgiref, email,
# urllib.request, ssl with libssl/libcrypto): ~7 MiB of the agent's RSS, for the metric
# family classes and the registry that live in its submodules.
DEFERRED_PACKAGES = ("prometheus_client",)


def defer_package_init(name: str) -> bool:
    """Import package `name` without running its `__init__` until a name defined there is used.

    Installs a module object for the package with its real `__spec__` and `__path__`, so its
    submodules (`prometheus_client.core`, `.registry`, ...) import as usual and each pulls in
    only what it needs. The first access to any other attribute (`from prometheus_client
    import generate_latest`, `prometheus_client.Counter`) runs the real `__init__` in that
    same module object, once, under a lock, and the module is an ordinary module from then on:
    code that wants the whole package still gets it. Does nothing (False) when the package is
    already imported or not installed. Why: RSS -- see DEFERRED_PACKAGES.
    """
    import importlib.util
    import sys
    import types

    if name in sys.modules:
        return False
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return False
    loader = spec.loader
    lock = threading.RLock()

    class _DeferredPackage(types.ModuleType):
        def __getattr__(self, attr: str) -> Any:
            if attr.startswith("__") and attr != "__all__":
                raise AttributeError(attr)  # dunder probes (copy, pickle, inspect) need no load
            try:
                submodule = importlib.util.find_spec(f"{name}.{attr}")
            except (ImportError, ValueError):
                submodule = None
            if submodule is not None:
                # `from pkg import submodule` asks hasattr() first: the import system then
                # imports the submodule itself, without the package's __init__
                raise AttributeError(attr)
            with lock:
                if type(self) is _DeferredPackage:
                    self.__class__ = types.ModuleType  # type: ignore[assignment]  # an ordinary module now
                    loader.exec_module(self)
            return getattr(self, attr)

    module = _DeferredPackage(name)
    module.__spec__ = spec
    module.__loader__ = loader
    module.__file__ = spec.origin
    module.__package__ = name
    module.__path__ = list(spec.submodule_search_locations)
    sys.modules[name] = module
    return True

@dataclass(frozen=True)
class AgentConfig:
    listen_host: str = "127.0.0.1"
    listen_port: int = 9400
    node: str | None = None
    interval_s: float = 1.0
    nvml_library: str | None = None
    proc_root: str = "/proc"
    probes: bool | None = None  # None: on when available
    device_prefix: str = "/dev/nvidia"
    launch_uprobes: bool = False
    policy_path: str | None = None
    dry_run: bool = False
    audit_log: str = "/var/log/gpuwatch/audit.jsonl"
    frozen_state_path: str = "/run/gpuwatch/frozen.json"
    lock_path: str = "/run/gpuwatch/agent.lock"  # one agent per node (agent/nodelock.py)
    bundle_roots: Any = None  # gpuwatch.containers.BundleRoots; None: the runtimes' defaults
    webhook: tuple[str, int] | None = None
    webhook_token_file: str | None = None
    webhook_allow_remote: bool = False
    snapshot_remote: bool = False  # serve /snapshot.json on a non-loopback --listen too
    kmsg_path: str | None = "/dev/kmsg"  # kernel log with the driver's Xid lines; None: off
    nfd_features_file: str | None = None  # NFD local-source feature file; None: off
    ignored_xids: frozenset[int] | None = None  # None: signals.health.DEFAULT_IGNORED_XIDS
    nvml_error_sweeps: int = 3
    network: bool = True  # node NICs, RDMA ports, containers' network bytes
    network_exclude: str | None = None  # NIC name regex left out; None: DEFAULT_NIC_EXCLUDE
    health_stall_intervals: int = 10  # /healthz fails after this many intervals without a cycle
    idle_without_gpus: bool = True  # no NVIDIA device nodes: idle until some appear (agent/idle.py)


def _start_probes(config: AgentConfig, stack: ExitStack) -> ProbeManager | None:
    """Start BPF probes, or say exactly what is off and carry on with NVML alone."""
    if config.probes is False:
        log.info("probes disabled (--no-probes): per-container ioctl/allocation counts are off")
        return None
    try:
        from gpuwatch.probes.manager import ProbeConfig, ProbeManager

        manager = ProbeManager(ProbeConfig(device_prefix=config.device_prefix,
                                           launch_uprobes=config.launch_uprobes, proc_root=config.proc_root))
        manager.start()
    except (ProbesUnavailable, ImportError) as err:
        if config.probes:
            raise
        log.warning("BPF unavailable: per-container ioctl/allocation counts and in-kernel "
                    "enforcement are off; NVML attribution continues (%s)", err)
        return None
    stack.callback(manager.stop)
    log.info("kernel probes attached (device prefix %s)", config.device_prefix)
    return manager


def _build_signals(config: AgentConfig) -> Any:
    """The per-cycle node signals: health, kernel-log Xids, topology, network."""
    from gpuwatch.signals.health import DEFAULT_IGNORED_XIDS, HealthTracker
    from gpuwatch.signals.kmsg import KmsgReader
    from gpuwatch.signals.signal_collector import DEFAULT_NIC_EXCLUDE, SignalCollector

    health = HealthTracker(ignored_xids=config.ignored_xids if config.ignored_xids is not None
                           else DEFAULT_IGNORED_XIDS, nvml_error_sweeps=config.nvml_error_sweeps)
    kmsg = KmsgReader(config.kmsg_path) if config.kmsg_path else None
    if kmsg is None:
        log.info("--kmsg none: Xids are not attributed to containers (GPU-level Xids from NVML continue)")
    network = None
    if config.network:
        from gpuwatch.signals.network import NetworkReader

        # 8 pod namespaces per interval (round-robin): 200 pods are all refreshed every 25 s
        network = NetworkReader(proc_root=config.proc_root, max_netns_per_cycle=8)
    exclude = config.network_exclude if config.network_exclude is not None else DEFAULT_NIC_EXCLUDE
    return SignalCollector(health=health, kmsg=kmsg, network=network, nic_exclude=exclude)


class _NfdFeatures:
    """Keeps the NFD feature file in step with the snapshots (labels from the last good sweep
    while NVML is down, with the health verdicts of the current cycle)."""

    def __init__(self, path: str, interval_s: float) -> None:
        from gpuwatch.signals.nfd import FeatureFileWriter

        self.writer = FeatureFileWriter(path, interval_s)
        self._last_good: Any = None

    def update(self, snapshot: Any) -> None:
        import dataclasses

        from gpuwatch.signals.nfd import node_labels

        if snapshot.gpu_up and snapshot.devices:
            self._last_good = snapshot
        elif self._last_good is not None:
            snapshot = dataclasses.replace(self._last_good, signals=snapshot.signals)
        else:
            return  # nothing known about the GPUs yet: write no labels rather than wrong ones
        self.writer.update(node_labels(snapshot))

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        writes = CounterMetricFamily("gpuwatch_nfd_feature_file_writes",
                                     "Times the NFD feature file was (re)written.", value=self.writer.writes_total)
        errors = CounterMetricFamily("gpuwatch_nfd_feature_file_errors",
                                     "Failed writes of the NFD feature file.", value=self.writer.errors_total)
        return [writes, errors]


def _start_enforcer(config: AgentConfig, stack: ExitStack, registry: Any, probes: KernelProbes | None,
                    policy_load: Any, stop: threading.Event) -> Any | None:
    if policy_load is None or not config.policy_path:
        log.info("no --policy: enforcement is off (metrics only)")
        return None
    from gpuwatch.agent.enforcer_factory import build_enforcer
    from gpuwatch.enforce.enforcer import EnforcerConfig

    while not policy_load.wait(0.1):  # a large policy parses in a worker: SIGTERM is still heard
        if stop.is_set():
            return None
    policy_load.result()  # PolicyError: refuse to start with a broken policy
    settings = EnforcerConfig(dry_run=config.dry_run, frozen_state_path=config.frozen_state_path, recover=False,
                              lock_path=config.lock_path)
    enforcer = build_enforcer(config.policy_path, config.audit_log, settings, probes=probes, initial_policy=policy_load)
    stack.callback(enforcer.close)
    registry.register(enforcer.metrics_collector())
    log.info("enforcer on: policy %s%s, audit log %s", config.policy_path,
             " (dry run: nothing is acted on)" if config.dry_run else "", config.audit_log)
    return enforcer


def _webhook_token(config: AgentConfig) -> str | None:
    """Validate the acting endpoint's settings before anything starts; the token or None."""
    if config.webhook is None:
        return None
    from gpuwatch.core.errors import UnsafeConfiguration
    from gpuwatch.enforce.webhook.receiver import check_bind_address, token_from_env_or_file

    if not config.policy_path:
        raise UnsafeConfiguration("--webhook-listen needs --policy: alerts are turned into actions "
                                  "by the enforcer", fix="pass --policy FILE (may be alert-only)")
    check_bind_address(config.webhook[0], config.webhook_allow_remote)
    token = token_from_env_or_file(config.webhook_token_file)
    if token is None:
        raise UnsafeConfiguration("the enforcement webhook needs a token",
                                  fix="pass --webhook-token-file FILE (mode 600, >= 16 chars)")
    return token


def _start_webhook(config: AgentConfig, stack: ExitStack, enforcer: Any, token: str | None,
                   registry: Any) -> None:
    if config.webhook is None or token is None or enforcer is None:
        return
    from gpuwatch.enforce.webhook.receiver import WebhookServer

    host, port = config.webhook
    server = WebhookServer(host, port, token, enforcer.on_webhook, config.webhook_allow_remote)
    registry.register(server.metrics)  # gpuwatch_webhook_requests_total{result}
    server.start()
    stack.callback(server.stop)
    log.info("Alertmanager webhook on http://%s:%d%s (bearer token required)", host, server.port,
             server.PATH)


def _recover(config: AgentConfig) -> Any:
    """Thaw what a gone agent left frozen (the node lock is held); the metrics collector."""
    from gpuwatch.enforce.cgroup_ops import CgroupTree
    from gpuwatch.enforce.freeze.recovery import RecoveryMetrics, recover_node

    metrics = RecoveryMetrics()
    recover_node(CgroupTree(), config.frozen_state_path, config.lock_path, config.audit_log, metrics,
                 dry_run=config.dry_run)
    return metrics


def run_agent(config: AgentConfig, stop: threading.Event, reload_requested: threading.Event) -> None:
    """Run until `stop` is set; everything started is stopped again on the way out.

    Raises AgentAlreadyRunning (before touching anything) when another agent holds the lock,
    StateFileInUse when another agent (its own --lock-file) journals into the same --state-file."""
    from gpuwatch.agent.nodelock import NodeLock, StateFileLock

    # the node, then the journal (two simulated nodes must not share one --state-file)
    with NodeLock(config.lock_path), StateFileLock(config.frozen_state_path):
        _run_locked(config, stop, reload_requested)


def _run_locked(config: AgentConfig, stop: threading.Event, reload_requested: threading.Event) -> None:
    from gpuwatch.exporter.liveness import LoopHealth
    from gpuwatch.exporter.metrics_server import registry_for, serve
    from gpuwatch.pipeline.sampler import build_sampler

    node = config.node or socket.gethostname()
    if config.nvml_library:
        os.environ["GPUWATCH_NVML_LIBRARY"] = config.nvml_library
    webhook_token = _webhook_token(config)  # refuse unsafe settings before anything starts
    recovery = _recover(config)
    policy_load = None
    if config.policy_path:
        from gpuwatch.enforce.policy_reload import PolicyLoad

        policy_load = PolicyLoad(config.policy_path)  # read and checked while the rest starts
    if config.idle_without_gpus and not config.nvml_library:
        from gpuwatch.agent.idle import idle_until_devices, nvidia_devices

        if not nvidia_devices(config.device_prefix) and not idle_until_devices(
                node, config.device_prefix, config.listen_host, config.listen_port, config.interval_s, stop):
            return
    with ExitStack() as stack:
        probes = _start_probes(config, stack)
        sampler = build_sampler(nvml_library=config.nvml_library, interval_s=config.interval_s,
                                node=node, proc_root=config.proc_root, probe_source=probes,
                                bundle_roots=config.bundle_roots, signal_source=_build_signals(config))
        sampler.start()
        stack.callback(sampler.stop)
        registry = registry_for(sampler.latest)
        registry.register(recovery)
        nfd = _NfdFeatures(config.nfd_features_file, config.interval_s) if config.nfd_features_file else None
        if nfd is not None:
            registry.register(nfd)
            log.info("NFD feature file: %s (labels gpuwatch.io/*)", config.nfd_features_file)
        enforcer = _start_enforcer(config, stack, registry, probes, policy_load, stop)
        if stop.is_set():
            return
        # /snapshot.json carries the enforcer's per-container view (what top shows as STATE)
        served = sampler.latest if enforcer is None else (lambda: enforcer.decorate(sampler.latest()))
        health = LoopHealth(sampler.loop_beat_s, config.interval_s, config.health_stall_intervals)
        server = serve(registry, config.listen_host, config.listen_port, get_snapshot=served,
                       snapshot_remote=config.snapshot_remote, health=health)
        stack.callback(server.stop)
        log.info("serving metrics on http://%s:%d/metrics (node %s, interval %.2fs)",
                 config.listen_host, server.port, node, config.interval_s)
        _start_webhook(config, stack, enforcer, webhook_token, registry)
        pump = None
        if enforcer is not None and probes is not None:
            from gpuwatch.agent.event_pump import EventPump

            # stops, OOMs and GPU-process exits wake the sampler: admission within a cycle, not an interval
            pump = EventPump(probes.poll_events, sampler.wake).start()
            stack.callback(pump.stop)  # before the probes close their ring (the stack unwinds backwards)
        first = True
        # Each snapshot reaches the enforcer as soon as the sampler publishes it; the poll
        # bounds how long a stop waits.
        for snapshot in sampler.follow(stop, poll_s=min(config.interval_s / 4, 0.25)):
            if reload_requested.is_set():
                reload_requested.clear()
                if enforcer is not None:
                    enforcer.reload_requested = True  # read and checked in a worker (check_reload)
            if first:  # started: what start-up used and freed goes back to the kernel
                trim_malloc()
                first = False
            if nfd is not None:
                nfd.update(snapshot)
            if enforcer is not None:
                events = pump.take() if pump is not None else ()
                try:
                    enforcer.on_snapshot(snapshot, events)
                except GpuwatchError as err:
                    log.error("enforcement step failed: %s", err)
        log.info("stopping: detaching probes, thawing frozen containers, closing endpoints")


# -- the daemon process ----------------------------------------------------------------------
#
# `gpuwatch agent` parses its options with click, then hands the parsed AgentConfig to a fresh
# interpreter in the same process (exec: same pid, same parent, same stdio) running
# `python -m gpuwatch.agent.daemon`, which never imports click or the CLI: the daemon's RSS is what
# it runs, not what parsed its command line (click and the CLI's modules: ~1.3 MiB, 5% of the
# agent at a small node). GPUWATCH_AGENT_REEXEC=0 keeps the CLI's interpreter instead.

CONFIG_ENV = "GPUWATCH_AGENT_CONFIG"  # the parsed config, JSON; read and removed by the daemon
REEXEC_ENV = "GPUWATCH_AGENT_REEXEC"


def config_to_json(config: AgentConfig) -> str:
    """AgentConfig -> JSON (config_from_json reverses it exactly)."""
    import dataclasses
    import json

    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if fields["bundle_roots"] is not None:
        fields["bundle_roots"] = dataclasses.asdict(fields["bundle_roots"])
    if fields["ignored_xids"] is not None:
        fields["ignored_xids"] = sorted(fields["ignored_xids"])
    return json.dumps(fields)


def config_from_json(text: str) -> AgentConfig:
    """The AgentConfig config_to_json wrote."""
    import json

    fields = json.loads(text)
    if fields.get("bundle_roots") is not None:
        from gpuwatch.containers import BundleRoots

        fields["bundle_roots"] = BundleRoots(**{k: tuple(v) for k, v in fields["bundle_roots"].items()})
    if fields.get("ignored_xids") is not None:
        fields["ignored_xids"] = frozenset(fields["ignored_xids"])
    if fields.get("webhook") is not None:
        fields["webhook"] = (fields["webhook"][0], int(fields["webhook"][1]))
    return AgentConfig(**fields)


# glibc malloc (mallopt parameters, <malloc.h>). Each thread that allocates gets an arena of its
# own (up to 8 per core) that keeps ~0.7 MiB resident once used: with the probes' threads that was
# 3.5 MiB of a 28 MiB agent on a small node. The agent's threads take turns under the GIL and
# allocate little each, so one arena costs no measurable time. Fixed mmap and trim thresholds
# (instead of glibc's dynamic ones, which rise to the largest block ever freed) make a scrape's
# large transient buffers go back to the kernel when freed, instead of staying in the heap.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MALLOC_ARENAS = 1
MALLOC_THRESHOLD_BYTES = 128 * 1024  # glibc's default starting values, held fixed


def tune_malloc() -> bool:
    """Set the daemon's glibc malloc parameters (above); call before any thread starts.

    False where the C library is not glibc (nothing to tune). Only the daemon's own process
    calls this: `run_agent` inside another program (quickstart) leaves its allocator alone."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, MALLOC_ARENAS), (_M_MMAP_THRESHOLD, MALLOC_THRESHOLD_BYTES),
        (_M_TRIM_THRESHOLD, MALLOC_THRESHOLD_BYTES)))


def trim_malloc() -> None:
    """Give the heap's free pages back to the kernel (glibc malloc_trim), e.g. after start-up."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def run_until_signalled(config: AgentConfig, verbose: int) -> None:
    """Log to stderr, run the agent until SIGTERM/SIGINT; SIGHUP asks for a policy reload."""
    import signal
    from types import FrameType

    tune_malloc()
    for package in DEFERRED_PACKAGES:  # before anything imports it: see DEFERRED_PACKAGES
        defer_package_init(package)
    logging.basicConfig(level=logging.DEBUG if verbose > 1 else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    reload_requested = threading.Event()

    def _on_stop(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    def _on_hup(_signum: int, _frame: FrameType | None) -> None:
        reload_requested.set()

    signal.signal(signal.SIGTERM, _on_stop)
    signal.signal(signal.SIGINT, _on_stop)
    signal.signal(signal.SIGHUP, _on_hup)
    run_agent(config, stop, reload_requested)


def exec_daemon(config: AgentConfig, verbose: int, argv: list[str]) -> None:
    """Replace this process by `python -m gpuwatch.agent.daemon` running `config` (does not return).

    `argv` (the CLI's arguments) follows for `ps` only; the config travels in CONFIG_ENV.
    Raises OSError when the interpreter cannot be executed."""
    import json
    import sys

    env = dict(os.environ)
    env[CONFIG_ENV] = json.dumps({"config": config_to_json(config), "verbose": verbose})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "gpuwatch.agent.daemon", *argv], env)


def daemon_main() -> int:
    """`python -m gpuwatch.agent.daemon`: the agent of a config handed over by `gpuwatch agent`.

    Errors are reported as the CLI reports them ("Error: ..." on stderr, exit status 1)."""
    import json
    import sys

    payload = os.environ.pop(CONFIG_ENV, None)  # the agent's children do not inherit it
    if payload is None:
        print("Error: start the agent with `gpuwatch agent` (this module runs the config it hands over)",
              file=sys.stderr)
        return 2
    handed = json.loads(payload)
    try:
        run_until_signalled(config_from_json(handed["config"]), int(handed["verbose"]))
    except GpuwatchError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(daemon_main())
