"""Pure evaluation: ladders, hysteresis, hold/release, rate limit, staleness, safety,
namespace quotas, deadlock breaking and fair share — all on made-up snapshots."""

from __future__ import annotations

from collections.abc import Sequence

from gpuwatch.core.model import ContainerIdentity, ContainerUsage, DeviceInfo, ProcessUsage, Snapshot
from gpuwatch.policy.evaluate import EvaluationResult, EvaluatorState, SafetyContext, Verb, evaluate
from gpuwatch.policy.events import ProbeEvent, ProbeEventKind
from gpuwatch.policy.loader import check_policy_text
from gpuwatch.policy.rules import Policy

GIB = 2**30


def policy(text: str) -> Policy:
    loaded, issues = check_policy_text(text)
    assert not issues, [str(i) for i in issues]
    assert loaded is not None
    return loaded


def ident(name: str, namespace: str = "ml", priority_label: str = "", cgroup: str = "") -> ContainerIdentity:
    labels = (("tier", priority_label),) if priority_label else ()
    return ContainerIdentity(
        runtime="k8s",
        cgroup_path=cgroup or f"/kubepods/pod-{name}/{name}",
        container_id=f"id-{name}",
        container_name=name,
        pod_name=f"pod-{name}",
        pod_namespace=namespace,
        labels=labels,
    )


def usage(
    identity: ContainerIdentity,
    memory_bytes: int = 0,
    kernel_s: float = 0.0,
    gpu: int = 0,
    pids: Sequence[int] = (1,),
) -> ContainerUsage:
    procs = tuple(ProcessUsage(p, None, "python", None, None) for p in pids)
    return ContainerUsage(identity, gpu, f"GPU-{gpu}", memory_bytes, 0.0, kernel_s, procs)


def snap(t: float, *rows: ContainerUsage, total: int = 16 * GIB, free: int | None = None, gpus: int = 1) -> Snapshot:
    devices = tuple(DeviceInfo(i, f"GPU-{i}", "sim", None, total, None, free) for i in range(gpus))
    return Snapshot(timestamp_s=t, node="n", devices=devices, containers=rows, interval_s=1.0)


class Driver:
    """Feeds snapshots in order, threading the state through like the enforcer does."""

    def __init__(self, pol: Policy, safety: SafetyContext | None = None) -> None:
        self.policy = pol
        self.state = EvaluatorState()
        self.safety = safety

    def step(self, snapshot: Snapshot, events: Sequence[ProbeEvent] = (), now: float | None = None) -> EvaluationResult:
        result = evaluate(self.policy, snapshot, events, self.state, now, self.safety)
        self.state = result.state
        return result


MEM_LADDER = """
tuning: {release_after: 3s, min_hold: 2s, hysteresis: 5%}
rules:
  - name: mem
    match: {namespace: ml}
    limits: {gpu_memory: 4GiB}
    actions:
      - {do: alert, at: 90%, repeat: 100s}
      - {do: pause, at: 100%, for: 3s}
      - {do: checkpoint-then-kill, at: 100%, for: 10s, grace: 5s, signal: SIGTERM}
"""


def verbs(result: EvaluationResult) -> list[Verb]:
    return [d.verb for d in result.decisions]


def test_under_limit_does_nothing() -> None:
    d = Driver(policy(MEM_LADDER))
    a = ident("a")
    for t in range(5):
        assert verbs(d.step(snap(float(t), usage(a, 3 * GIB)))) == []


def test_ladder_escalates_alert_pause_then_checkpoint_kill() -> None:
    d = Driver(policy(MEM_LADDER))
    a = ident("a")
    seen: list[tuple[float, Verb]] = []
    for t in range(0, 13):
        for dec in d.step(snap(float(t), usage(a, 5 * GIB))).decisions:
            seen.append((float(t), dec.verb))
    assert seen == [(0.0, Verb.ALERT), (3.0, Verb.PAUSE), (10.0, Verb.CHECKPOINT_KILL)]


