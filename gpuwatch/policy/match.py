"""Which rule applies to a container, and why (pure; used by evaluation and `explain`).

The first rule in file order whose selector matches wins. A container in a protected
namespace is matched only by a rule that names that namespace literally; the host root
cgroup is never matched. Every decision comes with human-readable reasons.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from gpuwatch.core.model import ContainerIdentity
from gpuwatch.policy.rules import Policy, Rule, Selector


@dataclass(frozen=True)
class RuleCheck:
    """The outcome of testing one rule against one container."""

    rule: Rule
    matched: bool
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class RuleMatch:
    """The rule that applies (or None) and the check of every rule up to it."""

    rule: Rule | None
    checks: tuple[RuleCheck, ...]
    protected: bool

    def explain(self) -> list[str]:
        lines = []
        for check in self.checks:
            verdict = "MATCHES" if check.matched else "no match"
            lines.append(f"rule {check.rule.name!r} (line {check.rule.line}): {verdict}")
            lines.extend(f"    - {reason}" for reason in check.reasons)
        if self.rule is None:
            lines.append("=> no rule applies: this container is not limited")
        else:
            lines.append(f"=> rule {self.rule.name!r} applies (first match in file order)")
        return lines


def is_host_root(identity: ContainerIdentity) -> bool:
    return identity.cgroup_path.strip() in ("", "/")


def _glob(pattern: str, value: str) -> bool:
    return fnmatch.fnmatchcase(value, pattern)


def check_selector(selector: Selector, identity: ContainerIdentity) -> tuple[bool, list[str]]:
    """Does the selector match? Reasons name each field compared (all must match)."""
    if is_host_root(identity):
        return False, ["the host root cgroup is never a target"]
    if selector.default:
        if not identity.is_container:
            return False, [f"default matches containers only; {identity.cgroup_path!r} is not a container"]
        return True, ["default: true matches every container"]
    reasons: list[str] = []
    ok = True
    fields = (
        ("namespace", selector.namespace, identity.pod_namespace),
        ("pod", selector.pod, identity.pod_name),
        ("container", selector.container, identity.container_name),
        ("container_id", selector.container_id, identity.container_id),
        ("cgroup", selector.cgroup, identity.cgroup_path),
    )
    for name, pattern, value in fields:
        if pattern is None:
            continue
        hit = _glob(pattern, value)
        ok &= hit
        reasons.append(f"{name} {value!r} {'matches' if hit else 'does not match'} {pattern!r}")
    labels = dict(identity.labels)
    for key, pattern in selector.labels:
        label_value = labels.get(key)
        hit = label_value is not None and _glob(pattern, label_value)
        ok &= hit
        shown = "is missing" if label_value is None else f"= {label_value!r}"
        reasons.append(f"label {key} {shown} {'matches' if hit else 'does not match'} {pattern!r}")
    return ok, reasons


def select_rule(policy: Policy, identity: ContainerIdentity) -> RuleMatch:
    """The first matching rule; protected namespaces need a rule naming them literally."""
    namespace = identity.pod_namespace
    protected = bool(namespace) and namespace in policy.protected_namespaces
    checks: list[RuleCheck] = []
    for rule in policy.rules:
        matched, reasons = check_selector(rule.selector, identity)
        if matched and protected and not rule.selector.names_namespace_explicitly(namespace):
            matched = False
            reasons.append(
                f"namespace {namespace!r} is protected; only a rule with `namespace: {namespace}` "
                "(written out, no wildcard) may act on it"
            )
        checks.append(RuleCheck(rule, matched, tuple(reasons)))
        if matched:
            return RuleMatch(rule, tuple(checks), protected)
    return RuleMatch(None, tuple(checks), protected)


def namespace_is_targetable(policy: Policy, namespace: str, quota_pattern: str) -> bool:
    """A quota may act on a protected namespace only if it names it literally."""
    if namespace in policy.protected_namespaces:
        return quota_pattern == namespace
    return True
