"""The action-ladder state machine for one target (pure).

Each step holds while usage/limit stays at or above its `at` (and, once holding, above
`at - hysteresis`). A step is *due* when it has held for its `for` time. The highest due
step is taken once (escalation); an alert is repeated at most every `repeat`. A reversible
step (throttle, pause) is released only after it stopped holding for `release_after` and
was in force for at least `min_hold`, so nothing flaps. A terminal step (kill) ends it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from gpuwatch.policy.rules import ActionKind, ActionStep, Tuning


class LadderMove(StrEnum):
    NONE = "none"
    ESCALATE = "escalate"
    REPEAT_ALERT = "repeat_alert"
    RELEASE = "release"


@dataclass(frozen=True)
class LadderState:
    held_since: tuple[float | None, ...]
    active_step: int = -1
    active_since_s: float = 0.0
    clear_since_s: float | None = None
    last_alert_s: float | None = None
    terminated: bool = False

    @staticmethod
    def fresh(steps: int) -> LadderState:
        return LadderState(held_since=(None,) * steps)


@dataclass(frozen=True)
class LadderResult:
    state: LadderState
    move: LadderMove
    step_index: int
    """The step taken (ESCALATE/REPEAT_ALERT) or released (RELEASE); -1 otherwise."""
    held_for_s: float = 0.0


def advance(
    state: LadderState,
    steps: Sequence[ActionStep],
    ratios: Sequence[float | None],
    timestamp_s: float,
    tuning: Tuning,
) -> LadderResult:
    """One evaluation tick. `ratios[i]` is the usage/limit ratio step i watches."""
    if len(state.held_since) != len(steps):
        state = LadderState.fresh(len(steps))
    held: list[float | None] = []
    for step, ratio, since in zip(steps, ratios, state.held_since, strict=True):
        if ratio is None:
            held.append(None)
        elif since is None:
            held.append(timestamp_s if ratio >= step.at_ratio else None)
        else:
            held.append(since if ratio >= step.at_ratio - tuning.hysteresis_ratio else None)
    new = replace(state, held_since=tuple(held))
    if state.terminated:
        return LadderResult(new, LadderMove.NONE, -1)
    due = [i for i, since in enumerate(held) if since is not None and timestamp_s - since >= steps[i].for_s]
    top = max(due) if due else -1
    active = state.active_step
    if top > active:
        since = held[top] or timestamp_s
        new = replace(
            new,
            active_step=top,
            active_since_s=timestamp_s,
            clear_since_s=None,
            terminated=steps[top].kind.terminal,
            last_alert_s=timestamp_s if steps[top].kind is ActionKind.ALERT else new.last_alert_s,
        )
        return LadderResult(new, LadderMove.ESCALATE, top, timestamp_s - since)
    if active < 0:
        return LadderResult(new, LadderMove.NONE, -1)
    step = steps[active]
    if top == active:
        new = replace(new, clear_since_s=None)
        last = state.last_alert_s
        if step.kind is ActionKind.ALERT and (last is None or timestamp_s - last >= step.repeat_s):
            return LadderResult(replace(new, last_alert_s=timestamp_s), LadderMove.REPEAT_ALERT, active)
        return LadderResult(new, LadderMove.NONE, -1)
    # top < active: the active step no longer holds (or is no longer due).
    if not step.kind.reversible:
        return LadderResult(replace(new, active_step=top, clear_since_s=None), LadderMove.NONE, -1)
    clear_since = state.clear_since_s if state.clear_since_s is not None else timestamp_s
    new = replace(new, clear_since_s=clear_since)
    if timestamp_s - clear_since >= tuning.release_after_s and timestamp_s - state.active_since_s >= tuning.min_hold_s:
        return LadderResult(replace(new, active_step=-1, clear_since_s=None), LadderMove.RELEASE, active)
    return LadderResult(new, LadderMove.NONE, -1)


def undo_escalation(before: LadderState, after: LadderState) -> LadderState:
    """Keep the step-holding bookkeeping but forget an escalation that was not carried out
    (rate-limited), so it is tried again on the next tick."""
    return replace(
        after,
        active_step=before.active_step,
        active_since_s=before.active_since_s,
        clear_since_s=before.clear_since_s,
        terminated=before.terminated,
    )