def test_checkpoint_kill_carries_signal_grace_and_reason() -> None:
    d = Driver(policy(MEM_LADDER))
    a = ident("a")
    kill = None
    for t in range(0, 11):
        for dec in d.step(snap(float(t), usage(a, 5 * GIB))).decisions:
            kill = dec if dec.verb is Verb.CHECKPOINT_KILL else kill
    assert kill is not None
    assert kill.signal == 15 and kill.grace_s == 5.0 and kill.rule == "mem"
    assert "gpu_memory at 125% of limit" in kill.reason
    assert dict(kill.measured)["memory_bytes"] == 5 * GIB


def test_alert_at_90_percent_and_repeat_interval() -> None:
    d = Driver(policy(MEM_LADDER.replace("repeat: 100s", "repeat: 5s")))
    a = ident("a")
    alerts = [t for t in range(12) if Verb.ALERT in verbs(d.step(snap(float(t), usage(a, int(3.8 * GIB)))))]
    assert alerts == [0, 5, 10]


def test_hysteresis_keeps_step_holding_just_below_threshold() -> None:
    d = Driver(policy(MEM_LADDER))
    a = ident("a")
    # 100% at t=0, then 97% (inside the 5-point band): the pause step keeps its clock.
    out = [verbs(d.step(snap(float(t), usage(a, int((4.0 if t == 0 else 3.88) * GIB))))) for t in range(4)]
    assert Verb.PAUSE in out[3]


def test_dropping_below_band_resets_the_for_clock() -> None:
    d = Driver(policy(MEM_LADDER))
    a = ident("a")
    sizes = [4.2, 4.2, 3.0, 4.2, 4.2, 4.2, 4.2]  # dips to 75% at t=2: the 3 s clock restarts at t=3
    out = [verbs(d.step(snap(float(t), usage(a, int(s * GIB))))) for t, s in enumerate(sizes)]
    assert [t for t, o in enumerate(out) if Verb.PAUSE in o] == [6]


def test_pause_is_released_after_clear_time_and_not_before() -> None:
    d = Driver(policy(MEM_LADDER))
    a = ident("a")
    events: list[tuple[int, Verb]] = []
    for t in range(0, 12):
        memory = 5 * GIB if t < 5 else 2 * GIB
        events += [(t, v) for v in verbs(d.step(snap(float(t), usage(a, memory))))]
    assert (3, Verb.PAUSE) in events
    releases = [t for t, v in events if v is Verb.RELEASE]
    assert releases == [8]  # clear from t=5, release_after 3 s


def test_no_flapping_when_usage_oscillates_around_threshold() -> None:
    d = Driver(policy(MEM_LADDER))
    a = ident("a")
    count = 0
    for t in range(60):
        memory = int((4.1 if t % 2 else 3.95) * GIB)  # 102% / 99%: inside the hysteresis band
        count += sum(1 for v in verbs(d.step(snap(float(t), usage(a, memory)))) if v in (Verb.PAUSE, Verb.RELEASE))
    assert count == 1  # paused once, never released while it oscillates


def test_stale_snapshot_is_never_acted_on() -> None:
    d = Driver(policy(MEM_LADDER))
    a = ident("a")
    result = d.step(snap(0.0, usage(a, 9 * GIB)), now=2.5)  # 2.5 intervals old
    assert result.stale and result.decisions == () and "not acting" in result.notes[0]
    fresh = d.step(snap(10.0, usage(a, 9 * GIB)), now=11.9)
    assert not fresh.stale and verbs(fresh) == [Verb.ALERT]


def test_same_snapshot_twice_is_evaluated_once() -> None:
    d = Driver(policy(MEM_LADDER))
    s = snap(0.0, usage(ident("a"), 9 * GIB))
    assert verbs(d.step(s)) == [Verb.ALERT]
    assert verbs(d.step(s)) == []


