"""The progress-aware elastic controller (policy/elastic.py) on made-up snapshots: growth
efficiency normalised by each job's early rate, shares in proportion with a floor,
plateaued jobs yield, jobs without progress keep their fair share, hysteresis and dwell,
bad reads change nothing, releases when jobs leave or the section is switched off."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

from gpuwatch.core.model import ContainerIdentity, ContainerProgress, Snapshot
from gpuwatch.policy.decisions import Decision, Verb
from gpuwatch.policy.elastic import divide
from gpuwatch.policy.rules import ElasticDivide, ElasticSettings, ElasticThrottle
from tests.unit.test_policy_evaluate import Driver, ident, policy, snap, usage

POLICY = """
elastic: {enabled: true, window: 4s, floor: 10%, hysteresis: 5%, min_dwell: 6s, plateau: 5%, min_gpu_time: 0.2s}
rules:
  - name: all
    match: {namespace: ml}
"""


def curve_exp(k: float, start: float = 1.0):  # type: ignore[no-untyped-def]
    return lambda w: start * math.exp(-k * w)


def curve_linear(k: float, start: float = 1.0):  # type: ignore[no-untyped-def]
    return lambda w: start - k * w


class Node:
    """Jobs on one GPU sharing it equally (each gets 1/n of a GPU-second per second)."""

    def __init__(self, text: str = POLICY) -> None:
        self.driver = Driver(policy(text))
        self.jobs: dict[str, tuple[ContainerIdentity, object]] = {}
        self.kernel: dict[str, float] = {}
        self.t = 0.0
        self.garbage: set[str] = set()
        self.sm: dict[str, float] = {}  # SM utilisation each job reports (NVML's per-process share)

    def add(self, name: str, curve: object | None) -> ContainerIdentity:
        who = ident(name)
        self.jobs[name] = (who, curve)
        self.kernel[name] = 0.0
        return who

    def step(self, dt: float = 1.0, shares: dict[str, float] | None = None):  # type: ignore[no-untyped-def]
        self.t += dt
        for name in self.jobs:
            self.kernel[name] += dt * (shares or {}).get(name, 1.0 / len(self.jobs))
        rows, progress = [], []
        for name, (who, curve) in self.jobs.items():
            rows.append(dataclasses.replace(usage(who, kernel_s=self.kernel[name]),
                                            sm_utilization_ratio=self.sm.get(name, 0.0)))
            if curve is not None:
                value = curve(self.kernel[name])  # type: ignore[operator]
                error = "garbage" if name in self.garbage else ""
                previous = self.last.get(name) if hasattr(self, "last") else None
                if error and previous is not None:
                    progress.append(dataclasses.replace(previous, last_error=error,
                                                        errors_total=previous.errors_total + 1))
                    continue
                p = ContainerProgress(who, "/tmp/loss", "minimize", value, self.t,
                                      kernel_seconds_total=self.kernel[name])
                progress.append(p)
                self.last = {**getattr(self, "last", {}), name: p}
        s = dataclasses.replace(snap(self.t, *rows), progress=tuple(progress))
        return self.driver.step(s)


def throttles(result) -> dict[str, float | None]:  # type: ignore[no-untyped-def]
    return {d.target.container_name: (d.share if d.verb is Verb.THROTTLE else None)
            for d in result.decisions if d.scope == "elastic"}


def run(node: Node, seconds: int) -> list[object]:
    return [node.step() for _ in range(seconds)]


def test_divide_floor_proportional_and_plateau() -> None:
    s = ElasticSettings(enabled=True, floor=0.1, plateau=0.05)
    shares = divide({}, {"a": 1.0, "b": 0.5, "c": 0.01}, s)
    assert shares["c"] == 0.1  # plateaued: the floor
    assert math.isclose(shares["a"] - 0.1, 2 * (shares["b"] - 0.1)) and math.isclose(sum(shares.values()), 1.0)
    with_fixed = divide({"x": 0.25}, {"a": 1.0, "b": 1.0}, s)
    assert with_fixed == {"x": 0.25, "a": 0.375, "b": 0.375}
    assert divide({}, {"a": 0.0, "b": 0.0}, s) == {"a": 0.5, "b": 0.5}


def test_plateaued_job_yields_to_the_one_still_learning() -> None:
    node = Node()
    node.add("steep", curve_linear(0.01))
    node.add("flat", curve_exp(3.0))  # plateaus within its first GPU-second or two
    results = run(node, 12)
    decided = [throttles(r) for r in results if throttles(r)]
    assert decided, "the controller never acted"
    first = decided[0]
    assert list(first) == ["flat"] and first["flat"] < 0.5, first  # the steep one is never throttled
    assert results[-1].state.elastic.jobs[ident("flat").key].throttle == 0.1  # then down to the floor
    status = results[-1].elastic_status
    assert status[ident("flat").key].role == "plateaued" and status[ident("steep").key].role == "gaining"
    assert math.isclose(status[ident("steep").key].share, 0.9)


def test_efficiency_is_normalised_by_each_jobs_early_rate() -> None:
    # the same shape on two loss scales (1 and 1000): same efficiency, so no one yields
    node = Node()
    node.add("small", curve_exp(0.05))
    node.add("large", curve_exp(0.05, start=1000.0))
    results = run(node, 20)
    assert not any(throttles(r) for r in results)
    status = results[-1].elastic_status
    small, large = status[ident("small").key].efficiency, status[ident("large").key].efficiency
    assert small is not None and large is not None and abs(small - large) < 0.02 and small < 1.0


def test_job_without_progress_keeps_its_fair_share() -> None:
    node = Node()
    node.add("steep", curve_linear(0.01))
    node.add("flat", curve_exp(3.0))
    node.add("silent", None)
    results = run(node, 20)
    first = next(throttles(r) for r in results if throttles(r))
    assert math.isclose(first["silent"], round(1 / 3, 4)) and first["flat"] < 1 / 3
    assert "steep" not in first  # the one with the largest share takes what is left
    jobs = results[-1].state.elastic.jobs
    assert jobs[ident("flat").key].throttle == 0.1 and jobs[ident("steep").key].throttle is None
    assert jobs[ident("silent").key].throttle == round(1 / 3, 4)
    assert results[-1].elastic_status[ident("silent").key].role == "fair"


def test_garbage_in_a_progress_file_changes_nothing() -> None:
    node = Node()
    node.add("steep", curve_linear(0.01))
    node.add("flat", curve_exp(3.0))
    results = run(node, 12)
    before = {k: (v.share, v.throttle) for k, v in results[-1].elastic_status.items()}
    node.garbage = {"steep", "flat"}
    later = run(node, 20)
    assert not any(throttles(r) for r in later)
    after = {k: (v.share, v.throttle) for k, v in later[-1].elastic_status.items()}
    assert after == before


def test_hysteresis_and_dwell_limit_changes() -> None:
    node = Node()
    node.add("a", curve_exp(0.3))
    node.add("b", curve_exp(0.1))
    results = run(node, 60)
    times = [r.state.last_snapshot_s for r in results if throttles(r)]
    assert times, "no change at all"
    assert all(b - a >= 6.0 for a, b in itertools.pairwise(times))  # min_dwell 6s


def test_release_when_the_yielder_leaves_or_elastic_is_switched_off() -> None:
    node = Node()
    node.add("steep", curve_linear(0.01))
    node.add("flat", curve_exp(3.0))
    run(node, 12)
    del node.jobs["steep"]
    # alone now: nobody to yield to, the throttle goes
    assert throttles(node.step()) == {"flat": None}
    node.add("steep2", curve_linear(0.01))
    run(node, 12)
    node.driver.policy = policy("rules:\n  - name: all\n    match: {namespace: ml}\n")
    released = throttles(node.step())
    assert released and all(v is None for v in released.values())


def test_paused_or_waiting_containers_are_left_to_their_holder() -> None:
    node = Node(POLICY.replace("rules:", "fair_share: {enabled: true}\nrules:"))
    node.add("steep", curve_linear(0.01))
    node.add("flat", curve_exp(3.0))
    results = run(node, 12)
    assert any(throttles(r) for r in results)
    assert isinstance(results[-1].state.elastic.jobs[ident("flat").key].throttle, float)


def test_snapshot_field_is_optional() -> None:
    assert Snapshot(timestamp_s=0.0, node="", devices=(), containers=()).progress == ()


def test_nobody_yields_while_containers_wait_for_memory_on_the_gpu() -> None:
    from gpuwatch.policy.elastic import elastic_round
    from gpuwatch.policy.usage import group_containers

    node = Node()
    node.add("steep", curve_linear(0.01))
    node.add("flat", curve_exp(3.0))
    results = run(node, 12)
    state = results[-1].state.elastic
    assert state.jobs[ident("flat").key].throttle == 0.1
    rows = [usage(who, kernel_s=node.kernel[name]) for name, (who, _) in node.jobs.items()]
    progress = {ident(n).key: node.last[n] for n in node.jobs}
    emitted: list[Decision] = []

    def emit(decision: Decision) -> Decision:
        emitted.append(decision)
        return decision

    state, status = elastic_round(policy(POLICY).elastic, group_containers(rows), progress,
                                  {ident("steep").key, ident("flat").key}, (), state, node.t + 1, emit, queued_gpus={0})
    assert [(d.verb, d.target.container_name) for d in emitted] == [(Verb.RELEASE, "flat")]
    assert {s.role for s in status.values()} == {"queue"}


def test_contended_only_yields_where_the_engine_is_busy() -> None:
    text = POLICY.replace("min_gpu_time: 0.2s}", "min_gpu_time: 0.2s, contended: 80%}")
    assert policy(text).elastic.contended == 0.8

    def node(busy: float) -> Node:
        n = Node(text)
        n.add("steep", curve_linear(0.01))
        n.add("flat", curve_exp(3.0))
        n.sm = {"steep": busy / 2, "flat": busy / 2}
        return n

    # the two jobs' idle phases leave the engine half free: nobody is frozen for the other
    idle = run(node(0.5), 12)
    assert not any(throttles(r) for r in idle)
    assert idle[-1].elastic_status[ident("flat").key].role == "plateaued"  # measured, but not acted on
    # the engine is saturated: the plateaued job yields as without the setting
    busy = run(node(1.0), 12)
    decided = [throttles(r) for r in busy if throttles(r)]
    assert decided and list(decided[0]) == ["flat"], decided
    # the throttle in force lowered the engine's use, but not below half of the threshold: it stays;
    # below it, it is released
    n = node(1.0)
    run(n, 12)
    n.sm = {"steep": 0.4, "flat": 0.05}
    kept = run(n, 2)
    assert all(r.state.elastic.jobs[ident("flat").key].throttle is not None for r in kept)
    n.sm = {"steep": 0.2, "flat": 0.05}
    released = run(n, 1)[0]
    assert throttles(released) == {"flat": None}


def test_throttle_yielding_holds_only_the_jobs_that_yield() -> None:
    def decided(throttle: str) -> set[str]:
        n = Node(POLICY.replace("min_gpu_time: 0.2s}", f"min_gpu_time: 0.2s, throttle: {throttle}}}"))
        n.add("steep", curve_linear(0.01))
        n.add("flat", curve_exp(3.0))
        n.add("blind", None)  # no progress input: keeps its fair share
        return {name for r in run(n, 12) for name, share in throttles(r).items() if share is not None}

    # the default holds every tenant but the largest share to its share, the job without
    # progress input too; `yielding` throttles only the plateaued one
    assert decided("all-but-top") == {"flat", "blind"}
    assert decided("yielding") == {"flat"}
    assert policy(POLICY.replace("min_gpu_time: 0.2s}", "min_gpu_time: 0.2s, throttle: yielding}")
                  ).elastic.throttle is ElasticThrottle.YIELDING


def test_divide_plateau_only_plateaued_jobs_yield() -> None:
    s = ElasticSettings(enabled=True, floor=0.1, plateau=0.05, divide=ElasticDivide.PLATEAU)
    shares = divide({}, {"a": 1.0, "b": 0.2, "c": 0.01}, s)
    # the half-flattened job keeps an equal part with the steep one; only the plateaued one yields
    assert shares["c"] == 0.1 and math.isclose(shares["a"], 0.45) and math.isclose(shares["b"], 0.45)
    assert divide({}, {"a": 1.0, "b": 0.2}, s) == {"a": 0.5, "b": 0.5}
    efficiency = divide({}, {"a": 1.0, "b": 0.2}, dataclasses.replace(s, divide=ElasticDivide.EFFICIENCY))
    assert efficiency["a"] > efficiency["b"]
    text = POLICY.replace("min_gpu_time: 0.2s}", "min_gpu_time: 0.2s, divide: plateau}")
    assert policy(text).elastic.divide is ElasticDivide.PLATEAU


def _queued_round(text: str, node: Node, state, waiting_gpu: int = 0):  # type: ignore[no-untyped-def]
    """One elastic round on `node`'s jobs with containers waiting for memory on `waiting_gpu`."""
    from gpuwatch.policy.elastic import elastic_round
    from gpuwatch.policy.usage import group_containers

    rows = [usage(who, kernel_s=node.kernel[name]) for name, (who, _) in node.jobs.items()]
    progress = {ident(n).key: node.last[n] for n in node.jobs if n in node.last}
    emitted: list[Decision] = []

    def emit(decision: Decision) -> Decision:
        emitted.append(decision)
        return decision

    pol = policy(text)
    state, status = elastic_round(pol.elastic, group_containers(rows), progress, {ident(n).key for n in node.jobs},
                                  (), state, node.t + 1, emit, queued_gpus={waiting_gpu},
                                  rescheduling=pol.rescheduling)
    return state, status, emitted


