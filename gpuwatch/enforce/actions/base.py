"""The one protocol every enforcement action implements, and its result type."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gpuwatch.policy.decisions import Decision, Verb


class Status(StrEnum):
    OK = "ok"
    STARTED = "started"
    """Asynchronous action under way (checkpoint grace period); a final result follows."""
    FAILED = "failed"
    GONE = "gone"
    """The target cgroup no longer exists."""
    DRY_RUN = "dry_run"
    SUPPRESSED = "suppressed"


@dataclass(frozen=True)
class ActionResult:
    status: Status
    detail: str = ""
    duration_s: float = 0.0


Completion = Callable[[Decision, ActionResult], None]
"""Called with the final result of an asynchronous action (for audit and metrics)."""


class Action(Protocol):
    """Carries out decisions of one verb. Must not block for long (use a thread)."""

    verb: Verb

    def apply(self, decision: Decision) -> ActionResult: ...