def test_gpu_time_share_from_kernel_seconds_and_throttle() -> None:
    pol = policy("""
rules:
  - name: share
    match: {default: true}
    limits: {gpu_time_share: 25%, window: 4s}
    actions:
      - {do: throttle, at: 100%, for: 2s}
""")
    d = Driver(pol)
    a = ident("a")
    decisions = []
    for t in range(8):
        result = d.step(snap(float(t), usage(a, 0, kernel_s=0.5 * t)))  # 50% of a GPU
        decisions += list(result.decisions)
    assert [x.verb for x in decisions] == [Verb.THROTTLE]
    assert decisions[0].share == 0.25
    assert result.measurements[a.key].gpu_time_share == 0.5


def test_throttle_share_override_on_step() -> None:
    pol = policy("""
rules:
  - name: share
    match: {default: true}
    limits: {gpu_time_share: 50%}
    actions: [{do: throttle, share: 30%}]
""")
    d = Driver(pol)
    a = ident("a")
    d.step(snap(0.0, usage(a, kernel_s=0.0)))
    result = d.step(snap(1.0, usage(a, kernel_s=0.9)))
    assert [(x.verb, x.share) for x in result.decisions] == [(Verb.THROTTLE, 0.3)]


def test_disallowed_device_and_max_processes() -> None:
    pol = policy("""
rules:
  - name: iso
    match: {default: true}
    limits: {devices: [0], max_processes: 2}
    actions: [{do: alert, at: 100%}]
""")
    d = Driver(pol)
    a, b = ident("a"), ident("b")
    result = d.step(snap(0.0, usage(a, GIB, gpu=1), usage(b, GIB, pids=(1, 2, 3)), gpus=2))
    assert sorted(x.target.container_name for x in result.decisions) == ["a", "b"]
    reasons = {x.target.container_name: x.reason for x in result.decisions}
    assert reasons["a"].startswith("devices") and reasons["b"].startswith("max_processes")


def test_percent_memory_limit_uses_device_size() -> None:
    pol = policy("rules:\n  - name: p\n    match: {default: true}\n    limits: {gpu_memory: 50%}\n")
    d = Driver(pol)
    a = ident("a")
    assert verbs(d.step(snap(0.0, usage(a, 7 * GIB), total=16 * GIB))) == []
    assert verbs(d.step(snap(1.0, usage(a, 9 * GIB), total=16 * GIB))) == [Verb.ALERT]


def test_first_matching_rule_wins_and_exemption() -> None:
    pol = policy("""
rules:
  - name: exempt-vip
    match: {labels: {tier: vip}}
  - name: all
    match: {default: true}
    limits: {gpu_memory: 1GiB}
""")
    d = Driver(pol)
    vip, normal = ident("vip", priority_label="vip"), ident("n")
    result = d.step(snap(0.0, usage(vip, 8 * GIB), usage(normal, 8 * GIB)))
    assert [x.target.container_name for x in result.decisions] == ["n"]
    assert result.rules_by_target[vip.key] == "exempt-vip"


def test_protected_namespace_untouched_unless_named() -> None:
    text = """
rules:
  - name: all
    match: {default: true}
    limits: {gpu_memory: 1GiB}
    actions: [{do: kill}]
"""
    sys_pod = ident("dns", namespace="kube-system")
    assert verbs(Driver(policy(text)).step(snap(0.0, usage(sys_pod, 8 * GIB)))) == []
    glob = text.replace("{default: true}", "{namespace: 'kube-*'}")
    assert verbs(Driver(policy(glob)).step(snap(0.0, usage(sys_pod, 8 * GIB)))) == []
    named = text.replace("{default: true}", "{namespace: kube-system}")
    assert verbs(Driver(policy(named)).step(snap(0.0, usage(sys_pod, 8 * GIB)))) == [Verb.KILL]


