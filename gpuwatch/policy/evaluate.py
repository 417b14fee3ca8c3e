"""Pure policy evaluation: (policy, snapshot, probe events, previous state, now) ->
(decisions with reasons, new state). No I/O, no clock reads: everything is an argument,
so every anti-flap rule (hysteresis, hold/release times, rate limit, staleness) is unit
tested with made-up snapshots.

Safety lives here too: the host root cgroup and the agent's own cgroup (and its
ancestors) are never acted on; protected namespaces only by rules naming them literally
(see match.py). Unsafe or rate-limited decisions are still returned, with `suppressed`
set, so they are audited.
"""

from __future__ import annotations

import fnmatch
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from gpuwatch.model import ContainerIdentity, Snapshot
from gpuwatch.policy.deadlock import Contender, find_deadlock, plan_fair_share
from gpuwatch.policy.events import ProbeEvent, ProbeEventKind
from gpuwatch.policy.ladder import LadderMove, LadderResult, LadderState, advance, undo_escalation
from gpuwatch.policy.match import is_host_root, namespace_is_targetable, select_rule
from gpuwatch.policy.model import ActionKind, ActionStep, NamespaceQuota, Policy, Rule
from gpuwatch.policy.usage import ContainerView, Measured, group_containers, measure, rate_from_history

STALE_INTERVALS = 2.0
ANY_GPU = -1
"""Event gpu_index when the probe could not tell the device (CUDA-API events)."""
VANISHED_INTERVALS = 3.0
RATE_WINDOW_S = 60.0


class Verb(StrEnum):
    ALERT = "alert"
    THROTTLE = "throttle"
    PAUSE = "pause"
    CHECKPOINT_KILL = "checkpoint-then-kill"
    KILL = "kill"
    RELEASE = "release"
    """Undo throttle/pause (thaw) and, with continue_stopped, SIGCONT stopped processes."""
    DENY_DEVICE = "deny-device"
    """Device gate: the target may no longer open some GPUs (another container holds them
    exclusively; enforce/enforcer.py audits these, the evaluator never emits them)."""
    ALLOW_DEVICE = "allow-device"
    """Device gate: a GPU denied for exclusivity may be opened again."""

    @property
    def disruptive(self) -> bool:
        return self not in (Verb.ALERT, Verb.RELEASE, Verb.ALLOW_DEVICE)


@dataclass(frozen=True)
class Decision:
    """One thing the enforcer should do (or record, when `suppressed` is set)."""

    verb: Verb
    target: ContainerIdentity
    rule: str
    scope: str
    """"container", "namespace", "deadlock" or "fair_share"."""
    reason: str
    measured: tuple[tuple[str, float], ...] = ()
    step_index: int = -1
    share: float | None = None
    signal: int = int(signal.SIGUSR1)
    grace_s: float = 0.0
    continue_stopped: bool = False
    suppressed: str = ""

    @property
    def key(self) -> str:
        return self.target.key


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
    deadlocks: Mapping[int, str] = field(default_factory=dict)
    """GPU index -> victim key of the deadlock currently being broken."""
    continued_events_s: Mapping[str, float] = field(default_factory=dict)
    fair_paused: frozenset[str] = frozenset()


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
    """Fair-share memory limit per container key (only while a GPU is oversubscribed)."""
    rules_by_target: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SafetyContext:
    """What must never be touched besides the host root: the agent's own cgroup paths."""

    own_cgroup_paths: frozenset[str] = frozenset()

    def unsafe_reason(self, identity: ContainerIdentity) -> str:
        if is_host_root(identity):
            return "safety: the host root cgroup is never acted on"
        path = identity.cgroup_path.rstrip("/")
        for own in self.own_cgroup_paths:
            own = own.rstrip("/")
            if own and (own == path or own.startswith(path + "/")):
                return f"safety: {identity.cgroup_path} contains the agent itself"
        return ""


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


