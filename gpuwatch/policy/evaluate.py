"""Pure policy evaluation: (policy, snapshot, probe events, previous state, now) ->
(decisions with reasons, new state). No I/O, no clock reads: everything is an argument,
so every anti-flap rule (hysteresis, hold/release times, rate limit, staleness) is unit
tested with made-up snapshots.

This module runs the rules' ladders and the namespace quotas, then hands GPU memory to
arbitration.py (deadlocks, stopped allocations, fair share and rescheduling) and GPU time to
elastic.py (progress-aware shares); the decision types are in decisions.py.

Safety lives here too: the host root cgroup and the agent's own cgroup (and its
ancestors) are never acted on; protected namespaces only by rules naming them literally
(see match.py). Unsafe or rate-limited decisions are still returned, with `suppressed`
set, so they are audited.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpuwatch.core.model import ContainerIdentity, Snapshot
from gpuwatch.policy.arbitration import (
    ANY_GPU,
    ArbitrationInput,
    ArbitrationState,
    MemoryStatus,
    arbitrate_memory,
    pending_requests,
)
from gpuwatch.policy.decisions import Decision, SafetyContext, Verb
from gpuwatch.policy.elastic import ElasticState, ElasticStatus, elastic_round
from gpuwatch.policy.events import ProbeEvent
from gpuwatch.policy.ladder import LadderMove, LadderResult, LadderState, advance, undo_escalation
from gpuwatch.policy.match import is_host_root, namespace_is_targetable, select_rule
from gpuwatch.policy.rules import ActionKind, ActionStep, LimitKind, NamespaceQuota, Policy, Rule
from gpuwatch.policy.usage import ContainerView, Measured, group_containers, measure, rate_from_history

__all__ = [
    "ANY_GPU",
    "Decision",
    "EvaluationResult",
    "EvaluatorState",
    "SafetyContext",
    "Verb",
    "evaluate",
]

STALE_INTERVALS = 2.0
VANISHED_INTERVALS = 3.0
RATE_WINDOW_S = 60.0


@dataclass(frozen=True)
class EvaluatorState:
    ladders: Mapping[str, LadderState] = field(default_factory=dict)
    ladder_rules: Mapping[str, str] = field(default_factory=dict)
    kernel_history: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    identities: Mapping[str, ContainerIdentity] = field(default_factory=dict)
    last_seen_s: Mapping[str, float] = field(default_factory=dict)
    reversible_active: Mapping[str, str] = field(default_factory=dict)
    """Target key -> ladder key that holds a throttle/pause on it (for release on vanish)."""
    quota_victims: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    disruptive_times_s: tuple[float, ...] = ()
    last_snapshot_s: float | None = None
    first_seen_s: Mapping[str, float] = field(default_factory=dict)
    """Arrival order for rescheduling: when each container was first seen."""
    memory: ArbitrationState = field(default_factory=ArbitrationState)
    elastic: ElasticState = field(default_factory=ElasticState)


@dataclass(frozen=True)
class EvaluationResult:
    decisions: tuple[Decision, ...]
    state: EvaluatorState
    stale: bool = False
    notes: tuple[str, ...] = ()
    deadlocks_detected: int = 0
    deadlocks_resolved: int = 0
    measurements: Mapping[str, Measured] = field(default_factory=dict)
    effective_limits_bytes: Mapping[str, int] = field(default_factory=dict)
    """Under fair share: the memory each container may hold (its allowance, summed over its
    GPUs), which the enforcer pushes into the kernel limit map."""
    rules_by_target: Mapping[str, str] = field(default_factory=dict)
    fair_shares_bytes: Mapping[str, int] = field(default_factory=dict)
    """Fair share of memory per container key while a GPU it is on is oversubscribed."""
    memory_status: Mapping[str, tuple[MemoryStatus, ...]] = field(default_factory=dict)
    elastic_status: Mapping[str, ElasticStatus] = field(default_factory=dict)

    def memory_limit_bytes(self, key: str) -> int | None:
        """The container's effective GPU memory limit, the one every reader uses (kernel limit
        map, limit metrics, the enforcement view): its fair-share allowance while fair share
        sets one, else its rule's gpu_memory limit; None when neither applies."""
        if key in self.effective_limits_bytes:
            return self.effective_limits_bytes[key]
        measured = self.measurements.get(key)
        return measured.memory_limit_bytes if measured is not None else None