def test_checkpoint_plateaued_yields_memory_to_the_queue_one_job_at_a_time() -> None:
    text = POLICY.replace("min_gpu_time: 0.2s}", "min_gpu_time: 0.2s, checkpoint_plateaued: true}") + \
        "rescheduling: {signal: SIGTERM, grace: 7s}\n"
    assert policy(text).elastic.checkpoint_plateaued
    node = Node(text)
    node.add("steep", curve_linear(0.01))
    node.add("flat", curve_exp(3.0))
    node.add("flatter", curve_exp(6.0))
    state = run(node, 12)[-1].state.elastic
    state, _status, emitted = _queued_round(text, node, state)
    checkpoints = [d for d in emitted if d.verb is Verb.CHECKPOINT_KILL]
    # the least efficient plateaued job, with the rescheduling section's signal and grace
    assert [d.target.container_name for d in checkpoints] == ["flatter"], emitted
    assert checkpoints[0].scope == "elastic" and checkpoints[0].signal == 15 and checkpoints[0].grace_s == 7.0
    assert "plateaued" in checkpoints[0].reason and "wait for memory" in checkpoints[0].reason
    # while it checkpoints, nobody else is asked: its memory may be all the queue needs
    _state, _status, again = _queued_round(text, node, state)
    assert not [d for d in again if d.verb is Verb.CHECKPOINT_KILL]


