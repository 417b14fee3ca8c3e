"""Pause (freeze the whole cgroup) and release (thaw, stop throttling, optionally SIGCONT)."""

from __future__ import annotations

import signal

from gpuwatch.core.errors import EnforcementError
from gpuwatch.enforce.actions.base import ActionResult, Status
from gpuwatch.enforce.control import FreezeControl
from gpuwatch.policy.decisions import Decision, Verb


class PauseAction:
    verb = Verb.PAUSE

    def __init__(self, control: FreezeControl) -> None:
        self.control = control

    def apply(self, decision: Decision) -> ActionResult:
        path = decision.target.cgroup_path
        if not self.control.cgroups.handle(path).exists():
            return ActionResult(Status.GONE, f"{path} no longer exists")
        try:
            mechanism = self.control.pause(path, f"{decision.rule}: {decision.reason}")
        except EnforcementError as err:
            return ActionResult(Status.FAILED, str(err))
        return ActionResult(Status.OK, f"frozen via {mechanism}")


class ReleaseAction:
    verb = Verb.RELEASE

    def __init__(self, control: FreezeControl) -> None:
        self.control = control

    def apply(self, decision: Decision) -> ActionResult:
        path = decision.target.cgroup_path
        handle = self.control.cgroups.handle(path)
        try:
            held = self.control.release(path)
        except EnforcementError as err:
            return ActionResult(Status.FAILED, str(err))
        if not handle.exists():
            return ActionResult(Status.GONE, f"{path} no longer exists")
        detail = "thawed" if held else "nothing was held"
        if decision.continue_stopped:
            reached = handle.signal_all(signal.SIGCONT)
            detail += f"; SIGCONT to {len(reached)} process(es)"
        return ActionResult(Status.OK, detail)