def _verb(kind: ActionKind) -> Verb:
    return Verb(kind.value)


def _step_ratios(steps: Sequence[ActionStep], measured: Measured) -> list[float | None]:
    return [measured.ratio(step.on) for step in steps]


class _Run:
    """Mutable scratch for one evaluation; the result is frozen into EvaluatorState."""

    def __init__(self, policy: Policy, state: EvaluatorState, safety: SafetyContext, t: float) -> None:
        self.policy = policy
        self.prev = state
        self.safety = safety
        self.t = t
        self.ladders = dict(state.ladders)
        self.ladder_rules = dict(state.ladder_rules)
        self.reversible = dict(state.reversible_active)
        self.quota_victims = dict(state.quota_victims)
        self.rate_times = [x for x in state.disruptive_times_s if t - x < RATE_WINDOW_S]
        self.decisions: list[Decision] = []
        self.notes: list[str] = []
        self.touched: set[str] = set()
        self.fresh_holds: set[str] = set()
        self.rule_changed: set[str] = set()

    def rate_limited(self) -> bool:
        return len(self.rate_times) >= self.policy.tuning.max_actions_per_minute

    def emit(self, decision: Decision) -> Decision:
        if decision.verb.disruptive and not decision.suppressed:
            unsafe = self.safety.unsafe_reason(decision.target)
            if unsafe:
                decision = replace(decision, suppressed=unsafe)
            elif self.rate_limited():
                decision = replace(
                    decision,
                    suppressed=f"rate limit: {self.policy.tuning.max_actions_per_minute} disruptive "
                    "actions per minute reached; retried next interval",
                )
            else:
                self.rate_times.append(self.t)
        self.decisions.append(decision)
        return decision

    def step_ladder(
        self, ladder_key: str, rule_name: str, steps: Sequence[ActionStep], ratios: Sequence[float | None]
    ) -> tuple[LadderResult, LadderState]:
        before = self.ladders.get(ladder_key)
        self.touched.add(ladder_key)
        if before is not None and self.ladder_rules.get(ladder_key) != rule_name:
            self.rule_changed.add(ladder_key)
        if before is None or self.ladder_rules.get(ladder_key) != rule_name:
            before = LadderState.fresh(len(steps))
        result = advance(before, steps, ratios, self.t, self.policy.tuning)
        self.ladder_rules[ladder_key] = rule_name
        return result, before


def _container_decision(
    run: _Run, view: ContainerView, rule: Rule, measured: Measured, result: LadderResult
) -> Decision | None:
    if result.move is LadderMove.NONE:
        return None
    step = rule.actions[result.step_index]
    pairs = measured.as_pairs()
    worst = measured.worst_kind()
    if result.move is LadderMove.RELEASE:
        return Decision(
            Verb.RELEASE,
            view.identity,
            rule.name,
            "container",
            f"usage back under the {step.kind.value} threshold ({step.at_ratio:.0%} of limit) for "
            f"{run.policy.tuning.release_after_s:g}s",
            pairs,
            result.step_index,
        )
    ratio = measured.ratio(step.on) or 0.0
    reason = (
        f"{worst.value if worst else 'usage'} at {ratio:.0%} of limit >= {step.at_ratio:.0%}"
        + (f" for {result.held_for_s:g}s (step needs {step.for_s:g}s)" if step.for_s else "")
        + (" (repeat)" if result.move is LadderMove.REPEAT_ALERT else "")
    )
    return Decision(
        _verb(step.kind),
        view.identity,
        rule.name,
        "container",
        reason,
        pairs,
        result.step_index,
        share=step.share if step.share is not None else rule.limits.gpu_time_share,
        signal=step.signal,
        grace_s=step.grace_s,
    )


