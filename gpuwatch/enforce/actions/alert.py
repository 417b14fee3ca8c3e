"""Alert only: log the violation (the enforcer also counts it and audits it)."""

from __future__ import annotations

import logging

from gpuwatch.enforce.actions.base import ActionResult, Status
from gpuwatch.policy.decisions import Decision, Verb

log = logging.getLogger("gpuwatch.enforce.alert")


class AlertAction:
    verb = Verb.ALERT

    def apply(self, decision: Decision) -> ActionResult:
        log.warning("ALERT %s [%s]: %s", decision.target.display_name, decision.rule, decision.reason)
        return ActionResult(Status.OK, "logged")
