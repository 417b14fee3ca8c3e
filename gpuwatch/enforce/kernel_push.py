"""The in-kernel memory limit, kept in step with the policy: per cgroup id, the container's
effective limit and what the kernel does at an allocation over it, pushed into the probes'
limit map (KernelLimitTable) when it changes and cleared when the container goes.

Left out, each for its reason: containers the probe-vs-NVML cross-check suspends
(inkernel_guard: the kernel must not act on a counter NVML contradicts), protected ones and
the host (never touched unless a policy names them), and containers whose probe counters
were joined per process (pipeline/probe_join.py: on a hybrid host the v2 cgroup their processes
are counted in is not theirs, maybe shared: a limit there would act on every container in
it; refused, audited once per container). Under fair share with `rescheduling.gate_new`,
containers a rule matches that hold no GPU memory yet get a 0-byte "stop" entry, so their
first allocation waits for admission.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from gpuwatch.core.model import ContainerIdentity, Snapshot
from gpuwatch.enforce.audit import AuditLog
from gpuwatch.enforce.kernel_limits import KernelLimitTable, kernel_action
from gpuwatch.policy.evaluate import EvaluationResult, SafetyContext
from gpuwatch.policy.rules import Policy

log = logging.getLogger(__name__)


class KernelLimitPush:
    """Owns what this agent pushed into the kernel limit map."""

    def __init__(self, table: KernelLimitTable, audit: AuditLog, safety: SafetyContext, dry_run: bool = False,
                 action_override: str | None = None) -> None:
        self.table = table
        self.audit = audit
        self.safety = safety
        self.dry_run = dry_run
        self.action_override = action_override
        """When set, the kernel action for every container (EnforcerConfig.kernel_limit_action)."""
        self.pushed: dict[int, tuple[int, str]] = {}
        self.refused: dict[str, str] = {}
        """Key -> why the in-kernel limit is refused for a limited container (no v2 cgroup of its own)."""

    def push(self, policy: Policy, result: EvaluationResult, identities: Mapping[str, ContainerIdentity],
             snapshot: Snapshot | None, suspended: frozenset[str],
             waiting_for_admission: Iterable[ContainerIdentity] = ()) -> None:
        """Bring the kernel map in line with this evaluation (nothing is written in a dry run)."""
        rules = {r.name: r for r in policy.rules}
        wanted: dict[int, tuple[int, str]] = {}
        refused: dict[str, ContainerIdentity] = {}
        joined = {ident.key for cg, ident in (snapshot.probe_identities if snapshot else ()) if cg < 0}
        for key in set(result.measurements) | set(result.effective_limits_bytes):
            if key in suspended:
                continue
            identity = identities.get(key)
            limit = result.memory_limit_bytes(key)
            if identity is None or limit is None or self.safety.unsafe_reason(identity):
                continue
            if identity.cgroup_id is None or key in joined:
                if key in joined:
                    refused[key] = identity
                continue
            rule = rules.get(result.rules_by_target.get(key, ""))
            action = self.action_override or kernel_action(rule, key in result.effective_limits_bytes)
            wanted[identity.cgroup_id] = (limit, action)
        for identity in waiting_for_admission:
            if identity.cgroup_id is not None and identity.cgroup_id not in wanted:
                wanted[identity.cgroup_id] = (0, "stop")  # its first allocation waits for admission
        if not self.dry_run:
            for cgroup_id, (limit, action) in wanted.items():
                if self.pushed.get(cgroup_id) != (limit, action):
                    self.table.set_limit(cgroup_id, limit, action)
            for cgroup_id in set(self.pushed) - set(wanted):
                self.table.clear_limit(cgroup_id)
        self.pushed = wanted
        self._refuse(refused, result)

    def _refuse(self, refused: dict[str, ContainerIdentity], result: EvaluationResult) -> None:
        """Audit (once per container) each limited container the kernel limit cannot key."""
        for key, identity in refused.items():
            if key in self.refused:
                continue
            reason = (f"in-kernel limit refused: {identity.cgroup_path!r} is not the cgroup v2 its processes "
                      "are in (a v1 controller names this container on a hybrid host); the kernel counts them "
                      "in another v2 cgroup, possibly shared with other containers, so a kernel kill/stop "
                      "there could hit those")
            self.refused[key] = reason
            log.warning("%s: %s", identity.display_name, reason)
            self.audit.record_event(
                identity, event="inkernel", rule=result.rules_by_target.get(key, ""), scope="container",
                reason=reason, action="refuse-inkernel", result="refused",
                detail="polling enforcement on NVML numbers applies; probe bytes are joined per process",
                dry_run=self.dry_run)
        for key in set(self.refused) - set(refused):
            del self.refused[key]