def _apply_container_rule(run: _Run, view: ContainerView, rule: Rule, measured: Measured) -> None:
    ladder_key = f"c:{view.identity.key}"
    result, before = run.step_ladder(ladder_key, rule.name, rule.actions, _step_ratios(rule.actions, measured))
    decision = _container_decision(run, view, rule, measured, result)
    state = result.state
    if decision is not None:
        decision = run.emit(decision)
        if decision.suppressed.startswith("rate limit"):
            state = undo_escalation(before, state)
        elif decision.verb in (Verb.THROTTLE, Verb.PAUSE) and not decision.suppressed:
            run.reversible[view.identity.key] = ladder_key
            run.fresh_holds.add(view.identity.key)
        elif decision.verb is Verb.RELEASE:
            run.reversible.pop(view.identity.key, None)
    run.ladders[ladder_key] = state


def _quota_targets(
    run: _Run,
    quota: NamespaceQuota,
    members: list[tuple[ContainerView, int, Measured]],
    ratio: float,
) -> list[ContainerView]:
    """Lowest-priority (then biggest) containers until the rest fits under the quota."""
    order = sorted(members, key=lambda m: (m[1], -m[2].memory_bytes, -m[2].gpu_time_share))
    victims: list[ContainerView] = []
    remaining = ratio
    total = max(len(members), 1)
    for view, _, _ in order:
        if remaining < 1.0 and victims:
            break
        victims.append(view)
        remaining -= ratio / total
    return victims


def _apply_quota(
    run: _Run,
    quota: NamespaceQuota,
    namespace: str,
    members: list[tuple[ContainerView, int, Measured]],
    shares: Mapping[str, float],
) -> None:
    limits = quota.limits
    memory = sum(m.memory_bytes for _, _, m in members)
    share = sum(shares[v.identity.key] for v, _, _ in members)
    processes = sum(v.process_count for v, _, _ in members)
    ratios_by_kind: dict[str, float] = {}
    if limits.gpu_memory is not None and limits.gpu_memory.bytes:
        ratios_by_kind["gpu_memory"] = memory / limits.gpu_memory.bytes
    if limits.gpu_time_share is not None:
        ratios_by_kind["gpu_time_share"] = share / limits.gpu_time_share
    if limits.max_processes is not None:
        ratios_by_kind["max_processes"] = processes / limits.max_processes
    step_ratios: list[float | None] = []
    for step in quota.actions:
        values = [r for k, r in ratios_by_kind.items() if not step.on or k in step.on]
        step_ratios.append(max(values) if values else None)
    ladder_key = f"ns:{quota.namespace}:{namespace}"
    rule_name = f"quota:{quota.namespace}"
    result, before = run.step_ladder(ladder_key, rule_name, quota.actions, step_ratios)
    state = result.state
    pairs = (
        ("namespace_memory_bytes", float(memory)),
        ("namespace_gpu_time_share", round(share, 4)),
        *((f"{k}_ratio", round(v, 4)) for k, v in ratios_by_kind.items()),
    )
    ns_identity = ContainerIdentity(runtime="namespace", cgroup_path="", pod_namespace=namespace)
    if result.move is LadderMove.RELEASE:
        for key in run.quota_victims.pop(ladder_key, ()):
            identity = run.prev.identities.get(key)
            if identity is not None:
                run.emit(
                    Decision(
                        Verb.RELEASE,
                        identity,
                        rule_name,
                        "namespace",
                        f"namespace {namespace} back under its quota",
                        pairs,
                        result.step_index,
                    )
                )
                run.reversible.pop(key, None)
    elif result.move is not LadderMove.NONE:
        step = quota.actions[result.step_index]
        worst = max(ratios_by_kind.values(), default=0.0)
        reason = f"namespace {namespace} at {worst:.0%} of its quota (>= {step.at_ratio:.0%})"
        if step.kind is ActionKind.ALERT:
            run.emit(Decision(Verb.ALERT, ns_identity, rule_name, "namespace", reason, pairs, result.step_index))
        elif not namespace_is_targetable(run.policy, namespace, quota.namespace):
            run.emit(
                Decision(
                    _verb(step.kind),
                    ns_identity,
                    rule_name,
                    "namespace",
                    reason,
                    pairs,
                    result.step_index,
                    suppressed=f"namespace {namespace} is protected",
                )
            )
        else:
            victims = _quota_targets(run, quota, members, worst)
            acted: list[str] = []
            for view in victims:
                own_share = shares[view.identity.key]
                target_share = step.share
                if target_share is None and limits.gpu_time_share is not None and share > 0:
                    target_share = max(own_share * limits.gpu_time_share / share, 0.01)
                decision = run.emit(
                    Decision(
                        _verb(step.kind),
                        view.identity,
                        rule_name,
                        "namespace",
                        reason + f"; {view.identity.display_name} chosen (lowest priority first)",
                        pairs,
                        result.step_index,
                        share=target_share,
                        signal=step.signal,
                        grace_s=step.grace_s,
                    )
                )
                if decision.suppressed.startswith("rate limit"):
                    state = undo_escalation(before, state)
                elif not decision.suppressed:
                    acted.append(view.identity.key)
                    if step.kind.reversible:
                        run.reversible[view.identity.key] = ladder_key
                        run.fresh_holds.add(view.identity.key)
            if step.kind.reversible:
                run.quota_victims[ladder_key] = tuple(dict.fromkeys((*run.quota_victims.get(ladder_key, ()), *acted)))
    run.ladders[ladder_key] = state


