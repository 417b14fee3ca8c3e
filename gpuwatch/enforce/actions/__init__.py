"""Enforcement actions, one small module each, behind the `Action` protocol."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatch.enforce.actions.alert import AlertAction
from gpuwatch.enforce.actions.base import Action, ActionResult, Completion, Status
from gpuwatch.enforce.actions.checkpoint import CheckpointKillAction
from gpuwatch.enforce.actions.kill import KillAction
from gpuwatch.enforce.actions.pause import PauseAction, ReleaseAction
from gpuwatch.enforce.actions.throttle import ThrottleAction
from gpuwatch.enforce.control import FreezeControl
from gpuwatch.policy.decisions import Verb

__all__ = ["Action", "ActionResult", "ActionSet", "Completion", "Status", "build_actions"]


@dataclass
class ActionSet:
    """The action per verb plus the shared freeze control (for close/metrics)."""

    by_verb: dict[Verb, Action]
    control: FreezeControl
    checkpoint: CheckpointKillAction

    def close(self) -> list[str]:
        """Finish checkpoints, stop throttles, thaw everything; returns paths thawed."""
        self.checkpoint.close()
        return self.control.close()


def build_actions(control: FreezeControl, on_complete: Completion | None = None) -> ActionSet:
    checkpoint = CheckpointKillAction(control, on_complete)
    actions: list[Action] = [
        AlertAction(),
        PauseAction(control),
        ReleaseAction(control),
        ThrottleAction(control),
        KillAction(control),
        checkpoint,
    ]
    return ActionSet({a.verb: a for a in actions}, control, checkpoint)