def _events_by_key(
    views: Iterable[ContainerView], events: Iterable[ProbeEvent], since_s: float
) -> dict[str, list[ProbeEvent]]:
    by_path: dict[str, str] = {}
    by_id: dict[int, str] = {}
    for view in views:
        by_path[view.identity.cgroup_path] = view.identity.key
        if view.identity.cgroup_id is not None:
            by_id[view.identity.cgroup_id] = view.identity.key
    out: dict[str, list[ProbeEvent]] = {}
    for event in events:
        if event.timestamp_s < since_s:
            continue
        key = by_id.get(event.cgroup_id) if event.cgroup_id is not None else None
        key = key or by_path.get(event.cgroup_path)
        if key is not None:
            out.setdefault(key, []).append(event)
    return out


def _contenders(
    views: Sequence[ContainerView], priorities: Mapping[str, int], events: Mapping[str, list[ProbeEvent]]
) -> list[Contender]:
    out = []
    for view in views:
        key = view.identity.key
        mine = events.get(key, [])
        for row in view.rows:
            on_gpu = [e for e in mine if e.gpu_index in (row.gpu_index, ANY_GPU)]
            blocked = any(e.kind in (ProbeEventKind.OOM, ProbeEventKind.STOPPED_AT_ALLOCATION) for e in on_gpu)
            requested = max((e.requested_bytes for e in on_gpu), default=0)
            out.append(
                Contender(
                    key,
                    view.identity,
                    row.gpu_index,
                    row.memory_bytes,
                    requested,
                    priorities.get(key, 0),
                    blocked,
                )
            )
    return out


def _free_bytes(snapshot: Snapshot, gpu_index: int, contenders: Sequence[Contender]) -> int | None:
    for device in snapshot.devices:
        if device.index != gpu_index:
            continue
        if device.memory_free_bytes is not None:
            return device.memory_free_bytes
        if device.memory_total_bytes is not None:
            return device.memory_total_bytes - sum(c.held_bytes for c in contenders if c.gpu_index == gpu_index)
    return None


def _capacity(snapshot: Snapshot, gpu_index: int) -> int | None:
    return next((d.memory_total_bytes for d in snapshot.devices if d.index == gpu_index), None)