def _memory_ladder_acts(rule: Rule) -> bool:
    """The rule has a step that pauses, checkpoints or kills on GPU memory."""
    return any(
        step.kind in (ActionKind.PAUSE, ActionKind.CHECKPOINT_KILL, ActionKind.KILL)
        and (not step.on or LimitKind.GPU_MEMORY in step.on)
        for step in rule.actions
    )


def evaluate(
    policy: Policy,
    snapshot: Snapshot,
    probe_events: Sequence[ProbeEvent] = (),
    state: EvaluatorState | None = None,
    now_s: float | None = None,
    safety: SafetyContext | None = None,
) -> EvaluationResult:
    """Evaluate one snapshot. `now_s` (wall clock) decides staleness; ladder timing uses
    the snapshot's own timestamp so the decision is a function of the data only."""
    state = state or EvaluatorState()
    safety = safety or SafetyContext()
    now = snapshot.timestamp_s if now_s is None else now_s
    interval = max(snapshot.interval_s, 1e-3)
    age = now - snapshot.timestamp_s
    if age > STALE_INTERVALS * interval:
        return EvaluationResult(
            (),
            state,
            stale=True,
            notes=(f"snapshot is {age:.1f}s old (> {STALE_INTERVALS:g} intervals): not acting",),
        )
    if state.last_snapshot_s is not None and snapshot.timestamp_s <= state.last_snapshot_s:
        return EvaluationResult((), state, notes=("snapshot already evaluated",))
    t = snapshot.timestamp_s
    run = _Run(policy, state, safety, t)
    views = group_containers(snapshot.containers)
    history = dict(state.kernel_history)
    identities = {k: v for k, v in state.identities.items()}
    last_seen = dict(state.last_seen_s)
    measurements: dict[str, Measured] = {}
    rules_by_target: dict[str, str] = {}
    priorities: dict[str, int] = {}
    shares: dict[str, float] = {}
    quota_members: dict[tuple[int, str], list[tuple[ContainerView, int, Measured]]] = {}
    # Allocations the kernel stopped (and we have not continued) count as memory demand.
    pending = pending_requests(views, probe_events, t - policy.deadlock.blocked_window_s,
                               state.memory.admitted_events_s)
    first_seen = {k: v for k, v in state.first_seen_s.items()}
    limits_by_key: dict[str, int] = {}
    strict_limits: set[str] = set()
    for view in views:
        key = view.identity.key
        identities[key] = view.identity
        last_seen[key] = t
        first_seen.setdefault(key, t)
        match = select_rule(policy, view.identity)
        rule = match.rule
        window = rule.limits.window_s if rule is not None else 30.0
        history[key], rate = rate_from_history(history.get(key, ()), t, view.kernel_seconds_total, window)
        share = rate if rate is not None else view.sm_utilization_ratio
        shares[key] = share
        priorities[key] = rule.priority if rule is not None else 0
        if rule is not None:
            rules_by_target[key] = rule.name
            measured = measure(view, rule.limits, share, snapshot.devices, pending.get(key, 0))
            measurements[key] = measured
            if measured.memory_limit_bytes is not None:
                limits_by_key[key] = measured.memory_limit_bytes
                if _memory_ladder_acts(rule):
                    strict_limits.add(key)
            if rule.actions:
                _apply_container_rule(run, view, rule, measured)
        if is_host_root(view.identity):
            continue
        for index, quota in enumerate(policy.namespace_quotas):
            ns = view.identity.pod_namespace
            if ns and match_glob(quota.namespace, ns):
                m = measure(view, quota.limits, share, snapshot.devices)
                quota_members.setdefault((index, ns), []).append((view, priorities[key], m))
    for (index, ns), members in quota_members.items():
        _apply_quota(run, policy.namespace_quotas[index], ns, members, shares)
    memory = arbitrate_memory(ArbitrationInput(policy, snapshot, views, priorities, probe_events, limits_by_key,
                                               first_seen, state.memory, t, run.emit, managed=set(rules_by_target),
                                               strict_limits=strict_limits))
    held_elsewhere = set(memory.state.waiting) | set(memory.state.checkpointed) | set(run.reversible)
    progress = {p.identity.key: p for p in snapshot.progress}
    queued_gpus = {w.gpu_index for w in memory.state.waiting.values()}
    elastic, elastic_status = elastic_round(policy.elastic, views, progress, set(rules_by_target), held_elsewhere,
                                            state.elastic, t, run.emit, queued_gpus, policy.rescheduling)
    present = {v.identity.key for v in views}
    # Throttles/pauses whose rule or quota no longer applies (policy reloaded, exemption,
    # rule renamed): release them instead of leaving them in force forever.
    for target_key, ladder_key in list(run.reversible.items()):
        stale_hold = ladder_key not in run.touched or ladder_key in run.rule_changed
        if target_key in present and target_key not in run.fresh_holds and stale_hold:
            run.emit(
                Decision(
                    Verb.RELEASE,
                    identities[target_key],
                    run.ladder_rules.get(ladder_key, ""),
                    "container",
                    "the rule that throttled/paused it no longer applies (policy changed)",
                )
            )
            run.reversible.pop(target_key, None)
            run.quota_victims.pop(ladder_key, None)
    # Targets that left the snapshot: release what we hold on them, then forget them.
    for key in list(last_seen):
        if key in present or t - last_seen[key] < VANISHED_INTERVALS * interval:
            continue
        if key in run.reversible and key in identities:
            run.emit(
                Decision(
                    Verb.RELEASE,
                    identities[key],
                    run.ladder_rules.get(run.reversible[key], ""),
                    "container",
                    "target left the snapshot; releasing throttle/pause",
                )
            )
        run.reversible.pop(key, None)
        for prefix_key in (f"c:{key}",):
            run.ladders.pop(prefix_key, None)
            run.ladder_rules.pop(prefix_key, None)
        history.pop(key, None)
        identities.pop(key, None)
        last_seen.pop(key, None)
        first_seen.pop(key, None)
    new_state = EvaluatorState(
        ladders=run.ladders,
        ladder_rules=run.ladder_rules,
        kernel_history=history,
        identities=identities,
        last_seen_s=last_seen,
        reversible_active=run.reversible,
        quota_victims=run.quota_victims,
        disruptive_times_s=tuple(run.rate_times),
        last_snapshot_s=t,
        first_seen_s=first_seen,
        memory=memory.state,
        elastic=elastic,
    )
    return EvaluationResult(
        tuple(run.decisions),
        new_state,
        notes=tuple(run.notes),
        deadlocks_detected=memory.detected,
        deadlocks_resolved=memory.resolved,
        measurements=measurements,
        effective_limits_bytes=memory.effective_limits_bytes,
        rules_by_target=rules_by_target,
        fair_shares_bytes=memory.fair_shares_bytes,
        memory_status=memory.status,
        elastic_status=elastic_status,
    )


def match_glob(pattern: str, value: str) -> bool:
    return fnmatch.fnmatchcase(value, pattern)
