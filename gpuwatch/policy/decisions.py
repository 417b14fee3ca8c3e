"""What evaluation decides: the verbs, one Decision per thing to do, and the safety context
every disruptive decision is checked against (pure types, no I/O).

Evaluation (policy/evaluate.py and the modules it calls: arbitration.py for GPU memory,
elastic.py for GPU time) produces Decisions; the enforcer (enforce/) carries them out and
audits each one, suppressed and dry-run ones included.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from enum import StrEnum

from gpuwatch.core.model import ContainerIdentity
from gpuwatch.policy.match import is_host_root


class Verb(StrEnum):
    ALERT = "alert"
    THROTTLE = "throttle"
    PAUSE = "pause"
    CHECKPOINT_KILL = "checkpoint-then-kill"
    KILL = "kill"
    RELEASE = "release"
    """Undo throttle/pause (thaw) and, with continue_stopped, SIGCONT stopped processes."""
    DENY_DEVICE = "deny-device"
    """Device gate: the target may no longer open some GPUs (another container holds them
    exclusively; enforce/enforcer.py audits these, the evaluator never emits them)."""
    ALLOW_DEVICE = "allow-device"
    """Device gate: a GPU denied for exclusivity may be opened again."""

    @property
    def disruptive(self) -> bool:
        return self not in (Verb.ALERT, Verb.RELEASE, Verb.ALLOW_DEVICE)


@dataclass(frozen=True)
class Decision:
    """One thing the enforcer should do (or record, when `suppressed` is set)."""

    verb: Verb
    target: ContainerIdentity
    rule: str
    scope: str
    """"container", "namespace", "deadlock", "fair_share", "rescheduling", "elastic" or "sharing"."""
    reason: str
    measured: tuple[tuple[str, float], ...] = ()
    step_index: int = -1
    share: float | None = None
    signal: int = int(signal.SIGUSR1)
    grace_s: float = 0.0
    continue_stopped: bool = False
    suppressed: str = ""
    period_s: float | None = None
    """Throttle only: the freeze/thaw period (None: the enforcer's default)."""

    @property
    def key(self) -> str:
        return self.target.key


@dataclass(frozen=True)
class SafetyContext:
    """What must never be touched besides the host root: the agent's own cgroup paths."""

    own_cgroup_paths: frozenset[str] = frozenset()

    def unsafe_reason(self, identity: ContainerIdentity) -> str:
        if is_host_root(identity):
            return "safety: the host root cgroup is never acted on"
        path = identity.cgroup_path.rstrip("/")
        for own in self.own_cgroup_paths:
            own = own.rstrip("/")
            if own and (own == path or own.startswith(path + "/")):
                return f"safety: {identity.cgroup_path} contains the agent itself"
        return ""