def test_checkpoint_plateaued_needs_a_queue_and_the_setting() -> None:
    node = Node()
    node.add("steep", curve_linear(0.01))
    node.add("flat", curve_exp(3.0))
    state = run(node, 12)[-1].state.elastic
    # off by default: a queue only holds the division off
    _s, _st, emitted = _queued_round(POLICY, node, state)
    assert not [d for d in emitted if d.verb is Verb.CHECKPOINT_KILL]
    # on, but the queue is on another GPU: nothing to yield to here
    text = POLICY.replace("min_gpu_time: 0.2s}", "min_gpu_time: 0.2s, checkpoint_plateaued: true}")
    _s, _st, emitted = _queued_round(text, node, state, waiting_gpu=1)
    assert not [d for d in emitted if d.verb is Verb.CHECKPOINT_KILL]
    # a learning job is never checkpointed, only plateaued ones
    learning = Node(text)
    learning.add("a", curve_linear(0.01))
    learning.add("b", curve_linear(0.02))
    state = run(learning, 12)[-1].state.elastic
    _s, _st, emitted = _queued_round(text, learning, state)
    assert not [d for d in emitted if d.verb is Verb.CHECKPOINT_KILL]


def test_shares_kept_from_fewer_tenants_never_squeeze_a_learning_job_to_nothing() -> None:
    """A held share from a round with fewer tenants (0.8 of two) beside a new fair one (1/3) once
    left the pool empty: the job still learning got a throttle share of 0, which the throttle
    refuses (seen in bench_sharing's elastic mode). Every share stays positive, the learning jobs
    keep their floor, and the GPU is not divided beyond all of it."""
    s = ElasticSettings(enabled=True, floor=0.1, plateau=0.05)
    for fixed in ({"held": 0.8, "new": 1 / 3}, {"a": 0.5, "b": 0.5, "c": 0.5}, {"x": 1.0}):
        shares = divide(fixed, {"learner": 0.7, "plateaued": 0.01}, s)
        assert min(shares.values()) > 0, (fixed, shares)
        assert shares["learner"] >= 0.1 - 1e-9 and shares["plateaued"] >= 0.1 - 1e-9, (fixed, shares)
        assert sum(shares.values()) <= 1 + 1e-9, (fixed, shares)
        # what is fixed keeps its proportions when it has to give way
        keys = sorted(fixed)
        ratios = [shares[k] / fixed[k] for k in keys]
        assert max(ratios) - min(ratios) < 1e-9, (fixed, shares)