def test_host_root_and_own_cgroup_are_never_acted_on() -> None:
    pol = policy("""
rules:
  - name: everything
    match: {cgroup: '*'}
    limits: {gpu_memory: 1GiB}
    actions: [{do: kill}]
""")
    host = ContainerIdentity(runtime="host", cgroup_path="/")
    agent = ContainerIdentity(runtime="host", cgroup_path="/system.slice/gpuwatch.service")
    parent = ContainerIdentity(runtime="host", cgroup_path="/system.slice")
    other = ContainerIdentity(runtime="host", cgroup_path="/user.slice/job")
    d = Driver(pol, SafetyContext(frozenset({"/system.slice/gpuwatch.service"})))
    result = d.step(snap(0.0, *(usage(i, 8 * GIB) for i in (host, agent, parent, other))))
    by_path = {x.target.cgroup_path: x for x in result.decisions}
    assert "/" not in by_path  # the host root never even matches
    assert by_path["/system.slice/gpuwatch.service"].suppressed.startswith("safety")
    assert by_path["/system.slice"].suppressed.startswith("safety")
    assert by_path["/user.slice/job"].suppressed == ""


def test_default_rule_does_not_match_bare_host_cgroups() -> None:
    pol = policy("rules:\n  - name: d\n    match: {default: true}\n    limits: {gpu_memory: 1GiB}\n")
    bare = ContainerIdentity(runtime="host", cgroup_path="/user.slice/x")
    assert verbs(Driver(pol).step(snap(0.0, usage(bare, 8 * GIB)))) == []


def test_rate_limit_defers_and_retries() -> None:
    pol = policy("""
tuning: {max_actions_per_minute: 2}
rules:
  - name: r
    match: {default: true}
    limits: {gpu_memory: 1GiB}
    actions: [{do: pause}]
""")
    d = Driver(pol)
    rows = [usage(ident(n), 8 * GIB) for n in "abc"]
    first = d.step(snap(0.0, *rows))
    done = [x for x in first.decisions if not x.suppressed]
    deferred = [x for x in first.decisions if x.suppressed]
    assert len(done) == 2 and len(deferred) == 1 and "rate limit" in deferred[0].suppressed
    assert [x for x in d.step(snap(1.0, *rows)).decisions if not x.suppressed] == []
    later = d.step(snap(61.0, *rows))
    assert [(x.target.container_name, x.suppressed) for x in later.decisions] == [
        (deferred[0].target.container_name, "")
    ]


def test_vanished_target_gets_released() -> None:
    d = Driver(policy(MEM_LADDER))
    a, b = ident("a"), ident("b")
    for t in range(4):
        d.step(snap(float(t), usage(a, 5 * GIB), usage(b, GIB)))
    assert d.state.reversible_active
    released = []
    for t in range(4, 9):
        released += [x for x in d.step(snap(float(t), usage(b, GIB))).decisions if x.verb is Verb.RELEASE]
    assert [x.target.container_name for x in released] == ["a"]
    assert a.key not in d.state.identities


QUOTA = """
rules:
  - name: low
    priority: 1
    match: {labels: {tier: low}}
    limits: {gpu_memory: 100GiB}
  - name: high
    priority: 50
    match: {labels: {tier: high}}
    limits: {gpu_memory: 100GiB}
namespace_quotas:
  - namespace: team-*
    limits: {gpu_memory: 10GiB}
    actions:
      - {do: alert, at: 90%}
      - {do: pause, at: 100%, for: 2s}
"""


def test_namespace_quota_sums_containers_and_pauses_lowest_priority() -> None:
    d = Driver(policy(QUOTA))
    hi = ident("hi", "team-a", "high")
    lo = ident("lo", "team-a", "low")
    other = ident("x", "team-b", "low")
    seen = []
    for t in range(3):
        result = d.step(snap(float(t), usage(hi, 6 * GIB), usage(lo, 6 * GIB), usage(other, 6 * GIB)))
        seen += [(t, x.verb, x.target.container_name or x.target.pod_namespace, x.scope) for x in result.decisions]
    assert (0, Verb.ALERT, "team-a", "namespace") in seen
    assert (2, Verb.PAUSE, "lo", "namespace") in seen
    assert not any(name in ("hi", "x") and verb is Verb.PAUSE for _, verb, name, _ in seen)


