"""Turn an authenticated Alertmanager webhook request into at most one enforcer Decision.

The webhook only authenticates and parses; this decides (pure, given the latest view):
the target must be exactly one container in the latest snapshot; the host root, the
agent's own cgroup and protected namespaces (unless a policy rule names the namespace
literally) are refused; a resolved alert only ever releases (thaws) what a pause/throttle
alert did.

Targets match exactly (`find_target`): a `container_id` label loses its ``runtime://``
prefix (``containerd://``, ``docker://``, ``cri-o://``: what kube-state-metrics exports)
and must be a container's full id, or a prefix of at least MIN_ID_PREFIX hex characters
that exactly one live container has; `namespace` + `pod` and `pod_uid` name a pod exactly.
A target that matches no container, or more than one, is refused for every action (an
alert named `container_id: "9"` once froze a bystander whose id began with 9).
`RepeatGate` folds identical alert actions repeated within a window into one.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass

from gpuwatch.core.model import ContainerIdentity
from gpuwatch.policy.evaluate import Decision, SafetyContext, Verb
from gpuwatch.policy.match import is_host_root, select_rule
from gpuwatch.policy.rules import ActionKind, Policy

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


MIN_ID_PREFIX = 12  # the short id `docker ps` and crictl show
NO_TARGET = "no container"
AMBIGUOUS_TARGET = "ambiguous target"
_RUNTIME_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*://")
_HEX = re.compile(r"[0-9a-f]+")


def normalize_container_id(value: str) -> str:
    """``containerd://ABC...`` -> ``abc...``: the runtime scheme dropped, lower case."""
    return _RUNTIME_SCHEME.sub("", value.strip()).lower()


def _id_matches(identity: ContainerIdentity, wanted: str) -> bool:
    have = identity.container_id.lower()
    if not have or not wanted:
        return False
    if have == wanted:
        return True
    return len(wanted) >= MIN_ID_PREFIX and bool(_HEX.fullmatch(wanted)) and have.startswith(wanted)


def find_target(identities: Iterable[ContainerIdentity], target: Mapping[str, str]) -> list[ContainerIdentity]:
    """The containers `target` names exactly (every given label must match)."""
    wanted_id = normalize_container_id(target.get("container_id", ""))
    found = []
    for identity in identities:
        if target.get("container_id") and not _id_matches(identity, wanted_id):
            continue
        if target.get("namespace") and identity.pod_namespace != target["namespace"]:
            continue
        if target.get("pod") and identity.pod_name != target["pod"]:
            continue
        if target.get("pod_uid") and identity.pod_uid != target["pod_uid"]:
            continue
        if target.get("container") and identity.container_name != target["container"]:
            continue
        found.append(identity)
    return found


class RepeatGate:
    """Identical alert actions (same action, state, alert and target container) within
    `window_s` of the first are acted on and audited once: `admit(key)` is True for the
    first, False for the repeats (counted). `expired()` hands back, once, the keys whose
    window has ended with repeats, and their counts, for one audit record each."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 4096) -> None:
        self.window_s = window_s
        self._clock = clock
        self._max_keys = max_keys
        self._seen: dict[Hashable, tuple[float, int, object]] = {}  # key -> (first, repeats, payload)
        self._lock = threading.Lock()
        self.repeats_total = 0

    def admit(self, key: Hashable, payload: object = None) -> bool:
        now = self._clock()
        with self._lock:
            entry = self._seen.get(key)
            if entry is not None and now - entry[0] < self.window_s:
                self._seen[key] = (entry[0], entry[1] + 1, entry[2])
                self.repeats_total += 1
                return False
            if len(self._seen) >= self._max_keys:
                self._seen.pop(next(iter(self._seen)))
            self._seen[key] = (now, 0, payload)
            return True

    def expired(self) -> list[tuple[Hashable, int, object]]:
        """(key, repeats, payload) of windows that ended with repeats; each reported once."""
        now = self._clock()
        done = []
        with self._lock:
            for key, (first, repeats, payload) in list(self._seen.items()):
                if now - first >= self.window_s:
                    del self._seen[key]
                    if repeats:
                        done.append((key, repeats, payload))
        return done


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
        return WebhookVerdict(None, f"{NO_TARGET} in the latest snapshot matches {dict(target)} "
                                    f"(a full container id or >= {MIN_ID_PREFIX} hex characters of it, or "
                                    "namespace and pod)")
    if len(matches) > 1:
        return WebhookVerdict(None, f"{AMBIGUOUS_TARGET}: {len(matches)} containers match {dict(target)}; "
                                    "name one container")
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
