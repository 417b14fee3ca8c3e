"""Why each container runs as it does: the enforcer's per-container view after a snapshot.

State (running, throttled, paused, waiting-memory, checkpointing), the reason and rule behind
it, its memory limit and fair share, its time share and the elastic controller's view --
what `gpuwatch top` shows in STATE/SHARE and the agent serves in /snapshot.json, and the
enforcer's limit/paused/throttled metrics.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuwatch.core.model import ContainerEnforcement, ContainerIdentity
from gpuwatch.enforce.actions import ActionResult, ActionSet, Status
from gpuwatch.enforce.metrics import EnforcerMetrics, TargetLimits
from gpuwatch.policy.evaluate import Decision, EvaluationResult, Verb


class EnforcementView:
    """The holds carried out per container and the view built from them each snapshot."""

    def __init__(self, actions: ActionSet, dry_run: bool = False) -> None:
        self.actions = actions
        self.dry_run = dry_run
        self.holds: dict[str, Decision] = {}
        """Key -> the last throttle/pause/checkpoint decision carried out (or recorded in a dry run)."""
        self.current: tuple[ContainerEnforcement, ...] = ()

    def remember(self, decision: Decision, result: ActionResult) -> None:
        """What holds each container now (top shows why a job is slow)."""
        if result.status not in (Status.OK, Status.STARTED, Status.DRY_RUN):
            return
        if decision.verb is Verb.RELEASE:
            self.holds.pop(decision.key, None)
        elif decision.verb in (Verb.THROTTLE, Verb.PAUSE, Verb.CHECKPOINT_KILL, Verb.KILL):
            self.holds[decision.key] = decision

    def update(self, result: EvaluationResult, identities: Mapping[str, ContainerIdentity],
               suspended: frozenset[str], metrics: EnforcerMetrics) -> tuple[ContainerEnforcement, ...]:
        """Rebuild the view and the enforcer's limit/paused/throttled/sharing-view metrics."""
        limits = [TargetLimits(identities[key], result.rules_by_target.get(key, ""), result.memory_limit_bytes(key),
                               measured.gpu_time_limit)
                  for key, measured in result.measurements.items() if key in identities]
        by_path = {i.cgroup_path: i for i in identities.values()}
        control = self.actions.control
        paused = tuple(by_path.get(p, ContainerIdentity("unknown", p)) for p in sorted(control.paused()))
        throttled = tuple(
            (by_path.get(p, ContainerIdentity("unknown", p)), t.target_share, t.measured_share)
            for p, t in sorted(control.throttled().items())
        )
        metrics.set_view(tuple(limits), paused, throttled)
        self.current = self._build(result, identities, suspended)
        metrics.set_sharing_view(self.current)
        return self.current

    def _build(self, result: EvaluationResult, identities: Mapping[str, ContainerIdentity],
               suspended: frozenset[str]) -> tuple[ContainerEnforcement, ...]:
        control = self.actions.control
        paused = control.paused()
        throttles = control.throttled()
        checkpointing = self.actions.checkpoint.in_progress()
        waiting = result.state.memory.waiting
        now = result.state.last_snapshot_s or 0.0
        out = []
        for key, identity in sorted(identities.items()):
            memory = result.memory_status.get(key, ())
            elastic = result.elastic_status.get(key)
            hold = self.holds.get(key)
            path = identity.cgroup_path
            throttle = throttles.get(path)
            waited = now - waiting[key].since_s if key in waiting else None
            share = throttle.target_share if throttle is not None and throttle.running else None
            if self.dry_run and hold is not None and hold.verb is Verb.THROTTLE:
                share = hold.share
            if path in checkpointing or (hold is not None and hold.verb in (Verb.CHECKPOINT_KILL, Verb.KILL)):
                state = "checkpointing"
            elif key in waiting:
                state = "waiting-memory"
            elif path in paused or (self.dry_run and hold is not None and hold.verb is Verb.PAUSE):
                state = "paused"
            elif share is not None:
                state = "throttled"
            else:
                state = "running"
            reason = hold.reason if hold is not None and state != "running" else ""
            if self.dry_run and reason:
                reason = f"dry run, not done: {reason}"
            if not reason and key in suspended:
                reason = "in-kernel kill/stop suspended: its probe counter exceeds NVML's memory (polling only)"
            out.append(ContainerEnforcement(
                identity=identity,
                state=state,
                reason=reason,
                rule=hold.rule if hold is not None and state != "running" else result.rules_by_target.get(key, ""),
                memory_limit_bytes=result.memory_limit_bytes(key),
                memory_fair_share_bytes=result.fair_shares_bytes.get(key),
                pending_bytes=sum(m.pending_bytes for m in memory),
                waiting_s=round(waited, 3) if waited is not None else None,
                time_share=share,
                measured_share=throttle.measured_share if throttle is not None and throttle.running else None,
                elastic_share=elastic.share if elastic is not None else None,
                elastic_role=elastic.role if elastic is not None else "",
                growth_efficiency=elastic.efficiency if elastic is not None else None,
            ))
        for key in set(self.holds) - set(identities):
            del self.holds[key]
        return tuple(out)
