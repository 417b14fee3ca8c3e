"""Turn an authenticated Alertmanager webhook request into at most one enforcer Decision.

The webhook only authenticates and parses; this decides (pure, given the latest view):
the target must be a container in the latest snapshot; the host root, the agent's own
cgroup and protected namespaces (unless a policy rule names the namespace literally) are
refused; a resolved alert only ever releases (thaws) what a pause/throttle alert did.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpuwatch.model import ContainerIdentity
from gpuwatch.policy.evaluate import Decision, SafetyContext, Verb
from gpuwatch.policy.match import is_host_root, select_rule
from gpuwatch.policy.model import ActionKind, Policy

VERBS = {
    "alert": Verb.ALERT,
    "pause": Verb.PAUSE,
    "resume": Verb.RELEASE,
    "throttle": Verb.THROTTLE,
    "checkpoint_kill": Verb.CHECKPOINT_KILL,
    "kill": Verb.KILL,
}
DEFAULT_GRACE_S = 30.0


@dataclass(frozen=True)
class WebhookVerdict:
    decision: Decision | None
    reason: str


def find_target(identities: Iterable[ContainerIdentity], target: Mapping[str, str]) -> list[ContainerIdentity]:
    found = []
    for identity in identities:
        if target.get("container_id") and not identity.container_id.startswith(target["container_id"]):
            continue
        if target.get("namespace") and identity.pod_namespace != target["namespace"]:
            continue
        if target.get("pod") and identity.pod_name != target["pod"]:
            continue
        if target.get("container") and identity.container_name != target["container"]:
            continue
        found.append(identity)
    return found


def decide_webhook(
    policy: Policy,
    identities: Iterable[ContainerIdentity],
    safety: SafetyContext,
    action: str,
    firing: bool,
    alert_name: str,
    target: Mapping[str, str],
) -> WebhookVerdict:
    verb = VERBS.get(action)
    if verb is None:
        return WebhookVerdict(None, f"unknown action {action!r}")
    matches = find_target(identities, target)
    if not matches:
        return WebhookVerdict(None, f"no container in the latest snapshot matches {dict(target)}")
    if len(matches) > 1 and verb.disruptive:
        return WebhookVerdict(None, f"{len(matches)} containers match {dict(target)}; name one container")
    identity = matches[0]
    if not firing:
        if verb not in (Verb.PAUSE, Verb.THROTTLE, Verb.RELEASE):
            return WebhookVerdict(None, "alert resolved: nothing to undo for this action")
        verb = Verb.RELEASE
    rule_match = select_rule(policy, identity)
    rule = rule_match.rule
    suppressed = ""
    if verb.disruptive or verb is Verb.RELEASE:
        if is_host_root(identity):
            suppressed = "safety: the host root cgroup is never acted on"
        else:
            suppressed = safety.unsafe_reason(identity)
        if not suppressed and rule_match.protected and rule is None:
            suppressed = f"namespace {identity.pod_namespace!r} is protected and no rule names it"
    share = rule.limits.gpu_time_share if rule is not None else None
    grace, sig = DEFAULT_GRACE_S, int(signal.SIGUSR1)
    for step in rule.actions if rule is not None else ():
        if step.kind is ActionKind.THROTTLE and step.share is not None:
            share = step.share
        if step.kind is ActionKind.CHECKPOINT_KILL:
            grace, sig = step.grace_s, step.signal
    if verb is Verb.THROTTLE and share is None and not suppressed:
        return WebhookVerdict(None, "throttle needs a gpu_time_share from the policy rule of this container")
    decision = Decision(
        verb,
        identity,
        f"webhook:{alert_name}",
        "webhook",
        f"Alertmanager alert {alert_name} ({'firing' if firing else 'resolved'})",
        share=share,
        signal=sig,
        grace_s=grace,
        suppressed=suppressed,
    )
    return WebhookVerdict(decision, suppressed or "accepted")
