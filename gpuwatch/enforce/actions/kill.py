"""Kill every process of the container at once (`cgroup.kill`, or freeze + SIGKILL)."""

from __future__ import annotations

import time

from gpuwatch.core.errors import EnforcementError
from gpuwatch.enforce.actions.base import ActionResult, Status
from gpuwatch.enforce.control import FreezeControl
from gpuwatch.policy.decisions import Decision, Verb


class KillAction:
    verb = Verb.KILL

    def __init__(self, control: FreezeControl) -> None:
        self.control = control

    def apply(self, decision: Decision) -> ActionResult:
        started = time.monotonic()
        handle = self.control.cgroups.handle(decision.target.cgroup_path)
        if not handle.exists():
            return ActionResult(Status.GONE, f"{handle.cgroup_path} no longer exists")
        try:
            self.control.forget(handle.cgroup_path)
            how = handle.kill()
        except EnforcementError as err:
            return ActionResult(Status.FAILED, str(err))
        empty = handle.wait_empty(2.0)
        return ActionResult(
            Status.OK if empty else Status.FAILED,
            f"killed via {how}" + ("" if empty else "; processes remain"),
            time.monotonic() - started,
        )