def test_namespace_quota_release_when_back_under() -> None:
    d = Driver(policy(QUOTA.replace("for: 2s", "for: 0s")))
    lo = ident("lo", "team-a", "low")
    hi = ident("hi", "team-a", "high")
    d.step(snap(0.0, usage(hi, 6 * GIB), usage(lo, 6 * GIB)))
    rel = []
    for t in range(1, 30):
        rel += [
            x
            for x in d.step(snap(float(t), usage(hi, 6 * GIB), usage(lo, 1 * GIB))).decisions
            if x.verb is Verb.RELEASE
        ]
    assert [x.target.container_name for x in rel] == ["lo"]


# two priority rules by the "tier" label (also the head of test_policy_rescheduling's rules)
TIER_RULES = """rules:
  - name: low
    priority: 1
    match: {labels: {tier: low}}
  - name: high
    priority: 9
    match: {labels: {tier: high}}
"""
DEADLOCK = """
deadlock: {enabled: true, action: checkpoint-then-kill, grace: 3s, blocked_window: 10s}
""" + TIER_RULES


def oom(identity: ContainerIdentity, t: float, want: int, kind: ProbeEventKind = ProbeEventKind.OOM) -> ProbeEvent:
    return ProbeEvent(kind, t, 100, 0, want, cgroup_path=identity.cgroup_path)


def test_deadlock_detected_and_lowest_priority_is_the_victim() -> None:
    d = Driver(policy(DEADLOCK))
    hi, lo = ident("hi", priority_label="high"), ident("lo", priority_label="low")
    total, held = 5 * GIB, 2 * GIB
    s = snap(10.0, usage(hi, held), usage(lo, held), total=total, free=total - 2 * held)
    result = d.step(s, [oom(hi, 9.5, 2 * GIB), oom(lo, 9.6, 2 * GIB)])
    assert result.deadlocks_detected == 1
    (decision,) = result.decisions
    assert decision.verb is Verb.CHECKPOINT_KILL and decision.target.container_name == "lo"
    assert decision.grace_s == 3.0 and "deadlock" in decision.reason
    # Same deadlock next interval: not decided again.
    again = d.step(
        snap(11.0, usage(hi, held), usage(lo, held), total=total, free=total - 2 * held),
        [oom(hi, 10.5, 2 * GIB), oom(lo, 10.6, 2 * GIB)],
    )
    assert again.decisions == () and again.deadlocks_detected == 0
    # Victim gone, survivor allocates: resolved.
    done = d.step(snap(12.0, usage(hi, 4 * GIB), total=total, free=GIB))
    assert done.deadlocks_resolved == 1


def test_no_deadlock_when_one_request_fits() -> None:
    d = Driver(policy(DEADLOCK))
    a, b = ident("a", priority_label="low"), ident("b", priority_label="high")
    s = snap(10.0, usage(a, GIB), usage(b, GIB), total=5 * GIB, free=3 * GIB)
    assert d.step(s, [oom(a, 9.0, 2 * GIB), oom(b, 9.0, 4 * GIB)]).deadlocks_detected == 0


def test_old_events_do_not_count() -> None:
    d = Driver(policy(DEADLOCK))
    a, b = ident("a", priority_label="low"), ident("b", priority_label="high")
    s = snap(100.0, usage(a, 2 * GIB), usage(b, 2 * GIB), total=5 * GIB, free=GIB)
    assert d.step(s, [oom(a, 50.0, 2 * GIB), oom(b, 50.0, 2 * GIB)]).deadlocks_detected == 0


