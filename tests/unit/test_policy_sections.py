"""Loading the `fair_share`, `rescheduling` and `elastic` policy sections: defaults, every
key, and one clear error per bad value."""

from __future__ import annotations

import signal

from gpuwatch.policy.loader import check_policy_text
from gpuwatch.policy.rules import AdmissionOrder, ElasticSettings, ElasticThrottle, FairShareSplit, ReschedulingSettings

RULES = "rules:\n  - name: all\n    match: {default: true}\n"


def test_defaults() -> None:
    policy, issues = check_policy_text(RULES)
    assert policy is not None and not issues
    assert not policy.fair_share.enabled and policy.fair_share.split is FairShareSplit.DEMAND
    assert policy.rescheduling == ReschedulingSettings() and policy.rescheduling.checkpoint_after_s is None
    assert policy.elastic == ElasticSettings() and not policy.elastic.enabled


def test_every_key() -> None:
    policy, issues = check_policy_text(
        "fair_share: {enabled: true, split: equal}\n"
        "rescheduling: {checkpoint_after: 5m, signal: SIGTERM, grace: 10s, gate_new: false}\n"
        "elastic: {enabled: true, window: 5s, floor: 15%, hysteresis: 0.1, min_dwell: 20s, plateau: 2%,"
        " min_gpu_time: 1s, period: 200ms}\n" + RULES
    )
    assert policy is not None, [str(i) for i in issues]
    assert policy.fair_share.split is FairShareSplit.EQUAL
    assert policy.rescheduling == ReschedulingSettings(300.0, int(signal.SIGTERM), 10.0, False)
    assert policy.elastic == ElasticSettings(True, 5.0, 0.15, 0.1, 20.0, 0.02, 1.0, 0.2)
    never, _ = check_policy_text("rescheduling: {checkpoint_after: never}\n" + RULES)
    assert never is not None and never.rescheduling.checkpoint_after_s is None


def test_errors_name_the_line_and_the_fix() -> None:
    text = (
        "fair_share: {enabled: true, split: fair}\n"
        "rescheduling: {checkpoint_after: 0s, signal: SIGNOPE}\n"
        "elastic: {enabled: 1, window: 200ms, floor: 80%, plateaux: 5%}\n" + RULES
    )
    policy, issues = check_policy_text(text, "p.yaml")
    assert policy is None
    messages = [str(i) for i in issues]
    assert any(m.startswith("p.yaml:1: fair_share.split: unknown split 'fair'") for m in messages)
    assert any(m.startswith("p.yaml:2: rescheduling.checkpoint_after must be longer than 0s") for m in messages)
    assert any(m.startswith("p.yaml:2: rescheduling.signal") for m in messages)
    assert any("elastic.enabled must be true or false" in m for m in messages)
    assert any("elastic.window must be between 1s and 3600s, got 0.2s" in m for m in messages)
    assert any("elastic.floor" in m and "50%" in m for m in messages)
    assert any("unknown key 'plateaux'" in m and "did you mean 'plateau'" in m for m in messages)


def test_admission_order_headroom_and_contended() -> None:
    policy, issues = check_policy_text(
        "rescheduling: {order: smallest, headroom: 30%}\n"
        "elastic: {enabled: true, contended: 0.85, throttle: yielding}\n" + RULES)
    assert policy is not None, [str(i) for i in issues]
    assert policy.rescheduling.order is AdmissionOrder.SMALLEST and policy.rescheduling.headroom == 0.3
    assert policy.elastic.contended == 0.85 and policy.elastic.throttle is ElasticThrottle.YIELDING
    assert ReschedulingSettings().order is AdmissionOrder.ARRIVAL and ReschedulingSettings().headroom == 1.0
    assert ElasticSettings().contended == 0.0 and ElasticSettings().throttle is ElasticThrottle.ALL_BUT_TOP
    bad, issues = check_policy_text(
        "rescheduling: {order: biggest, headroom: 150%}\n"
        "elastic: {contended: 2, throttle: nobody, divide: fastest, checkpoint_plateaued: maybe}\n" + RULES,
        "p.yaml")
    assert bad is None
    messages = [str(i) for i in issues]
    assert any(m.startswith("p.yaml:1: rescheduling.order: unknown order 'biggest'") for m in messages), messages
    assert any(m.startswith("p.yaml:1: rescheduling.headroom") for m in messages), messages
    assert any(m.startswith("p.yaml:2: elastic.contended") for m in messages), messages
    assert any(m.startswith("p.yaml:2: elastic.throttle: unknown value 'nobody'") for m in messages), messages
    assert any(m.startswith("p.yaml:2: elastic.divide: unknown value 'fastest'") for m in messages), messages
    assert any(m.startswith("p.yaml:2: elastic.checkpoint_plateaued must be true or false") for m in messages), messages
