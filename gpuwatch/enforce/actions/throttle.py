"""Throttle to a GPU-time share with a closed-loop freeze/thaw duty cycle (see throttle.py)."""

from __future__ import annotations

from gpuwatch.core.errors import EnforcementError
from gpuwatch.enforce.actions.base import ActionResult, Status
from gpuwatch.enforce.control import FreezeControl
from gpuwatch.policy.decisions import Decision, Verb


class ThrottleAction:
    verb = Verb.THROTTLE

    def __init__(self, control: FreezeControl) -> None:
        self.control = control

    def apply(self, decision: Decision) -> ActionResult:
        path = decision.target.cgroup_path
        if decision.share is None:
            return ActionResult(Status.FAILED, "no target share in the decision")
        if not self.control.cgroups.handle(path).exists():
            return ActionResult(Status.GONE, f"{path} no longer exists")
        share = min(decision.share, 1.0)
        try:
            how = self.control.throttle(decision.key, path, share, f"{decision.rule}: {decision.reason}",
                                        period_s=decision.period_s)
        except EnforcementError as err:
            return ActionResult(Status.FAILED, str(err))
        return ActionResult(Status.OK, f"throttled to {share:.0%} ({how})")