def test_divide_keeps_every_share_in_range_on_random_gpus() -> None:
    """Seeded random GPUs (kept and annotated shares of any size, efficiencies from 0 to far
    above the early rate, every setting's range): every share in (0, 1], the GPU never divided
    beyond all of it, each job with an efficiency at or above its floor (the floor shrinks to an
    equal split only where the tenants cannot all have it)."""
    rng = random.Random(21)
    for _ in range(3000):
        s = ElasticSettings(enabled=True, floor=rng.choice([0.01, 0.05, 0.1, 0.25, 0.5]),
                            plateau=rng.choice([0.01, 0.05, 0.5, 1.0]), divide=rng.choice(list(ElasticDivide)))
        fixed = {f"f{k}": rng.choice([rng.uniform(0.01, 1.0), 1 / rng.randint(1, 8)]) for k in range(rng.randint(0, 5))}
        efficiencies = {f"e{k}": rng.choice([0.0, 1e-9, rng.uniform(0.0, 2.0), 5.0]) for k in range(rng.randint(1, 6))}
        shares = divide(fixed, efficiencies, s)
        case = (s.floor, fixed, efficiencies, shares)
        assert set(shares) == set(fixed) | set(efficiencies), case
        assert all(0 < v <= 1 for v in shares.values()), case
        assert sum(shares.values()) <= 1 + 1e-9, case
        floor = min(s.floor, 1 / (len(fixed) + len(efficiencies)))
        assert all(shares[k] >= floor - 1e-9 for k in efficiencies), case
