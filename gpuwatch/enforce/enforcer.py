"""The enforcer: evaluate each snapshot against the policy and carry out the decisions.

    enforcer = Enforcer("/etc/gpuwatch/policy.yaml", EnforcerConfig(dry_run=False), audit=AuditLog(path))
    install_exit_handlers(enforcer)        # atexit + SIGTERM: thaw everything
    install_reload_handler(enforcer)       # SIGHUP: reload on the next snapshot
    registry.register(enforcer.metrics)    # prometheus Collector
    ... every interval: enforcer.on_snapshot(snapshot, probe_events)
    enforcer.close()

Evaluation is pure (gpuwatch.policy.evaluate); the Enforcer is the coordinator of the I/O
around it, each part with one job:

* the policy file: policy_reload.PolicyHolder (reload on SIGHUP or mtime change, read and
  checked in a worker so the snapshots keep their cadence; an invalid or refused file never
  replaces the running policy);
* the decisions: carried out by the actions (actions/, with freeze/thaw bookkeeping that
  survives a crash in freeze/), every one audited (dry-run and suppressed ones too) and
  counted in the metrics;
* the in-kernel limit: kernel_push.KernelLimitPush, behind the probe-vs-NVML safety net
  (inkernel_guard.InKernelGuard);
* the sharing annotations and device limits: device_sharing.DeviceSharing (`exclusive` ->
  every other container gets the held GPU denied by the device gate; `shared` + `gpu-share`
  -> the closed-loop throttle at that share unless the container's rule has a throttle step);
* what the enforcement looks like per container: enforcement_view.EnforcementView;
* Alertmanager alerts: webhook/intake.WebhookIntake.

On start it thaws whatever a crashed previous run left frozen (the cgroups' freeze markers
and the state file, enforce/freeze/frozen_state.py) unless the agent already did so under
its node lock.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

from gpuwatch.core.errors import EnforcementError
from gpuwatch.core.model import ContainerEnforcement, ContainerIdentity, Snapshot
from gpuwatch.enforce.actions import ActionResult, ActionSet, Status, build_actions
from gpuwatch.enforce.audit import DEFAULT_AUDIT_PATH, AuditLog
from gpuwatch.enforce.cgroup_ops import CgroupHandle, CgroupTree, own_cgroup_paths
from gpuwatch.enforce.control import BusySource, FreezeControl
from gpuwatch.enforce.device_sharing import DeviceSharing
from gpuwatch.enforce.enforcement_view import EnforcementView
from gpuwatch.enforce.freeze.frozen_state import DEFAULT_STATE_PATH, FrozenRegistry, RecoveryAction
from gpuwatch.enforce.freeze.markers import MarkerOwner
from gpuwatch.enforce.freeze.recovery import RecoveryMetrics
from gpuwatch.enforce.inkernel_guard import InKernelGuard
from gpuwatch.enforce.kernel_limits import DeviceGate, KernelLimitTable, NullDeviceGate, NullKernelLimits
from gpuwatch.enforce.kernel_push import KernelLimitPush
from gpuwatch.enforce.metrics import EnforcerMetrics
from gpuwatch.enforce.policy_reload import PolicyHolder, PolicyLoad
from gpuwatch.enforce.probe_events import convert_events
from gpuwatch.enforce.sharing_hooks import NodeContainers, NodeListing
from gpuwatch.enforce.webhook.intake import WebhookIntake
from gpuwatch.enforce.webhook.receiver import WebhookRequest
from gpuwatch.policy.evaluate import Decision, EvaluationResult, EvaluatorState, SafetyContext, evaluate
from gpuwatch.policy.events import KernelEventRecord, ProbeEvent
from gpuwatch.policy.match import select_rule
from gpuwatch.policy.probe_trust import ProbeNvmlCrossCheck
from gpuwatch.policy.rules import Policy

log = logging.getLogger(__name__)
EPOCH_THRESHOLD_S = 1e9
"""Snapshot timestamps above this are wall-clock (epoch) seconds, below it monotonic."""


@dataclass(frozen=True)
class Outcome:
    decision: Decision
    result: ActionResult


@dataclass(frozen=True)
class EnforcerConfig:
    """How the enforcer runs (values only; what it is plugged into is EnforcerHooks)."""

    dry_run: bool = False
    """Decide and audit, act on nothing (no action, no kernel map entry, no device gate)."""
    frozen_state_path: str | Path = DEFAULT_STATE_PATH
    """The freeze journal: what this agent froze, thawed by the next one after a crash."""
    own_cgroups: frozenset[str] | None = None
    """Cgroups never acted on (the agent's own); None: this process's cgroups."""
    throttle_control_s: float = 0.25
    node_scan_s: float = 30.0
    """How often the node's containers are listed for glob namespace quotas (every snapshot
    while a GPU is held exclusively)."""
    recover: bool = True
    """Thaw what a crashed run left frozen at start; False when the caller (the agent, under
    its node lock `lock_path`) already reconciled the node."""
    lock_path: str | Path | None = None
    """The node lock, written into the freeze markers this enforcer sets."""
    reload_wait_s: float = 0.1
    """How long on_snapshot waits for a policy reload's parse before going on with the running policy."""
    crosscheck: ProbeNvmlCrossCheck | None = None
    """Thresholds of the probe vs NVML cross-check (default max(64 MiB, 10%), 3 intervals)."""
    kernel_limit_action: str | None = None
    """The in-kernel action for every container ("event", "stop", "kill"); None: per rule."""