def test_stopped_at_allocation_continues_when_memory_frees() -> None:
    d = Driver(policy(DEADLOCK))
    a = ident("a", priority_label="low")
    ev = [oom(a, 9.0, 2 * GIB, ProbeEventKind.STOPPED_AT_ALLOCATION)]
    assert d.step(snap(10.0, usage(a, 2 * GIB), total=5 * GIB, free=GIB), ev).decisions == ()
    result = d.step(snap(11.0, usage(a, 2 * GIB), total=5 * GIB, free=3 * GIB), ev)
    assert [(x.verb, x.continue_stopped) for x in result.decisions] == [(Verb.RELEASE, True)]
    assert d.step(snap(12.0, usage(a, 2 * GIB), total=5 * GIB, free=3 * GIB), ev).decisions == ()


def test_fair_share_pauses_lowest_priority_then_resumes_in_order() -> None:
    pol = policy(DEADLOCK.replace("deadlock: {enabled: true", "fair_share: {enabled: true}\ndeadlock: {enabled: false"))
    d = Driver(pol)
    hi, lo = ident("hi", priority_label="high"), ident("lo", priority_label="low")
    total = 8 * GIB
    events = [
        oom(hi, 9.5, 3 * GIB, ProbeEventKind.OVER_LIMIT),
        oom(lo, 9.5, 3 * GIB, ProbeEventKind.OVER_LIMIT),
    ]
    result = d.step(snap(10.0, usage(hi, 2 * GIB), usage(lo, 2 * GIB), total=total, free=4 * GIB), events)
    assert [(x.verb, x.target.container_name) for x in result.decisions] == [(Verb.PAUSE, "lo")]
    limits = result.effective_limits_bytes
    assert limits[hi.key] > limits[lo.key] and sum(limits.values()) <= total
    # hi finished: room again -> lo resumed.
    result = d.step(snap(30.0, usage(lo, 2 * GIB), total=total, free=6 * GIB))
    assert [(x.verb, x.target.container_name) for x in result.decisions] == [(Verb.RELEASE, "lo")]


def test_weighted_fair_share_water_filling() -> None:
    from gpuwatch.policy.deadlock import weighted_fair_share

    shares = weighted_fair_share(10, [("small", 2, 1.0), ("a", 100, 1.0), ("b", 100, 2.0)])
    assert shares["small"] == 2
    assert abs(shares["b"] - 2 * shares["a"]) <= 1 and sum(shares.values()) <= 10
    assert weighted_fair_share(100, [("x", 5, 1.0), ("y", 7, 3.0)]) == {"x": 5, "y": 7}


def test_policy_change_releases_a_throttle_whose_rule_is_gone() -> None:
    throttling = policy("""
rules:
  - name: share
    match: {default: true}
    limits: {gpu_time_share: 25%}
    actions: [{do: throttle}]
""")
    d = Driver(throttling)
    a = ident("a")
    d.step(snap(0.0, usage(a, kernel_s=0.0)))
    assert verbs(d.step(snap(1.0, usage(a, kernel_s=0.9)))) == [Verb.THROTTLE]
    d.policy = policy("rules:\n  - name: exempt\n    match: {default: true}\n")
    result = d.step(snap(2.0, usage(a, kernel_s=1.8)))
    assert [(x.verb, x.reason.startswith("the rule that throttled")) for x in result.decisions] == [
        (Verb.RELEASE, True)
    ]
    assert verbs(d.step(snap(3.0, usage(a, kernel_s=2.7)))) == []


