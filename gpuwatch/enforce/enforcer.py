"""The enforcer: evaluate each snapshot against the policy and carry out the decisions.

    enforcer = Enforcer("/etc/gpuwatch/policy.yaml", audit=AuditLog(path), dry_run=False)
    install_exit_handlers(enforcer)        # atexit + SIGTERM: thaw everything
    install_reload_handler(enforcer)       # SIGHUP: reload on the next snapshot
    registry.register(enforcer.metrics)    # prometheus Collector
    ... every interval: enforcer.on_snapshot(snapshot, probe_events)
    enforcer.close()

Evaluation is pure (gpuwatch.policy.evaluate); this class owns the I/O around it: the
policy file (reload on SIGHUP or mtime change; an invalid file never replaces the running
policy), the actions, the audit log (every decision, dry-run and suppressed ones too), the
metrics and the in-kernel limit map hook. On start it thaws whatever a crashed previous
run left frozen (state file).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

from gpuwatch.enforce.actions import ActionResult, ActionSet, Status, build_actions
from gpuwatch.enforce.audit import DEFAULT_AUDIT_PATH, AuditLog
from gpuwatch.enforce.cgroupfs import CgroupHandle, CgroupTree, own_cgroup_paths
from gpuwatch.enforce.control import BusySource, FreezeControl
from gpuwatch.enforce.frozen import DEFAULT_STATE_PATH, FrozenRegistry
from gpuwatch.enforce.limitmap import DeviceGate, LimitMap, NullDeviceGate, NullLimitMap, kernel_action
from gpuwatch.enforce.metrics import EnforcerMetrics, TargetLimits
from gpuwatch.enforce.probe_events import convert_events
from gpuwatch.enforce.webhook_requests import decide_webhook
from gpuwatch.errors import EnforcementError, PolicyError
from gpuwatch.model import ContainerIdentity, Snapshot
from gpuwatch.policy.evaluate import Decision, EvaluationResult, EvaluatorState, SafetyContext, evaluate
from gpuwatch.policy.loader import load_policy
from gpuwatch.policy.model import Policy

log = logging.getLogger(__name__)
EPOCH_THRESHOLD_S = 1e9
"""Snapshot timestamps above this are wall-clock (epoch) seconds, below it monotonic."""


@dataclass(frozen=True)
class Outcome:
    decision: Decision
    result: ActionResult


class Enforcer:
    def __init__(
        self,
        policy_path: str | Path,
        actions: ActionSet | None = None,
        audit: AuditLog | None = None,
        dry_run: bool = False,
        clock: Callable[[], float] | None = None,
        *,
        cgroups: CgroupTree | None = None,
        frozen_state_path: str | Path = DEFAULT_STATE_PATH,
        own_cgroups: frozenset[str] | None = None,
        metrics: EnforcerMetrics | None = None,
        limit_map: LimitMap | None = None,
        device_gate: DeviceGate | None = None,
        busy_source: BusySource | None = None,
        throttle_control_s: float = 0.25,
    ) -> None:
        """Load the policy (PolicyError if invalid), build the actions, thaw leftovers.

        `clock` must tick like the snapshots' timestamp_s (staleness, probe-event times).
        None: per snapshot, wall time for epoch timestamps, else CLOCK_MONOTONIC (the
        sampler's default). Audit records always carry wall time.

        `busy_source` defaults to the container's kernel_seconds_total from the latest
        snapshot (so throttle control runs at the sample interval: `throttle_control_s`).
        """
        self.policy_path = Path(policy_path)
        self.dry_run = dry_run
        self.clock = clock
        self.metrics = metrics or EnforcerMetrics()
        self.limit_map: LimitMap = limit_map or NullLimitMap()
        self.device_gate: DeviceGate = device_gate or NullDeviceGate()
        self._pushed_devices: dict[int, tuple[int, ...]] = {}
        self.safety = SafetyContext(own_cgroups if own_cgroups is not None else own_cgroup_paths())
        self._owns_audit = audit is None
        self.audit = audit or AuditLog(DEFAULT_AUDIT_PATH)
        self._kernel_seconds: dict[str, float] = {}
        self._lock = threading.RLock()
        self.policy: Policy = self._load_initial()
        if actions is None:
            tree = cgroups or CgroupTree()
            control = FreezeControl(
                tree,
                FrozenRegistry(tree, frozen_state_path),
                busy_source or self._snapshot_busy,
                throttle_control_s=throttle_control_s,
            )
            actions = build_actions(control, self._on_complete)
        elif actions.checkpoint.on_complete is None:
            actions.checkpoint.on_complete = self._on_complete
        self.actions = actions
        self.state = EvaluatorState()
        self.reload_requested = False
        self.last_reload_error = ""
        self.last_outcomes: list[Outcome] = []
        self.last_result: EvaluationResult | None = None
        self.last_latency_s = 0.0
        self._pushed_limits: dict[int, tuple[int, str]] = {}
        self._identities: dict[str, ContainerIdentity] = {}
        self._closed = False
        self._webhook_times: list[float] = []
        self.recovered = self.actions.control.registry.recover()

    # -- policy -------------------------------------------------------------------------
    def _stat(self) -> tuple[float, int, int] | None:
        try:
            st = os.stat(self.policy_path)
        except OSError:
            return None
        return (st.st_mtime, st.st_size, st.st_ino)

    def _load_initial(self) -> Policy:
        policy = load_policy(self.policy_path)
        self._loaded_stat = self._stat()
        self.metrics.count_reload(True)
        self.metrics.policy_loaded_s = time.time()
        return policy

    def reload(self) -> bool:
        """Re-read the policy file; an invalid file keeps the running policy (logged + counted)."""
        self.reload_requested = False
        stat = self._stat()
        try:
            policy = load_policy(self.policy_path)
        except PolicyError as err:
            self._loaded_stat = stat  # do not retry the same broken file every interval
            self.last_reload_error = str(err)
            self.metrics.count_reload(False)
            log.error("policy reload failed; keeping the running policy: %s", err)
            return False
        with self._lock:
            self.policy = policy
        self._loaded_stat = stat
        self.last_reload_error = ""
        self.metrics.count_reload(True)
        self.metrics.policy_loaded_s = time.time()
        log.info("policy reloaded from %s (%d rules)", self.policy_path, len(policy.rules))
        return True

    def check_reload(self) -> bool | None:
        """Reload if SIGHUP asked for it or the file changed; None if nothing to do."""
        if self.reload_requested or self._stat() != self._loaded_stat:
            return self.reload()
        return None

    # -- evaluation ---------------------------------------------------------------------
    def _snapshot_busy(self, key: str, _handle: CgroupHandle) -> Callable[[], float]:
        return lambda: self._kernel_seconds.get(key, 0.0)

    def metrics_collector(self) -> EnforcerMetrics:
        """The prometheus Collector to register (actions, limits, paused/throttled, reloads, deadlocks)."""
        return self.metrics

    def on_snapshot(self, snapshot: Snapshot, probe_events: Sequence[Any] = ()) -> list[Decision]:
        """Evaluate one snapshot, act (unless dry-run), audit every decision.

        `probe_events`: evaluator ProbeEvents or the probes layer's events (converted)."""
        started = time.perf_counter()
        self.check_reload()
        clock = self._clock_for(snapshot)
        events = convert_events(probe_events, wall=clock)
        with self._lock:
            if self._closed:
                return []
            kernel: dict[str, float] = {}
            for row in snapshot.containers:
                kernel[row.identity.key] = kernel.get(row.identity.key, 0.0) + row.kernel_seconds_total
            self._kernel_seconds = kernel
            result = evaluate(self.policy, snapshot, events, self.state, clock(), self.safety)
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
            self._push_limits(result)
            self._update_view(result)
        self.last_latency_s = time.perf_counter() - started
        return [o.decision for o in outcomes]

    def _clock_for(self, snapshot: Snapshot) -> Callable[[], float]:
        if self.clock is not None:
            return self.clock
        return time.time if snapshot.timestamp_s > EPOCH_THRESHOLD_S else time.monotonic

    def _carry_out(self, decision: Decision) -> ActionResult:
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
        self.audit.record(decision, result, dry_run=self.dry_run)
        self.metrics.count_action(decision.verb.value, result.status.value)
        if result.status is Status.FAILED:
            log.error("%s on %s failed: %s", decision.verb.value, decision.target.display_name, result.detail)
        return result

    def _on_complete(self, decision: Decision, result: ActionResult) -> None:
        """Final result of an asynchronous action (checkpoint-then-kill)."""
        self.audit.record(decision, result, dry_run=self.dry_run, event="completed")
        self.metrics.count_action(decision.verb.value, result.status.value)

    def _push_limits(self, result: EvaluationResult) -> None:
        """Effective GPU memory limit (and kernel action) per cgroup id into the kernel map."""
        with self._lock:
            policy = self.policy
        rules = {r.name: r for r in policy.rules}
        wanted: dict[int, tuple[int, str]] = {}
        for key in set(result.measurements) | set(result.effective_limits_bytes):
            identity = self._identities.get(key)
            measured = result.measurements.get(key)
            fair = key in result.effective_limits_bytes
            limit = result.effective_limits_bytes.get(key, measured.memory_limit_bytes if measured else None)
            if identity is None or identity.cgroup_id is None or limit is None:
                continue
            if self.safety.unsafe_reason(identity):
                continue
            rule = rules.get(result.rules_by_target.get(key, ""))
            wanted[identity.cgroup_id] = (limit, kernel_action(rule, fair))
        if not self.dry_run:
            for cgroup_id, (limit, action) in wanted.items():
                if self._pushed_limits.get(cgroup_id) != (limit, action):
                    self.limit_map.set_limit(cgroup_id, limit, action)
            for cgroup_id in set(self._pushed_limits) - set(wanted):
                self.limit_map.clear(cgroup_id)
        self._pushed_limits = wanted
        devices: dict[int, tuple[int, ...]] = {}
        with self._lock:
            policy = self.policy
        for key, rule_name in result.rules_by_target.items():
            identity = self._identities.get(key)
            rule = next((r for r in policy.rules if r.name == rule_name), None)
            if identity is None or identity.cgroup_id is None or rule is None or rule.limits.devices is None:
                continue
            if not self.safety.unsafe_reason(identity):
                devices[identity.cgroup_id] = rule.limits.devices
        if not self.dry_run:
            pushed: dict[int, tuple[int, ...]] = {}
            for cgroup_id, allowed in devices.items():
                if self._pushed_devices.get(cgroup_id) != allowed:
                    try:
                        self.device_gate.allow_only(cgroup_id, allowed)
                    except EnforcementError as err:  # retried next snapshot; the old gate stays
                        log.warning("device isolation of cgroup %d not applied: %s", cgroup_id, err)
                        if cgroup_id in self._pushed_devices:
                            pushed[cgroup_id] = self._pushed_devices[cgroup_id]
                        continue
                pushed[cgroup_id] = allowed
            for cgroup_id in set(self._pushed_devices) - set(pushed):
                self.device_gate.clear(cgroup_id)
            devices = pushed
        self._pushed_devices = devices

    def _update_view(self, result: EvaluationResult) -> None:
        limits = []
        for key, measured in result.measurements.items():
            identity = self._identities.get(key)
            if identity is None:
                continue
            memory = result.effective_limits_bytes.get(key, measured.memory_limit_bytes)
            limits.append(TargetLimits(identity, result.rules_by_target.get(key, ""), memory, measured.gpu_time_limit))
        by_path = {i.cgroup_path: i for i in self._identities.values()}
        control = self.actions.control
        paused = tuple(by_path.get(p, ContainerIdentity("unknown", p)) for p in sorted(control.paused()))
        throttled = tuple(
            (by_path.get(p, ContainerIdentity("unknown", p)), t.target_share, t.measured_share)
            for p, t in sorted(control.throttled().items())
        )
        self.metrics.set_view(tuple(limits), paused, throttled)

    # -- Alertmanager webhook ---------------------------------------------------------------
    def on_webhook(self, request: Any) -> str:
        """Handle one parsed webhook alert (gpuwatch.enforce.webhook.WebhookRequest): decide
        with the policy's safety rules, act (unless dry run), audit; returns the result."""
        with self._lock:
            if self._closed:
                return "refused: enforcer closed"
            verdict = decide_webhook(
                self.policy,
                self._identities.values(),
                self.safety,
                str(request.action),
                bool(request.firing),
                str(request.alert_name),
                request.target_dict(),
            )
            if verdict.decision is None:
                log.warning("webhook %s: %s", request.alert_name, verdict.reason)
                return f"ignored: {verdict.reason}"
            decision = verdict.decision
            now = time.monotonic()
            self._webhook_times = [t for t in self._webhook_times if now - t < 60.0]
            if decision.verb.disruptive and not decision.suppressed:
                if len(self._webhook_times) >= self.policy.tuning.max_actions_per_minute:
                    decision = replace(decision, suppressed="rate limit: too many webhook actions this minute")
                else:
                    self._webhook_times.append(now)
            result = self._carry_out(decision)
        return f"{result.status.value}: {result.detail}"

    # -- shutdown -----------------------------------------------------------------------
    def close(self) -> list[str]:
        """Finish checkpoints, stop throttles and thaw everything this agent froze."""
        with self._lock:
            if self._closed:
                return []
            self._closed = True
        thawed = self.actions.close()
        close_gate = getattr(self.device_gate, "close", None)
        if callable(close_gate):  # BpfDeviceGate: detach the device program from every cgroup
            close_gate()
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
