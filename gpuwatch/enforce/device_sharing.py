"""Carrying out the sharing annotations and the rules' device limits on the node.

* device gate: per cgroup id, the rule's `limits.devices` minus every GPU another container
  holds with `gpuwatch.io/sharing: exclusive` (lifted when the holder is gone); changes are
  pushed to the DeviceGate and each one audited (rule "sharing");
* `gpuwatch.io/sharing: shared` + `gpuwatch.io/gpu-share: x`: a closed-loop throttle at x on
  the container while it is in the snapshot, unless its rule has a throttle step (the rule
  decides alone) or the policy/webhook holds a throttle or pause on it (that wins while it
  holds);
* the sharing metrics: namespace memory quotas of the namespaces present, gated containers
  per exclusively held GPU.

A dry run audits what would be done and does nothing. The pure decisions are in
policy/sharing.py; the ledger of what was done is sharing_hooks.SharingLedger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from gpuwatch.core.annotations import format_share
from gpuwatch.core.errors import EnforcementError
from gpuwatch.core.model import ContainerIdentity, Snapshot
from gpuwatch.enforce.actions import ActionResult, Status
from gpuwatch.enforce.control import FreezeControl
from gpuwatch.enforce.kernel_limits import DeviceGate
from gpuwatch.enforce.metrics import EnforcerMetrics
from gpuwatch.enforce.sharing_hooks import SHARING_RULE, NodeListing, SharingLedger
from gpuwatch.policy.evaluate import VANISHED_INTERVALS, Decision, EvaluationResult, SafetyContext, Verb
from gpuwatch.policy.match import select_rule
from gpuwatch.policy.rules import ActionKind, Policy
from gpuwatch.policy.sharing import (
    ExclusivePlan,
    allowed_without,
    exclusive_holders,
    gate_exemption,
    gpu_users,
    is_glob,
    namespace_memory_quotas,
    plan_exclusive,
    sharing_of,
)

log = logging.getLogger(__name__)
Record = Callable[[Decision, ActionResult], None]
CarryOut = Callable[[Decision], ActionResult]


def sharing_decision(verb: Verb, identity: ContainerIdentity, reason: str, gpus: tuple[int, ...] = (),
                     share: float | None = None, suppressed: str = "") -> Decision:
    measured = tuple((f"gpu{g}", 1.0) for g in gpus)
    if share is not None:
        measured += (("gpu_share", share),)
    return Decision(verb, identity, SHARING_RULE, "sharing", reason, measured=measured, share=share,
                    suppressed=suppressed)


def share_reason(share: float) -> str:
    return f"gpuwatch.io/sharing: shared, gpuwatch.io/gpu-share: {format_share(share)}"


class DeviceSharing:
    """The device gate and the annotation throttles of one enforcer."""

    def __init__(self, gate: DeviceGate, listing: NodeListing, safety: SafetyContext, record: Record,
                 dry_run: bool = False) -> None:
        self.gate = gate
        self.listing = listing
        self.safety = safety
        self.record = record
        self.dry_run = dry_run
        self.ledger = SharingLedger()
        self.pushed_devices: dict[int, tuple[int, ...]] = {}
        self.last_exclusive = ExclusivePlan()

    @property
    def gate_enforces(self) -> bool:
        return bool(getattr(self.gate, "enforcing", True))

    # -- the device gate ----------------------------------------------------------------
    def push_devices(self, policy: Policy, result: EvaluationResult, identities: Mapping[str, ContainerIdentity],
                     snapshot: Snapshot | None) -> None:
        """Device gate per cgroup id: the rule's `limits.devices`, minus GPUs another
        container holds exclusively; changes pushed to the gate (not in a dry run)."""
        devices: dict[int, tuple[int, ...]] = {}
        for key, rule_name in result.rules_by_target.items():
            identity = identities.get(key)
            rule = next((r for r in policy.rules if r.name == rule_name), None)
            if identity is None or identity.cgroup_id is None or rule is None or rule.limits.devices is None:
                continue
            if not self.safety.unsafe_reason(identity):
                devices[identity.cgroup_id] = rule.limits.devices
        plan = self._plan_exclusive(policy, snapshot)
        for key, gpus in plan.denied.items():
            cgroup_id = plan.identities[key].cgroup_id
            if cgroup_id is not None:
                devices[cgroup_id] = allowed_without(devices.get(cgroup_id), gpus)
        refused: set[int] = set()
        if not self.dry_run:
            pushed: dict[int, tuple[int, ...]] = {}
            for cgroup_id, allowed in devices.items():
                if self.pushed_devices.get(cgroup_id) != allowed:
                    try:
                        self.gate.allow_only(cgroup_id, allowed)
                    except EnforcementError as err:  # retried next snapshot; the old gate stays
                        log.warning("device isolation of cgroup %d not applied: %s", cgroup_id, err)
                        refused.add(cgroup_id)
                        if cgroup_id in self.pushed_devices:
                            pushed[cgroup_id] = self.pushed_devices[cgroup_id]
                        continue
                pushed[cgroup_id] = allowed
            for cgroup_id in set(self.pushed_devices) - set(pushed):
                self.gate.clear(cgroup_id)
            devices = pushed
        self.pushed_devices = devices
        self._audit_exclusive(plan, refused)
        self.last_exclusive = plan

    def _plan_exclusive(self, policy: Policy, snapshot: Snapshot | None) -> ExclusivePlan:
        if snapshot is None:
            return ExclusivePlan()
        holders = exclusive_holders(gpu_users(snapshot))
        if not holders:
            return ExclusivePlan()
        if not self.dry_run and not self.gate_enforces:
            gpu, found = min(holders.items())
            self.ledger.say_once(
                "no-gate",
                "GPU %d is used by %s (gpuwatch.io/sharing: exclusive) but nothing keeps other containers "
                "off it: no BPF device gate (the agent needs root and its kernel probes); exclusive use "
                "is exported, not enforced",
                gpu,
                ", ".join(i.display_name for i in found.values()),
            )
        if self.listing.source is None:
            self.ledger.say_once(
                "no-listing",
                "exclusive GPU use: only containers seen using a GPU are kept off a held GPU "
                "(no node container listing wired)",
            )
        return plan_exclusive(policy, snapshot, self.listing.get(now=True), self.safety.unsafe_reason)

    def _audit_exclusive(self, plan: ExclusivePlan, refused: set[int]) -> None:
        """One audit record per container whose exclusive denials changed (deny-device /
        allow-device), per suppressed (protected, host) one and per refusal of the gate."""
        ledger = self.ledger
        if not self.dry_run and not self.gate_enforces:
            ledger.denied.clear()  # nothing was done, so nothing to audit or lift
            return
        for key in sorted(set(plan.denied) | set(ledger.denied)):
            before = ledger.denied.get(key, ())
            after = plan.denied.get(key, ())
            if before == after:
                continue
            identity = plan.identities.get(key) or ledger.identities[key]
            if identity.cgroup_id in refused:
                if ledger.failed.get(key) != after:
                    ledger.failed[key] = after
                    reason = f"keep off GPU {', '.join(map(str, after))} (held exclusively)"
                    self.record(sharing_decision(Verb.DENY_DEVICE, identity, reason, after),
                                ActionResult(Status.FAILED, "the device gate refused; retried every snapshot"))
                continue
            ledger.failed.pop(key, None)
            added = tuple(g for g in after if g not in before)
            lifted = tuple(g for g in before if g not in after)
            done = ActionResult(Status.DRY_RUN, "dry run: nothing done") if self.dry_run else None
            if added:
                reason = "; ".join(f"GPU {g} is held exclusively by {plan.holder_names(g)}" for g in added)
                self.record(sharing_decision(Verb.DENY_DEVICE, identity, reason, added),
                            done or ActionResult(Status.OK, f"may not open GPU {', '.join(map(str, added))}"))
            if lifted:
                gone = key not in plan.identities and bool(plan.holders)
                reason = "container left the node" if gone else "; ".join(
                    f"GPU {g} is no longer held exclusively" for g in lifted)
                result = done or (ActionResult(Status.GONE, "gate lifted") if gone else
                                  ActionResult(Status.OK, f"may open GPU {', '.join(map(str, lifted))} again"))
                self.record(sharing_decision(Verb.ALLOW_DEVICE, identity, reason, lifted), result)
            if after:
                ledger.denied[key] = after
                ledger.identities[key] = identity
            else:
                ledger.denied.pop(key, None)
                ledger.identities.pop(key, None)
        for key in set(ledger.failed) - set(plan.denied):
            ledger.failed.pop(key)
        for key, why in plan.exempt.items():
            gpus = tuple(sorted(g for g, held in plan.holders.items() if key not in held))
            if ledger.suppressed.get(key) == gpus or not plan.identities[key].is_container:
                continue  # (the host's processes are never a target: nothing to record)
            ledger.suppressed[key] = gpus
            reason = "; ".join(f"GPU {g} is held exclusively by {plan.holder_names(g)}" for g in gpus)
            self.record(sharing_decision(Verb.DENY_DEVICE, plan.identities[key], reason, gpus, suppressed=why),
                        ActionResult(Status.SUPPRESSED, why))
        for key in set(ledger.suppressed) - set(plan.exempt):
            ledger.suppressed.pop(key)

    # -- gpu-share throttles --------------------------------------------------------------
    def throttles(self, policy: Policy, result: EvaluationResult, identities: Mapping[str, ContainerIdentity],
                  snapshot: Snapshot, now: float, control: FreezeControl, carry_out: CarryOut) -> None:
        """`gpuwatch.io/sharing: shared` + `gpuwatch.io/gpu-share: x`: keep a throttle at x on
        the container while it is in the snapshot. A rule with a throttle step decides alone;
        a throttle/pause the policy (or the webhook) holds on it wins while it holds."""
        ledger = self.ledger
        held = set(result.state.reversible_active)
        throttled = control.throttled()
        paused = control.paused()
        wanted: dict[str, tuple[ContainerIdentity, float]] = {}
        for key, identity in identities.items():
            share = sharing_of(identity).throttle_share
            if share is None:
                continue
            ledger.last_seen_s[key] = now
            rule = select_rule(policy, identity).rule
            if rule is not None and any(step.kind is ActionKind.THROTTLE for step in rule.actions):
                continue  # the rule's own throttle step wins (SCHEMA.md: sharing modes)
            why = gate_exemption(policy, identity, self.safety.unsafe_reason(identity), need_cgroup_id=False)
            if why:
                if ledger.throttle_failed.get(key) != share:
                    ledger.throttle_failed[key] = share
                    self.record(sharing_decision(Verb.THROTTLE, identity, share_reason(share), share=share,
                                                 suppressed=why),
                                ActionResult(Status.SUPPRESSED, why))
                continue
            wanted[key] = (identity, share)
        for key, (identity, share) in wanted.items():
            if key in held or identity.cgroup_path in paused or ledger.throttle_failed.get(key) == share:
                continue
            running = throttled.get(identity.cgroup_path)
            if not self.dry_run and running is not None and running.running:
                continue  # ours, or one the policy/webhook started (it wins while it runs)
            if self.dry_run and ledger.throttles.get(key) == share:
                continue
            outcome = carry_out(sharing_decision(Verb.THROTTLE, identity, share_reason(share), share=share))
            if outcome.status in (Status.OK, Status.DRY_RUN):
                ledger.throttles[key] = share
                ledger.throttle_identities[key] = identity
            else:
                ledger.throttle_failed[key] = share  # audited once; tried again if it comes back
        grace = VANISHED_INTERVALS * max(snapshot.interval_s, 0.0)
        for key in list(ledger.throttles):
            if key in wanted and key in identities:
                continue
            if key not in identities and now - ledger.last_seen_s.get(key, now) < grace:
                continue
            identity = ledger.throttle_identities.pop(key)
            del ledger.throttles[key]
            if key in held:
                continue  # the policy holds it now; its release thaws it
            reason = "left the snapshot" if key not in identities else "the policy's rule now throttles it"
            carry_out(sharing_decision(Verb.RELEASE, identity, f"gpu-share throttle ends: {reason}"))
        for key in list(ledger.throttle_failed):
            if key not in identities:
                del ledger.throttle_failed[key]
        for key in list(ledger.last_seen_s):
            if key not in ledger.throttles and key not in identities:
                del ledger.last_seen_s[key]

    # -- metrics ------------------------------------------------------------------------
    def export(self, metrics: EnforcerMetrics, policy: Policy, identities: Mapping[str, ContainerIdentity],
               snapshot: Snapshot) -> None:
        """Namespace memory quotas of the namespaces present (the snapshot's, the probes', the
        node listing's for glob quotas) and gated containers per exclusively held GPU."""
        names = {i.pod_namespace for i in identities.values()}
        names |= {i.pod_namespace for _, i in snapshot.probe_identities}
        if any(is_glob(q.namespace) for q in policy.namespace_quotas):
            names |= {i.pod_namespace for i in self.listing.get(now=False)}
        quotas = namespace_memory_quotas(policy, sorted(n for n in names if n))
        gated = []
        for device in snapshot.devices:
            if device.index in self.last_exclusive.holders and device.mig_index is None:
                count = sum(1 for gpus in self.ledger.denied.values() if device.index in gpus)
                gated.append(((snapshot.node, str(device.index), device.uuid, device.name), count))
        metrics.set_sharing(snapshot.node, tuple(sorted(quotas.items())), tuple(gated))

    def close(self) -> None:
        """Detach the device program from every cgroup (BpfDeviceGate has close(); a null gate not)."""
        close_gate = getattr(self.gate, "close", None)
        if callable(close_gate):
            close_gate()
