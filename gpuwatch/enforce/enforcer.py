"""The enforcer: evaluate each snapshot against the policy and carry out the decisions.

    enforcer = Enforcer("/etc/gpuwatch/policy.yaml", audit=AuditLog(path), dry_run=False)
    install_exit_handlers(enforcer)        # atexit + SIGTERM: thaw everything
    install_reload_handler(enforcer)       # SIGHUP: reload on the next snapshot
    registry.register(enforcer.metrics)    # prometheus Collector
    ... every interval: enforcer.on_snapshot(snapshot, probe_events)
    enforcer.close()

Evaluation is pure (gpuwatch.policy.evaluate); this class owns the I/O around it: the
policy file (reload on SIGHUP or mtime change, read and checked in a worker thread so the
snapshots keep their cadence; an invalid or refused file never replaces the running
policy), the actions, the audit log (every decision, dry-run and suppressed ones too), the
metrics and the in-kernel limit map hook. On start it thaws whatever a crashed previous
run left frozen (the cgroups' freeze markers and the state file, enforce/freeze/frozen_state.py) unless
the agent already did so under its node lock.

It also carries out what pods ask for with the sharing annotations (policy/sharing.py):
`exclusive` -> every other container on the node gets the held GPU denied by the device
gate (lifted when the holder is gone); `shared` + `gpu-share` -> the closed-loop throttle
at that share unless the container's rule has a throttle step. Each change is audited
(rule "sharing"); a dry run audits without acting.
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
from typing import Any

from gpuwatch.core.annotations import format_share
from gpuwatch.core.errors import EnforcementError
from gpuwatch.core.model import ContainerEnforcement, ContainerIdentity, Snapshot
from gpuwatch.enforce.actions import ActionResult, ActionSet, Status, build_actions
from gpuwatch.enforce.audit import DEFAULT_AUDIT_PATH, AuditLog
from gpuwatch.enforce.cgroup_ops import CgroupHandle, CgroupTree, own_cgroup_paths
from gpuwatch.enforce.control import BusySource, FreezeControl
from gpuwatch.enforce.freeze.frozen_state import DEFAULT_STATE_PATH, FrozenRegistry, RecoveryAction
from gpuwatch.enforce.freeze.markers import MarkerOwner
from gpuwatch.enforce.freeze.recovery import RecoveryMetrics
from gpuwatch.enforce.inkernel_guard import InKernelGuard
from gpuwatch.enforce.limitmap import DeviceGate, LimitMap, NullDeviceGate, NullLimitMap, kernel_action
from gpuwatch.enforce.metrics import EnforcerMetrics, TargetLimits
from gpuwatch.enforce.policy_reload import PolicyLoad, PolicyStat, policy_stat
from gpuwatch.enforce.probe_events import convert_events
from gpuwatch.enforce.sharing_hooks import SHARING_RULE, NodeContainers, NodeListing, SharingLedger
from gpuwatch.enforce.webhook.requests import RepeatGate, decide_webhook
from gpuwatch.policy.evaluate import (
    VANISHED_INTERVALS,
    Decision,
    EvaluationResult,
    EvaluatorState,
    SafetyContext,
    Verb,
    evaluate,
)
from gpuwatch.policy.events import KernelEventRecord, ProbeEvent
from gpuwatch.policy.match import select_rule
from gpuwatch.policy.probe_trust import ProbeNvmlCrossCheck
from gpuwatch.policy.rules import ActionKind, Policy
from gpuwatch.policy.sharing import (
    ExclusivePlan,
    allowed_without,
    exclusive_holders,
    gate_exemption,
    gpu_users,
    is_glob,
    namespace_memory_quotas,
    plan_exclusive,
    sharing_of,
)

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
        node_containers: NodeContainers | None = None,
        node_scan_s: float = 30.0,
        initial_policy: PolicyLoad | None = None,
        recover: bool = True,
        lock_path: str | Path | None = None,
        reload_wait_s: float = 0.1,
        crosscheck: ProbeNvmlCrossCheck | None = None,
    ) -> None:
        """Load the policy (PolicyError if invalid), build the actions, thaw leftovers.

        `initial_policy`: the policy already read (the agent reads it in a worker so SIGTERM
        is heard while a large file parses); None: read it here. Reloads parse in a worker
        (PolicyLoad): `on_snapshot` waits at most `reload_wait_s` for one, then goes on with
        the running policy and swaps the new one in on a later snapshot once it is valid.

        `recover=False` when the caller already reconciled the node (the agent does, under
        its node lock `lock_path`, which also goes into the freeze markers this enforcer sets).

        `clock` must tick like the snapshots' timestamp_s (staleness, probe-event times).
        None: per snapshot, wall time for epoch timestamps, else CLOCK_MONOTONIC (the
        sampler's default). Audit records always carry wall time.

        `busy_source` defaults to the container's kernel_seconds_total from the latest
        snapshot (so throttle control runs at the sample interval: `throttle_control_s`).

        `node_containers` lists every container on the node (not only GPU users): asked each
        snapshot while a GPU is held exclusively, else every `node_scan_s` when the policy has
        glob namespace quotas. None: only the containers the snapshot shows are known.

        `crosscheck`: thresholds of the probe vs NVML cross-check (default max(64 MiB, 10%),
        3 intervals to suspend and to resume): a container it suspends is kept out of the
        kernel limit map (enforce/inkernel_guard.py).
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
        self.reload_wait_s = reload_wait_s
        self._pending_load: PolicyLoad | None = None
        self.policy: Policy = self._load_initial(initial_policy)
        if actions is None:
            tree = cgroups or CgroupTree()
            control = FreezeControl(
                tree,
                FrozenRegistry(tree, frozen_state_path, owner=MarkerOwner.current(lock_path)),
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
        self.kernel_refused: dict[str, str] = {}
        """Key -> why the in-kernel limit is refused for a limited container (no v2 cgroup of its own)."""
        self._identities: dict[str, ContainerIdentity] = {}
        self._closed = False
        self._webhook_times: list[float] = []
        self._webhook_repeats = RepeatGate()  # identical alert actions within a minute: acted on once
        self.sharing = SharingLedger()
        self.node_listing = NodeListing(node_containers, node_scan_s)
        self.last_exclusive = ExclusivePlan()
        self._events: list[ProbeEvent] = []
        self._holds: dict[str, Decision] = {}
        """Key -> the last throttle/pause/checkpoint decision carried out (or recorded in a dry run)."""
        self._view: tuple[ContainerEnforcement, ...] = ()
        self.recovery_metrics = RecoveryMetrics()
        self.kernel_guard = InKernelGuard(self.audit, dry_run, crosscheck)
        self.metrics.guard_family = self.kernel_guard.metric_family
        self.recovered = self.actions.control.registry.recover(self._on_recovery) if recover else []

    # -- policy -------------------------------------------------------------------------
    def _stat(self) -> PolicyStat:
        return policy_stat(self.policy_path)

    def _load_initial(self, load: PolicyLoad | None) -> Policy:
        if load is None:
            load = PolicyLoad(self.policy_path)
        load.wait(None)
        policy = load.result()
        self._loaded_stat = load.stat
        self.metrics.count_reload(True)
        self.metrics.policy_loaded_s = time.time()
        return policy

    def _on_recovery(self, step: RecoveryAction) -> None:
        self.recovery_metrics.count(step)
        self.audit.record_recovery(step, dry_run=self.dry_run)

    def reload(self) -> bool:
        """Re-read the policy file now (waits for the parse); an invalid file keeps the
        running policy (logged + counted)."""
        self.reload_requested = False
        self._pending_load = None
        load = PolicyLoad(self.policy_path)
        load.wait(None)
        return self._apply_load(load)

    def _apply_load(self, load: PolicyLoad) -> bool:
        if load.error is not None:
            self._loaded_stat = load.stat  # do not retry the same broken file every interval
            self.last_reload_error = str(load.error)
            self.metrics.count_reload(False)
            text = self.last_reload_error
            log.error("policy reload failed; keeping the running policy: %s",
                      text if len(text) <= 4000 else text[:4000] + f"... ({len(text)} characters)")
            return False
        policy = load.result()
        with self._lock:
            self.policy = policy
        self._loaded_stat = load.stat
        self.last_reload_error = ""
        self.metrics.count_reload(True)
        self.metrics.policy_loaded_s = time.time()
        log.info("policy reloaded from %s (%d rules, read and checked in %.2f s)", self.policy_path,
                 len(policy.rules), time.monotonic() - load.started_s)
        return True

    def check_reload(self) -> bool | None:
        """Reload if SIGHUP asked for it or the file changed: the file is read and checked in
        a worker; returns its result once it is in (applied when valid), None while nothing
        changed or the worker is still at it (the running policy stays meanwhile)."""
        load = self._pending_load
        if load is None:
            if not (self.reload_requested or self._stat() != self._loaded_stat):
                return None
            self.reload_requested = False
            load = self._pending_load = PolicyLoad(self.policy_path)
        if not load.wait(self.reload_wait_s):
            return None
        self._pending_load = None
        return self._apply_load(load)

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
            self.kernel_guard.observe(snapshot)
            self._push_limits(result, snapshot)
            self._sharing_throttles(result, snapshot, clock())
            self._update_view(result, snapshot)
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
        self._remember(decision, result)
        if result.status is Status.FAILED:
            log.error("%s on %s failed: %s", decision.verb.value, decision.target.display_name, result.detail)
        return result

    def _remember(self, decision: Decision, result: ActionResult) -> None:
        """What holds each container now, for the view (top shows why a job is slow)."""
        if result.status not in (Status.OK, Status.STARTED, Status.DRY_RUN):
            return
        if decision.verb is Verb.RELEASE:
            self._holds.pop(decision.key, None)
        elif decision.verb in (Verb.THROTTLE, Verb.PAUSE, Verb.CHECKPOINT_KILL, Verb.KILL):
            self._holds[decision.key] = decision

    def _on_complete(self, decision: Decision, result: ActionResult) -> None:
        """Final result of an asynchronous action (checkpoint-then-kill)."""
        self.audit.record(decision, result, dry_run=self.dry_run, event="completed")
        self.metrics.count_action(decision.verb.value, result.status.value)

    def _push_limits(self, result: EvaluationResult, snapshot: Snapshot | None = None) -> None:
        """Effective GPU memory limit (and kernel action) per cgroup id into the kernel map,
        then the device gate (_push_devices). Containers whose probe counter NVML contradicts
        (kernel_guard) get no entry: the kernel cannot act on them."""
        with self._lock:
            policy = self.policy
        rules = {r.name: r for r in policy.rules}
        wanted: dict[int, tuple[int, str]] = {}
        refused: dict[str, ContainerIdentity] = {}
        # containers whose probe counters were joined per process (node/probe_join.py: negative ids):
        # the kernel counts them in a v2 cgroup that is not theirs
        joined = {ident.key for cg, ident in (snapshot.probe_identities if snapshot else ()) if cg < 0}
        suspended = self.kernel_guard.suspended_keys()
        for key in set(result.measurements) | set(result.effective_limits_bytes):
            if key in suspended:
                continue
            identity = self._identities.get(key)
            fair = key in result.effective_limits_bytes
            limit = result.memory_limit_bytes(key)
            if identity is None or limit is None:
                continue
            if self.safety.unsafe_reason(identity):
                continue
            rule = rules.get(result.rules_by_target.get(key, ""))
            if identity.cgroup_id is None or key in joined:
                if key in joined:
                    refused[key] = identity
                continue
            wanted[identity.cgroup_id] = (limit, kernel_action(rule, fair))
        if policy.fair_share.enabled and policy.rescheduling.gate_new:
            for identity in self._not_yet_on_a_gpu(policy):
                if identity.cgroup_id is not None and identity.cgroup_id not in wanted:
                    wanted[identity.cgroup_id] = (0, "stop")  # its first allocation waits for admission
        if not self.dry_run:
            for cgroup_id, (limit, action) in wanted.items():
                if self._pushed_limits.get(cgroup_id) != (limit, action):
                    self.limit_map.set_limit(cgroup_id, limit, action)
            for cgroup_id in set(self._pushed_limits) - set(wanted):
                self.limit_map.clear(cgroup_id)
        self._pushed_limits = wanted
        self._refuse_kernel_limits(refused, result)
        self._push_devices(result, snapshot)

    def _refuse_kernel_limits(self, refused: dict[str, ContainerIdentity],
                              result: EvaluationResult) -> None:
        """Audit (once per container) each limited container the kernel limit cannot key: its
        probe counters had to be joined per process because the cgroup that names it is not
        the v2 cgroup its processes are counted in (a hybrid host whose runtime manages v1
        only: the v2 root, a service, or a cgroup shared with other containers) -- a limit
        there would act on all of them together."""
        for key, identity in refused.items():
            if key in self.kernel_refused:
                continue
            reason = (f"in-kernel limit refused: {identity.cgroup_path!r} is not the cgroup v2 its processes "
                      "are in (a v1 controller names this container on a hybrid host); the kernel counts them "
                      "in another v2 cgroup, possibly shared with other containers, so a kernel kill/stop "
                      "there could hit those")
            self.kernel_refused[key] = reason
            log.warning("%s: %s", identity.display_name, reason)
            self.audit.record_event(
                identity, event="inkernel", rule=result.rules_by_target.get(key, ""), scope="container",
                reason=reason, action="refuse-inkernel", result="refused",
                detail="polling enforcement on NVML numbers applies; probe bytes are joined per process",
                dry_run=self.dry_run)
        for key in set(self.kernel_refused) - set(refused):
            del self.kernel_refused[key]

    def _not_yet_on_a_gpu(self, policy: Policy) -> list[ContainerIdentity]:
        """Containers on the node a rule matches that the snapshot does not show on a GPU yet
        (rescheduling.gate_new): listed every snapshot while fair share is on."""
        if self.node_listing.source is None:
            self.sharing.say_once("no-gate-new", "rescheduling.gate_new: no node container listing wired; a "
                                  "container's first allocation is not held for admission")
            return []
        found = []
        for identity in self.node_listing.get(now=True):
            if identity.key in self._identities or self.safety.unsafe_reason(identity):
                continue
            if select_rule(policy, identity).rule is not None:
                found.append(identity)
        return found

    def _push_devices(self, result: EvaluationResult, snapshot: Snapshot | None) -> None:
        """Device gate per cgroup id: the rule's `limits.devices`, minus GPUs another
        container holds exclusively; changes pushed to the gate (not in a dry run)."""
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
        plan = self._plan_exclusive(policy, snapshot)
        for key, gpus in plan.denied.items():
            cgroup_id = plan.identities[key].cgroup_id
            if cgroup_id is not None:
                devices[cgroup_id] = allowed_without(devices.get(cgroup_id), gpus)
        refused: set[int] = set()
        if not self.dry_run:
            pushed: dict[int, tuple[int, ...]] = {}
            for cgroup_id, allowed in devices.items():
                if self._pushed_devices.get(cgroup_id) != allowed:
                    try:
                        self.device_gate.allow_only(cgroup_id, allowed)
                    except EnforcementError as err:  # retried next snapshot; the old gate stays
                        log.warning("device isolation of cgroup %d not applied: %s", cgroup_id, err)
                        refused.add(cgroup_id)
                        if cgroup_id in self._pushed_devices:
                            pushed[cgroup_id] = self._pushed_devices[cgroup_id]
                        continue
                pushed[cgroup_id] = allowed
            for cgroup_id in set(self._pushed_devices) - set(pushed):
                self.device_gate.clear(cgroup_id)
            devices = pushed
        self._pushed_devices = devices
        self._audit_exclusive(plan, refused)
        self.last_exclusive = plan

    # -- sharing annotations --------------------------------------------------------------
    @property
    def _gate_enforces(self) -> bool:
        return bool(getattr(self.device_gate, "enforcing", True))

    def _plan_exclusive(self, policy: Policy, snapshot: Snapshot | None) -> ExclusivePlan:
        if snapshot is None:
            return ExclusivePlan()
        holders = exclusive_holders(gpu_users(snapshot))
        if not holders:
            return ExclusivePlan()
        if not self.dry_run and not self._gate_enforces:
            gpu, found = min(holders.items())
            self.sharing.say_once(
                "no-gate",
                "GPU %d is used by %s (gpuwatch.io/sharing: exclusive) but nothing keeps other containers "
                "off it: no BPF device gate (the agent needs root and its kernel probes); exclusive use "
                "is exported, not enforced",
                gpu,
                ", ".join(i.display_name for i in found.values()),
            )
        if self.node_listing.source is None:
            self.sharing.say_once(
                "no-listing",
                "exclusive GPU use: only containers seen using a GPU are kept off a held GPU "
                "(no node container listing wired)",
            )
        return plan_exclusive(policy, snapshot, self.node_listing.get(now=True), self.safety.unsafe_reason)

    def _sharing_decision(self, verb: Verb, identity: ContainerIdentity, reason: str, gpus: tuple[int, ...] = (),
                          share: float | None = None, suppressed: str = "") -> Decision:
        measured = tuple((f"gpu{g}", 1.0) for g in gpus)
        if share is not None:
            measured += (("gpu_share", share),)
        return Decision(verb, identity, SHARING_RULE, "sharing", reason, measured=measured, share=share,
                        suppressed=suppressed)

    def _record(self, decision: Decision, result: ActionResult) -> None:
        self.audit.record(decision, result, dry_run=self.dry_run)
        self.metrics.count_action(decision.verb.value, result.status.value)

    def _audit_exclusive(self, plan: ExclusivePlan, refused: set[int]) -> None:
        """One audit record per container whose exclusive denials changed (deny-device /
        allow-device), per suppressed (protected, host) one and per refusal of the gate."""
        ledger = self.sharing
        if not self.dry_run and not self._gate_enforces:
            ledger.denied.clear()  # nothing was done, so nothing to audit or lift
            return
        for key in sorted(set(plan.denied) | set(ledger.denied)):
            before = ledger.denied.get(key, ())
            after = plan.denied.get(key, ())
            if before == after:
                continue
            identity = plan.identities.get(key) or ledger.identities[key]
            if identity.cgroup_id in refused:
                if ledger.failed.get(key) != after:
                    ledger.failed[key] = after
                    reason = f"keep off GPU {', '.join(map(str, after))} (held exclusively)"
                    self._record(self._sharing_decision(Verb.DENY_DEVICE, identity, reason, after),
                                 ActionResult(Status.FAILED, "the device gate refused; retried every snapshot"))
                continue
            ledger.failed.pop(key, None)
            added = tuple(g for g in after if g not in before)
            lifted = tuple(g for g in before if g not in after)
            done = ActionResult(Status.DRY_RUN, "dry run: nothing done") if self.dry_run else None
            if added:
                reason = "; ".join(f"GPU {g} is held exclusively by {plan.holder_names(g)}" for g in added)
                self._record(self._sharing_decision(Verb.DENY_DEVICE, identity, reason, added),
                             done or ActionResult(Status.OK, f"may not open GPU {', '.join(map(str, added))}"))
            if lifted:
                gone = key not in plan.identities and bool(plan.holders)
                reason = "container left the node" if gone else "; ".join(
                    f"GPU {g} is no longer held exclusively" for g in lifted)
                result = done or (ActionResult(Status.GONE, "gate lifted") if gone else
                                  ActionResult(Status.OK, f"may open GPU {', '.join(map(str, lifted))} again"))
                self._record(self._sharing_decision(Verb.ALLOW_DEVICE, identity, reason, lifted), result)
            if after:
                ledger.denied[key] = after
                ledger.identities[key] = identity
            else:
                ledger.denied.pop(key, None)
                ledger.identities.pop(key, None)
        for key in set(ledger.failed) - set(plan.denied):
            ledger.failed.pop(key)
        for key, why in plan.exempt.items():
            gpus = tuple(sorted(g for g, held in plan.holders.items() if key not in held))
            if ledger.suppressed.get(key) == gpus or not plan.identities[key].is_container:
                continue  # (the host's processes are never a target: nothing to record)
            ledger.suppressed[key] = gpus
            reason = "; ".join(f"GPU {g} is held exclusively by {plan.holder_names(g)}" for g in gpus)
            self._record(self._sharing_decision(Verb.DENY_DEVICE, plan.identities[key], reason, gpus, suppressed=why),
                         ActionResult(Status.SUPPRESSED, why))
        for key in set(ledger.suppressed) - set(plan.exempt):
            ledger.suppressed.pop(key)

    def _sharing_throttles(self, result: EvaluationResult, snapshot: Snapshot, now: float) -> None:
        """`gpuwatch.io/sharing: shared` + `gpuwatch.io/gpu-share: x`: keep a throttle at x on
        the container while it is in the snapshot. A rule with a throttle step decides alone;
        a throttle/pause the policy (or the webhook) holds on it wins while it holds."""
        with self._lock:
            policy = self.policy
        ledger = self.sharing
        control = self.actions.control
        held = set(result.state.reversible_active)
        throttled = control.throttled()
        paused = control.paused()
        wanted: dict[str, tuple[ContainerIdentity, float]] = {}
        for key, identity in self._identities.items():
            share = sharing_of(identity).throttle_share
            if share is None:
                continue
            ledger.last_seen_s[key] = now
            rule = select_rule(policy, identity).rule
            if rule is not None and any(step.kind is ActionKind.THROTTLE for step in rule.actions):
                continue  # the rule's own throttle step wins (SCHEMA.md: sharing modes)
            why = gate_exemption(policy, identity, self.safety.unsafe_reason(identity), need_cgroup_id=False)
            if why:
                if ledger.throttle_failed.get(key) != share:
                    ledger.throttle_failed[key] = share
                    self._record(self._sharing_decision(Verb.THROTTLE, identity, self._share_reason(share),
                                                        share=share, suppressed=why),
                                 ActionResult(Status.SUPPRESSED, why))
                continue
            wanted[key] = (identity, share)
        for key, (identity, share) in wanted.items():
            if key in held or identity.cgroup_path in paused or ledger.throttle_failed.get(key) == share:
                continue
            running = throttled.get(identity.cgroup_path)
            if not self.dry_run and running is not None and running.running:
                continue  # ours, or one the policy/webhook started (it wins while it runs)
            if self.dry_run and ledger.throttles.get(key) == share:
                continue
            decision = self._sharing_decision(Verb.THROTTLE, identity, self._share_reason(share), share=share)
            outcome = self._carry_out(decision)
            if outcome.status in (Status.OK, Status.DRY_RUN):
                ledger.throttles[key] = share
                ledger.throttle_identities[key] = identity
            else:
                ledger.throttle_failed[key] = share  # audited once; tried again if it comes back
        grace = VANISHED_INTERVALS * max(snapshot.interval_s, 0.0)
        for key in list(ledger.throttles):
            if key in wanted and key in self._identities:
                continue
            if key not in self._identities and now - ledger.last_seen_s.get(key, now) < grace:
                continue
            identity = ledger.throttle_identities.pop(key)
            del ledger.throttles[key]
            if key in held:
                continue  # the policy holds it now; its release thaws it
            reason = "left the snapshot" if key not in self._identities else "the policy's rule now throttles it"
            self._carry_out(self._sharing_decision(Verb.RELEASE, identity, f"gpu-share throttle ends: {reason}"))
        for key in list(ledger.throttle_failed):
            if key not in self._identities:
                del ledger.throttle_failed[key]
        for key in list(ledger.last_seen_s):
            if key not in ledger.throttles and key not in self._identities:
                del ledger.last_seen_s[key]

    @staticmethod
    def _share_reason(share: float) -> str:
        return f"gpuwatch.io/sharing: shared, gpuwatch.io/gpu-share: {format_share(share)}"

    def _quota_namespaces(self, snapshot: Snapshot) -> list[str]:
        """Namespaces present on the node: the snapshot's, the probes', the node listing's."""
        with self._lock:
            policy = self.policy
        names = {i.pod_namespace for i in self._identities.values()}
        names |= {i.pod_namespace for _, i in snapshot.probe_identities}
        if any(is_glob(q.namespace) for q in policy.namespace_quotas):
            names |= {i.pod_namespace for i in self.node_listing.get(now=False)}
        return sorted(n for n in names if n)

    def _update_view(self, result: EvaluationResult, snapshot: Snapshot | None = None) -> None:
        limits = []
        for key, measured in result.measurements.items():
            identity = self._identities.get(key)
            if identity is None:
                continue
            limits.append(TargetLimits(identity, result.rules_by_target.get(key, ""), result.memory_limit_bytes(key),
                                       measured.gpu_time_limit))
        by_path = {i.cgroup_path: i for i in self._identities.values()}
        control = self.actions.control
        paused = tuple(by_path.get(p, ContainerIdentity("unknown", p)) for p in sorted(control.paused()))
        throttled = tuple(
            (by_path.get(p, ContainerIdentity("unknown", p)), t.target_share, t.measured_share)
            for p, t in sorted(control.throttled().items())
        )
        self.metrics.set_view(tuple(limits), paused, throttled)
        self._view = self._enforcement_view(result)
        self.metrics.set_sharing_view(self._view)
        if snapshot is not None:
            with self._lock:
                policy = self.policy
            quotas = namespace_memory_quotas(policy, self._quota_namespaces(snapshot))
            gated = []
            for device in snapshot.devices:
                if device.index in self.last_exclusive.holders and device.mig_index is None:
                    count = sum(1 for gpus in self.sharing.denied.values() if device.index in gpus)
                    gated.append(((snapshot.node, str(device.index), device.uuid, device.name), count))
            self.metrics.set_sharing(snapshot.node, tuple(sorted(quotas.items())), tuple(gated))

    def _enforcement_view(self, result: EvaluationResult) -> tuple[ContainerEnforcement, ...]:
        """Per container in the snapshot: its state (throttled, paused, waiting for memory,
        checkpointing), why, its memory limit and fair share, its time share, the elastic
        controller's view of it."""
        control = self.actions.control
        paused = control.paused()
        throttles = control.throttled()
        checkpointing = self.actions.checkpoint.in_progress()
        waiting = result.state.memory.waiting
        now = result.state.last_snapshot_s or 0.0
        suspended = self.kernel_guard.suspended_keys()
        out = []
        for key, identity in sorted(self._identities.items()):
            memory = result.memory_status.get(key, ())
            elastic = result.elastic_status.get(key)
            hold = self._holds.get(key)
            path = identity.cgroup_path
            throttle = throttles.get(path)
            waited = now - waiting[key].since_s if key in waiting else None
            share = throttle.target_share if throttle is not None and throttle.running else None
            if self.dry_run and hold is not None and hold.verb is Verb.THROTTLE:
                share = hold.share
            if path in checkpointing or (hold is not None and hold.verb in (Verb.CHECKPOINT_KILL, Verb.KILL)):
                state = "checkpointing"
            elif key in waiting:
                state = "waiting-memory"
            elif path in paused or (self.dry_run and hold is not None and hold.verb is Verb.PAUSE):
                state = "paused"
            elif share is not None:
                state = "throttled"
            else:
                state = "running"
            limit = result.memory_limit_bytes(key)
            reason = hold.reason if hold is not None and state != "running" else ""
            if self.dry_run and reason:
                reason = f"dry run, not done: {reason}"
            if not reason and key in suspended:
                reason = "in-kernel kill/stop suspended: its probe counter exceeds NVML's memory (polling only)"
            out.append(ContainerEnforcement(
                identity=identity,
                state=state,
                reason=reason,
                rule=hold.rule if hold is not None and state != "running" else result.rules_by_target.get(key, ""),
                memory_limit_bytes=limit,
                memory_fair_share_bytes=result.fair_shares_bytes.get(key),
                pending_bytes=sum(m.pending_bytes for m in memory),
                waiting_s=round(waited, 3) if waited is not None else None,
                time_share=share,
                measured_share=throttle.measured_share if throttle is not None and throttle.running else None,
                elastic_share=elastic.share if elastic is not None else None,
                elastic_role=elastic.role if elastic is not None else "",
                growth_efficiency=elastic.efficiency if elastic is not None else None,
            ))
        for key in set(self._holds) - set(self._identities):
            del self._holds[key]
        return tuple(out)

    def view(self) -> tuple[ContainerEnforcement, ...]:
        """The enforcer's per-container state after the latest snapshot (immutable)."""
        return self._view

    def decorate(self, snapshot: Snapshot) -> Snapshot:
        """`snapshot` carrying this enforcer's view (what the agent serves as /snapshot.json)."""
        return replace(snapshot, enforcement=self._view)

    # -- Alertmanager webhook ---------------------------------------------------------------
    def on_webhook(self, request: Any) -> str:
        """Handle one parsed webhook alert (gpuwatch.enforce.webhook.receiver.WebhookRequest): decide
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
            self._audit_webhook_repeats()
            key = (decision.verb, bool(request.firing), decision.rule, decision.target.key)
            if not self._webhook_repeats.admit(key, decision):
                return f"duplicate: {request.alert_name} {decision.verb.value} on {decision.target.key} was " \
                       f"handled less than {self._webhook_repeats.window_s:.0f} s ago"
            now = time.monotonic()
            self._webhook_times = [t for t in self._webhook_times if now - t < 60.0]
            if decision.verb.disruptive and not decision.suppressed:
                if len(self._webhook_times) >= self.policy.tuning.max_actions_per_minute:
                    decision = replace(decision, suppressed="rate limit: too many webhook actions this minute")
                else:
                    self._webhook_times.append(now)
            result = self._carry_out(decision)
        return f"{result.status.value}: {result.detail}"

    def _audit_webhook_repeats(self) -> None:
        """One audit record per alert action whose repeats were folded, with their count."""
        for _, repeats, payload in self._webhook_repeats.expired():
            if isinstance(payload, Decision):
                self.audit.record_event(
                    payload.target, event="webhook-repeats", rule=payload.rule, scope=payload.scope,
                    reason=f"{repeats} identical alert action(s) within {self._webhook_repeats.window_s:.0f} s "
                           "after this one were not acted on again", action=payload.verb.value,
                    result="deduplicated", measured={"repeats": float(repeats)}, dry_run=self.dry_run)

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