def _memory_arbitration(
    run: _Run,
    snapshot: Snapshot,
    views: Sequence[ContainerView],
    priorities: Mapping[str, int],
    events: Sequence[ProbeEvent],
    limits_by_key: Mapping[str, int],
) -> tuple[int, int, dict[str, int], dict[int, str], frozenset[str], dict[str, float]]:
    """Deadlock breaking, stopped-at-allocation continuation and fair share."""
    settings = run.policy.deadlock
    recent = _events_by_key(views, events, run.t - settings.blocked_window_s)
    contenders = _contenders(views, priorities, recent)
    by_key = {v.identity.key: v for v in views}
    gpus = sorted({c.gpu_index for c in contenders})
    detected = resolved = 0
    deadlocks = dict(run.prev.deadlocks)
    continued = {k: v for k, v in run.prev.continued_events_s.items() if k in by_key}
    effective: dict[str, int] = {}
    fair_paused = set(run.prev.fair_paused) & set(by_key)
    for gpu in gpus:
        free = _free_bytes(snapshot, gpu, contenders)
        if free is None:
            continue
        found = find_deadlock(gpu, free, contenders) if settings.enabled else None
        if found is not None and gpu not in deadlocks:
            detected += 1
            deadlocks[gpu] = found.victim.key
            verb = _verb(settings.action)
            run.emit(
                Decision(
                    verb,
                    found.victim.identity,
                    "deadlock",
                    "deadlock",
                    found.reason(),
                    (("free_bytes", float(free)),),
                    signal=settings.signal,
                    grace_s=settings.grace_s,
                )
            )
        elif found is None and gpu in deadlocks:
            resolved += 1
            victim = deadlocks.pop(gpu)
            if settings.action is ActionKind.PAUSE and victim in by_key:
                run.emit(
                    Decision(
                        Verb.RELEASE,
                        by_key[victim].identity,
                        "deadlock",
                        "deadlock",
                        f"GPU {gpu} deadlock resolved; resuming the paused victim",
                    )
                )
        # Fair share first: who waits (paused) and who may grow, highest priority first.
        capacity = _capacity(snapshot, gpu)
        pause_keys: tuple[str, ...] = ()
        resume_keys: tuple[str, ...] = ()
        if run.policy.fair_share.enabled and capacity:
            plan = plan_fair_share(gpu, capacity, contenders, fair_paused)
            if plan.oversubscribed:
                effective.update(dict(plan.effective_limits))
            pause_keys, resume_keys = plan.pause, plan.resume
        # A process stopped at allocation continues once its request fits (priority order).
        for c in sorted(contenders, key=lambda c: (-c.priority, c.requested_bytes, c.key)):
            if c.gpu_index != gpu:
                continue
            stops = [
                e
                for e in recent.get(c.key, [])
                if e.kind is ProbeEventKind.STOPPED_AT_ALLOCATION and e.gpu_index in (gpu, ANY_GPU)
            ]
            if not stops:
                continue
            last = max(e.timestamp_s for e in stops)
            if continued.get(c.key, -1.0) >= last or deadlocks.get(gpu) == c.key:
                continue
            if c.key in resume_keys:
                continued[c.key] = last  # the fair-share resume below continues it
                free -= c.requested_bytes
                continue
            if c.key in fair_paused or c.key in pause_keys or c.requested_bytes > free:
                continue
            own_limit = limits_by_key.get(c.key)
            if own_limit is not None and by_key[c.key].memory_bytes + c.requested_bytes > own_limit:
                continue  # over its own limit: the rule's ladder decides (pause/checkpoint/kill)
            continued[c.key] = last
            free -= c.requested_bytes
            run.emit(
                Decision(
                    Verb.RELEASE,
                    c.identity,
                    "stopped-at-allocation",
                    "deadlock",
                    f"GPU {gpu} now has room for the stopped allocation of {c.requested_bytes} B",
                    continue_stopped=True,
                )
            )
        for key in pause_keys:
            decision = run.emit(
                Decision(
                    Verb.PAUSE,
                    by_key[key].identity,
                    "fair-share",
                    "fair_share",
                    f"GPU {gpu} memory oversubscribed; lower priority waits",
                )
            )
            if not decision.suppressed:
                fair_paused.add(key)
        for key in resume_keys:
            run.emit(
                Decision(
                    Verb.RELEASE,
                    by_key[key].identity,
                    "fair-share",
                    "fair_share",
                    f"GPU {gpu} has room again; resuming in priority order",
                    continue_stopped=True,
                )
            )
            fair_paused.discard(key)
    return detected, resolved, effective, deadlocks, frozenset(fair_paused), continued


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
    pending: dict[str, int] = {}
    for key, found in _events_by_key(views, probe_events, t - policy.deadlock.blocked_window_s).items():
        stops = [
            e
            for e in found
            if e.kind is ProbeEventKind.STOPPED_AT_ALLOCATION
            and e.timestamp_s > state.continued_events_s.get(key, -1.0)
        ]
        if stops:
            pending[key] = max(e.requested_bytes for e in stops)
    limits_by_key: dict[str, int] = {}
    for view in views:
        key = view.identity.key
        identities[key] = view.identity
        last_seen[key] = t
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
    detected, resolved, effective, deadlocks, fair_paused, continued = _memory_arbitration(
        run, snapshot, views, priorities, probe_events, limits_by_key
    )
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
        deadlocks=deadlocks,
        continued_events_s=continued,
        fair_paused=fair_paused,
    )
    return EvaluationResult(
        tuple(run.decisions),
        new_state,
        notes=tuple(run.notes),
        deadlocks_detected=detected,
        deadlocks_resolved=resolved,
        measurements=measurements,
        effective_limits_bytes=effective,
        rules_by_target=rules_by_target,
    )


def match_glob(pattern: str, value: str) -> bool:
    return fnmatch.fnmatchcase(value, pattern)