def test_renamed_rule_that_throttles_again_keeps_the_throttle() -> None:
    text = """
rules:
  - name: NAME
    match: {default: true}
    limits: {gpu_time_share: 25%}
    actions: [{do: throttle}]
"""
    d = Driver(policy(text.replace("NAME", "one")))
    a = ident("a")
    d.step(snap(0.0, usage(a, kernel_s=0.0)))
    assert verbs(d.step(snap(1.0, usage(a, kernel_s=0.9)))) == [Verb.THROTTLE]
    d.policy = policy(text.replace("NAME", "two"))
    assert verbs(d.step(snap(2.0, usage(a, kernel_s=1.8)))) == [Verb.THROTTLE]


def test_removed_quota_releases_its_paused_victims() -> None:
    d = Driver(policy(QUOTA.replace("for: 2s", "for: 0s")))
    lo, hi = ident("lo", "team-a", "low"), ident("hi", "team-a", "high")
    first = d.step(snap(0.0, usage(hi, 6 * GIB), usage(lo, 6 * GIB)))
    assert (Verb.PAUSE, "lo") in [(x.verb, x.target.container_name) for x in first.decisions]
    d.policy = policy(QUOTA.split("namespace_quotas:")[0])
    result = d.step(snap(1.0, usage(hi, 6 * GIB), usage(lo, 6 * GIB)))
    assert [(x.verb, x.target.container_name) for x in result.decisions] == [(Verb.RELEASE, "lo")]


def test_stopped_allocations_continue_in_priority_order_and_fair_share_pauses_the_rest() -> None:
    hi, lo = ident("hi", priority_label="high"), ident("lo", priority_label="low")
    events = [
        oom(lo, 9.0, 3 * GIB, ProbeEventKind.STOPPED_AT_ALLOCATION),
        oom(hi, 9.0, 3 * GIB, ProbeEventKind.STOPPED_AT_ALLOCATION),
    ]
    rows = (usage(lo, 2 * GIB), usage(hi, 2 * GIB))
    plain = Driver(policy(DEADLOCK)).step(snap(10.0, *rows, total=8 * GIB, free=4 * GIB), events)
    assert [(x.verb, x.target.container_name) for x in plain.decisions] == [(Verb.RELEASE, "hi")]
    fair = Driver(policy("fair_share: {enabled: true}\n" + DEADLOCK))
    result = fair.step(snap(10.0, *rows, total=8 * GIB, free=4 * GIB), events)
    assert [(x.verb, x.target.container_name) for x in result.decisions] == [(Verb.RELEASE, "hi"), (Verb.PAUSE, "lo")]
    # hi finished and freed its memory: lo is resumed (thaw + continue), once.
    later = fair.step(snap(20.0, usage(lo, 2 * GIB), total=8 * GIB, free=6 * GIB), events)
    assert [(x.verb, x.target.container_name, x.continue_stopped) for x in later.decisions] == [
        (Verb.RELEASE, "lo", True)
    ]
    assert fair.step(snap(21.0, usage(lo, 2 * GIB), total=8 * GIB, free=6 * GIB), events).decisions == ()


def test_allocation_stopped_over_own_limit_is_not_continued_and_counts_as_demand() -> None:
    pol = policy("""
rules:
  - name: capped
    match: {namespace: ml}
    limits: {gpu_memory: 3GiB}
    actions: [{do: checkpoint-then-kill, at: 100%, grace: 5s}]
""")
    d = Driver(pol)
    a = ident("a")
    ev = [oom(a, 9.0, 2 * GIB, ProbeEventKind.STOPPED_AT_ALLOCATION)]
    result = d.step(snap(10.0, usage(a, 2 * GIB), total=16 * GIB, free=14 * GIB), ev)
    assert [x.verb for x in result.decisions] == [Verb.CHECKPOINT_KILL]  # 2 held + 2 stopped > 3
    assert dict(result.decisions[0].measured)["pending_allocation_bytes"] == 2 * GIB
    within = Driver(pol).step(snap(10.0, usage(a, GIB // 2), total=16 * GIB, free=14 * GIB), ev)
    assert [(x.verb, x.continue_stopped) for x in within.decisions] == [(Verb.RELEASE, True)]