@dataclass(frozen=True)
class EnforcerHooks:
    """What the enforcer is plugged into; each None has a stand-in that does nothing real."""

    kernel_limits: KernelLimitTable | None = None
    """The probes' BPF limit map (None: NullKernelLimits, which only remembers)."""
    device_gate: DeviceGate | None = None
    """The cgroup device program (None: NullDeviceGate, which only records)."""
    node_containers: NodeContainers | None = None
    """Every container on the node, not only GPU users (exclusive gate, glob quotas)."""
    cgroups: CgroupTree | None = None
    """The cgroup tree the default actions act on (None: the host's)."""
    busy_source: BusySource | None = None
    """GPU busy seconds per container for the throttle's control loop (None: the snapshot's
    kernel_seconds_total, so throttle control runs at the sample interval)."""
    clock: Callable[[], float] | None = None
    """Must tick like the snapshots' timestamp_s (staleness, probe-event times). None: per
    snapshot, wall time for epoch timestamps, else CLOCK_MONOTONIC (the sampler's default).
    Audit records always carry wall time."""


class Enforcer:
    """Coordinates one policy's enforcement on the node; see the module docstring."""

    def __init__(
        self,
        policy_path: str | Path,
        config: EnforcerConfig | None = None,
        *,
        audit: AuditLog | None = None,
        hooks: EnforcerHooks | None = None,
        actions: ActionSet | None = None,
        initial_policy: PolicyLoad | None = None,
    ) -> None:
        """Load the policy (PolicyError if invalid), build the actions, thaw leftovers.

        `initial_policy`: the policy already read (the agent reads it in a worker so SIGTERM
        is heard while a large file parses); None: read it here. `actions`: None builds the
        default set (freeze/thaw on `hooks.cgroups`)."""
        config = config or EnforcerConfig()
        hooks = hooks or EnforcerHooks()
        self.config = config
        self.dry_run = config.dry_run
        self.clock = hooks.clock
        self.metrics = EnforcerMetrics()
        self.safety = SafetyContext(config.own_cgroups if config.own_cgroups is not None else own_cgroup_paths())
        self._owns_audit = audit is None
        self.audit = audit or AuditLog(DEFAULT_AUDIT_PATH)
        self._kernel_seconds: dict[str, float] = {}
        self._lock = threading.RLock()
        self.policy_file = PolicyHolder(policy_path, self.metrics.count_reload, config.reload_wait_s, initial_policy)
        self.metrics.policy_loaded_s = self.policy_file.loaded_s
        if actions is None:
            tree = hooks.cgroups or CgroupTree()
            control = FreezeControl(
                tree,
                FrozenRegistry(tree, config.frozen_state_path, owner=MarkerOwner.current(config.lock_path)),
                hooks.busy_source or self._snapshot_busy,
                throttle_control_s=config.throttle_control_s,
            )
            actions = build_actions(control, self._on_complete)
        elif actions.checkpoint.on_complete is None:
            actions.checkpoint.on_complete = self._on_complete
        self.actions = actions
        self.state = EvaluatorState()
        self.last_outcomes: list[Outcome] = []
        self.last_result: EvaluationResult | None = None
        self.last_latency_s = 0.0
        self._identities: dict[str, ContainerIdentity] = {}
        self._closed = False
        self._events: list[ProbeEvent] = []
        self.device_gate: DeviceGate = hooks.device_gate or NullDeviceGate()
        self.node_listing = NodeListing(hooks.node_containers, config.node_scan_s)
        self.sharing = DeviceSharing(self.device_gate, self.node_listing, self.safety, self._record, self.dry_run)
        self.kernel_limits = KernelLimitPush(hooks.kernel_limits or NullKernelLimits(), self.audit, self.safety,
                                             self.dry_run, config.kernel_limit_action)
        self.enforcement = EnforcementView(self.actions, self.dry_run)
        self.webhook = WebhookIntake(self.audit, self.safety, self.dry_run)
        self.recovery_metrics = RecoveryMetrics()
        self.kernel_guard = InKernelGuard(self.audit, self.dry_run, config.crosscheck)
        self.metrics.guard_family = self.kernel_guard.metric_family
        self.recovered = self.actions.control.registry.recover(self._on_recovery) if config.recover else []

    # -- policy -------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return self.policy_file.policy

    @property
    def policy_path(self) -> Path:
        return self.policy_file.path

    @property
    def reload_requested(self) -> bool:
        return self.policy_file.reload_requested

    @reload_requested.setter
    def reload_requested(self, value: bool) -> None:
        self.policy_file.reload_requested = value

    @property
    def last_reload_error(self) -> str:
        return self.policy_file.last_error

    def reload(self) -> bool:
        """Re-read the policy file now (waits for the parse); an invalid file keeps the
        running policy (logged + counted)."""
        with self._lock:
            ok = self.policy_file.reload()
        self.metrics.policy_loaded_s = self.policy_file.loaded_s
        return ok

    def check_reload(self) -> bool | None:
        """Reload if SIGHUP asked for it or the file changed (PolicyHolder.check)."""
        with self._lock:
            ok = self.policy_file.check()
        self.metrics.policy_loaded_s = self.policy_file.loaded_s
        return ok

    def _on_recovery(self, step: RecoveryAction) -> None:
        self.recovery_metrics.count(step)
        self.audit.record_recovery(step, dry_run=self.dry_run)

    # -- evaluation ---------------------------------------------------------------------
    def _snapshot_busy(self, key: str, _handle: CgroupHandle) -> Callable[[], float]:
        return lambda: self._kernel_seconds.get(key, 0.0)

    def metrics_collector(self) -> EnforcerMetrics:
        """The prometheus Collector to register (actions, limits, paused/throttled, reloads, deadlocks)."""
        return self.metrics

    def on_snapshot(self, snapshot: Snapshot,
                    probe_events: Sequence[ProbeEvent | KernelEventRecord] = ()) -> list[Decision]:
        """Evaluate one snapshot, act (unless dry-run), audit every decision.

        `probe_events`: evaluator ProbeEvents or the probes layer's events (converted)."""
        started = time.perf_counter()
        self.check_reload()
        clock = self._clock_for(snapshot)
        events = self._recent(convert_events(probe_events, wall=clock), clock())
        with self._lock:
            if self._closed:
                return []
            policy = self.policy
            kernel: dict[str, float] = {}
            for row in snapshot.containers:
                kernel[row.identity.key] = kernel.get(row.identity.key, 0.0) + row.kernel_seconds_total
            self._kernel_seconds = kernel
            result = evaluate(policy, snapshot, events, self.state, clock(), self.safety)
            self.last_result = result
            if result.stale:
                self.metrics.stale_snapshots += 1
                log.warning("not enforcing: %s", "; ".join(result.notes))
                return []
            self.state = result.state
            outcomes = [Outcome(d, self._carry_out(d)) for d in result.decisions]
            self.last_outcomes = outcomes
            self.metrics.count_deadlocks(result.deadlocks_detected, result.deadlocks_resolved)
            self._identities = {row.identity.key: row.identity for row in snapshot.containers}
            self.kernel_guard.observe(snapshot)
            suspended = self.kernel_guard.suspended_keys()
            gate_new = policy.fair_share.enabled and policy.rescheduling.gate_new
            gated = self._not_yet_on_a_gpu(policy) if gate_new else []
            self.kernel_limits.push(policy, result, self._identities, snapshot, suspended, gated)
            if gated:  # next round: one of them holding its CUDA context is still not admitted
                memory = replace(self.state.memory, gated=frozenset(i.key for i in gated if i.cgroup_id is not None))
                self.state = replace(self.state, memory=memory)
            self.sharing.push_devices(policy, result, self._identities, snapshot)
            self.sharing.throttles(policy, result, self._identities, snapshot, clock(), self.actions.control,
                                   self._carry_out)
            self.enforcement.update(result, self._identities, suspended, self.metrics)
            self.sharing.export(self.metrics, policy, self._identities, snapshot)
        self.last_latency_s = time.perf_counter() - started
        return [o.decision for o in outcomes]

    def _recent(self, events: Sequence[ProbeEvent], now: float) -> list[ProbeEvent]:
        """The probe events of the policy's blocked window, these included: an event is read
        from the ring buffer once, but a stopped allocation whose container the snapshot does
        not show yet (NVML lists it a sample later) must still be seen when it does."""
        window = self.policy.deadlock.blocked_window_s
        kept = [e for e in self._events if now - e.timestamp_s <= window]
        self._events = list(dict.fromkeys([*kept, *events]))
        return self._events

    def _clock_for(self, snapshot: Snapshot) -> Callable[[], float]:
        if self.clock is not None:
            return self.clock
        return time.time if snapshot.timestamp_s > EPOCH_THRESHOLD_S else time.monotonic

    def _not_yet_on_a_gpu(self, policy: Policy) -> list[ContainerIdentity]:
        """Containers on the node a rule matches that the snapshot does not show on a GPU yet
        (rescheduling.gate_new): listed every snapshot while fair share is on."""
        if self.node_listing.source is None:
            self.sharing.ledger.say_once("no-gate-new", "rescheduling.gate_new: no node container listing wired; "
                                         "a container's first allocation is not held for admission")
            return []
        found = []
        for identity in self.node_listing.get(now=True):
            if identity.key in self._identities or self.safety.unsafe_reason(identity):
                continue
            if select_rule(policy, identity).rule is not None:
                found.append(identity)
        return found

    # -- carrying out ---------------------------------------------------------------------
    def _carry_out(self, decision: Decision) -> ActionResult:
        """The one place a decision is acted on: the action (unless suppressed or a dry run),
        then the audit record, the counter and the view's hold."""
        if decision.suppressed:
            result = ActionResult(Status.SUPPRESSED, decision.suppressed)
        elif self.dry_run:
            result = ActionResult(Status.DRY_RUN, "dry run: nothing done")
        else:
            action = self.actions.by_verb.get(decision.verb)
            if action is None:
                result = ActionResult(Status.FAILED, f"no action configured for {decision.verb.value}")
            else:
                try:
                    result = action.apply(decision)
                except (EnforcementError, OSError) as err:
                    result = ActionResult(Status.FAILED, str(err))
        self._record(decision, result)
        self.enforcement.remember(decision, result)
        if result.status is Status.FAILED:
            log.error("%s on %s failed: %s", decision.verb.value, decision.target.display_name, result.detail)
        return result

    def _record(self, decision: Decision, result: ActionResult) -> None:
        self.audit.record(decision, result, dry_run=self.dry_run)
        self.metrics.count_action(decision.verb.value, result.status.value)

    def _on_complete(self, decision: Decision, result: ActionResult) -> None:
        """Final result of an asynchronous action (checkpoint-then-kill)."""
        self.audit.record(decision, result, dry_run=self.dry_run, event="completed")
        self.metrics.count_action(decision.verb.value, result.status.value)

    # -- what it shows ------------------------------------------------------------------------
    def view(self) -> tuple[ContainerEnforcement, ...]:
        """The enforcer's per-container state after the latest snapshot (immutable)."""
        return self.enforcement.current

    def decorate(self, snapshot: Snapshot) -> Snapshot:
        """`snapshot` carrying this enforcer's view (what the agent serves as /snapshot.json)."""
        return replace(snapshot, enforcement=self.enforcement.current)

    # -- Alertmanager webhook ---------------------------------------------------------------
    def on_webhook(self, request: WebhookRequest) -> str:
        """Handle one parsed webhook alert: decide with the policy's safety rules, act
        (unless dry run), audit; returns the result."""
        with self._lock:
            if self._closed:
                return "refused: enforcer closed"
            return self.webhook.handle(request, self.policy, self._identities.values(), self._carry_out)

    # -- shutdown -----------------------------------------------------------------------
    def close(self) -> list[str]:
        """Finish checkpoints, stop throttles and thaw everything this agent froze."""
        with self._lock:
            if self._closed:
                return []
            self._closed = True
        thawed = self.actions.close()
        self.sharing.close()  # BpfDeviceGate: detach the device program from every cgroup
        if thawed:
            log.info("thawed on close: %s", ", ".join(thawed))
        if self._owns_audit:
            self.audit.close()
        return thawed


def install_exit_handlers(enforcer: Enforcer) -> None:
    """atexit + SIGTERM: thaw everything before the process ends (call from the main thread)."""
    atexit.register(enforcer.close)
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: FrameType | None) -> None:
        enforcer.close()
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


def install_reload_handler(enforcer: Enforcer) -> None:
    """SIGHUP: reload the policy at the start of the next on_snapshot."""

    def on_hup(_signum: int, _frame: FrameType | None) -> None:
        enforcer.reload_requested = True

    signal.signal(signal.SIGHUP, on_hup)
