"""The enforcer's side of the webhook: one authenticated alert request becomes at most one
decision (requests.decide_webhook, with the policy's safety rules), identical repeats within
a minute are acted on once (audited with their count when the window ends), and disruptive
actions are rate limited by the policy's `tuning.max_actions_per_minute`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from gpuwatch.core.model import ContainerIdentity
from gpuwatch.enforce.actions import ActionResult
from gpuwatch.enforce.audit import AuditLog
from gpuwatch.enforce.webhook.receiver import WebhookRequest
from gpuwatch.enforce.webhook.requests import RepeatGate, decide_webhook
from gpuwatch.policy.evaluate import Decision, SafetyContext
from gpuwatch.policy.rules import Policy

log = logging.getLogger(__name__)
RATE_WINDOW_S = 60.0


class WebhookIntake:
    """Per enforcer: the repeat gate and the times of the disruptive actions of the last minute."""

    def __init__(self, audit: AuditLog, safety: SafetyContext, dry_run: bool = False) -> None:
        self.audit = audit
        self.safety = safety
        self.dry_run = dry_run
        self.repeats = RepeatGate()  # identical alert actions within a minute: acted on once
        self._action_times: list[float] = []

    def handle(self, request: WebhookRequest, policy: Policy, identities: Iterable[ContainerIdentity],
               carry_out: Callable[[Decision], ActionResult]) -> str:
        """Decide, act through `carry_out` (which audits), and say what happened."""
        verdict = decide_webhook(policy, identities, self.safety, str(request.action), bool(request.firing),
                                 str(request.alert_name), request.target_dict())
        if verdict.decision is None:
            log.warning("webhook %s: %s", request.alert_name, verdict.reason)
            return f"ignored: {verdict.reason}"
        decision = verdict.decision
        self._audit_repeats()
        key = (decision.verb, bool(request.firing), decision.rule, decision.target.key)
        if not self.repeats.admit(key, decision):
            return f"duplicate: {request.alert_name} {decision.verb.value} on {decision.target.key} was " \
                   f"handled less than {self.repeats.window_s:.0f} s ago"
        now = time.monotonic()
        self._action_times = [t for t in self._action_times if now - t < RATE_WINDOW_S]
        if decision.verb.disruptive and not decision.suppressed:
            if len(self._action_times) >= policy.tuning.max_actions_per_minute:
                decision = replace(decision, suppressed="rate limit: too many webhook actions this minute")
            else:
                self._action_times.append(now)
        result = carry_out(decision)
        return f"{result.status.value}: {result.detail}"

    def _audit_repeats(self) -> None:
        """One audit record per alert action whose repeats were folded, with their count."""
        for _, repeats, payload in self.repeats.expired():
            if isinstance(payload, Decision):
                self.audit.record_event(
                    payload.target, event="webhook-repeats", rule=payload.rule, scope=payload.scope,
                    reason=f"{repeats} identical alert action(s) within {self.repeats.window_s:.0f} s "
                           "after this one were not acted on again", action=payload.verb.value,
                    result="deduplicated", measured={"repeats": float(repeats)}, dry_run=self.dry_run)
