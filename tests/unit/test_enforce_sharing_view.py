"""The enforcer's side of rescheduling and elastic sharing, without root: the per-container
view it publishes (state, reason, limits; what the agent serves in /snapshot.json), the
metrics built from it, and the admission gate (a 0-byte stop limit for containers no GPU
shows yet)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from gpuwatch.core import snapshot_doc
from gpuwatch.core.model import ContainerIdentity
from gpuwatch.enforce.kernel_limits import NullKernelLimits
from gpuwatch.policy.events import ProbeEvent, ProbeEventKind
from tests.unit.test_enforce_enforcer import GIB, make, snap, who

FAIR = """
fair_share: {enabled: true}
deadlock: {enabled: false}
rules:
  - name: hi
    priority: 5
    match: {namespace: ml, container: hi}
  - name: rest
    match: {namespace: ml}
"""


class Listing:
    def __init__(self, *identities: ContainerIdentity) -> None:
        self.identities = identities

    def containers(self) -> list[ContainerIdentity]:
        return list(self.identities)


def stopped(identity: ContainerIdentity, want: int, t: float) -> ProbeEvent:
    return ProbeEvent(ProbeEventKind.STOPPED_AT_ALLOCATION, t, 1, 0, want, cgroup_id=identity.cgroup_id)


def test_dry_run_view_shows_who_waits_for_memory_and_why(tmp_path: Path) -> None:
    enforcer = make(tmp_path, FAIR, dry_run=True)
    hi, lo = who("hi", 1), who("lo", 2)
    t = time.time()
    first = dataclasses.replace(snap((hi, 6 * GIB), (lo, 6 * GIB), t=t - 1.0))
    enforcer.on_snapshot(first)
    s = snap((hi, 6 * GIB), (lo, 6 * GIB), t=t)
    decisions = enforcer.on_snapshot(s, [stopped(hi, 3 * GIB, t - 0.5), stopped(lo, 3 * GIB, t - 0.4)])
    assert [(d.verb.value, d.target.container_name) for d in decisions] == [("release", "hi"), ("pause", "lo")]
    view = {e.identity.container_name: e for e in enforcer.view()}
    assert view["hi"].state == "running" and view["hi"].memory_limit_bytes == 9 * GIB
    assert view["lo"].state == "waiting-memory" and view["lo"].pending_bytes == 3 * GIB
    assert view["lo"].reason.startswith("dry run, not done: GPU 0 memory oversubscribed")
    assert view["lo"].memory_fair_share_bytes is not None and view["lo"].waiting_s == 0.0
    served = snapshot_doc.loads(snapshot_doc.dumps(enforcer.decorate(s)))
    assert {e.identity.container_name: e.state for e in served.enforcement} == {"hi": "running",
                                                                                 "lo": "waiting-memory"}
    registry = CollectorRegistry()
    registry.register(enforcer.metrics_collector())
    labels = {"namespace": "ml", "pod": "p", "container": "lo", "container_id": "id-lo", "cgroup": "/kubepods/lo"}
    assert registry.get_sample_value("gpuwatch_enforce_pending_allocation_bytes", labels) == 3 * GIB
    assert registry.get_sample_value("gpuwatch_enforce_waiting_for_memory_seconds", labels) == 0.0
    enforcer.close()


def test_containers_not_on_a_gpu_yet_get_a_zero_byte_stop_limit(tmp_path: Path) -> None:
    limits = NullKernelLimits()
    newcomer, elsewhere = who("new", 7), dataclasses.replace(who("other", 8), pod_namespace="other")
    enforcer = make(tmp_path, FAIR, kernel_limits=limits, node_containers=Listing(newcomer, elsewhere, who("hi", 1)))
    hi = who("hi", 1)
    enforcer.on_snapshot(snap((hi, 2 * GIB)))
    assert limits.limits[7] == 0 and limits.actions[7] == "stop"  # its first allocation waits for admission
    assert 8 not in limits.limits  # no rule matches it: left alone
    assert limits.limits[1] == 16 * GIB and limits.actions[1] == "stop"  # alone: the whole GPU is its to grow into
    enforcer.close()
    (tmp_path / "off").mkdir()
    without = make(tmp_path / "off", FAIR.replace("deadlock:", "rescheduling: {gate_new: false}\ndeadlock:"),
                   kernel_limits=(off := NullKernelLimits()), node_containers=Listing(newcomer))
    without.on_snapshot(snap((hi, 2 * GIB)))
    assert 7 not in off.limits
    without.close()


def test_a_stop_event_counts_until_its_container_shows_up(tmp_path: Path) -> None:
    """The ring buffer gives each event once; NVML may list the stopped container only a
    sample later: the enforcer keeps the events of the blocked window."""
    enforcer = make(tmp_path, FAIR, dry_run=True)
    hi, lo = who("hi", 1), who("lo", 2)
    t = time.time()
    assert enforcer.on_snapshot(snap((hi, 2 * GIB), t=t - 1.0), [stopped(lo, GIB, t - 1.2)]) == []
    # no new events: the stop is still seen. hi, alone, was promised the whole GPU: lo waits
    # one round for hi's allowance to shrink, then is resumed -- once
    decisions = enforcer.on_snapshot(snap((hi, 2 * GIB), (lo, 0), t=t))
    assert [(d.verb.value, d.target.container_name) for d in decisions] == [("pause", "lo")]
    decisions = enforcer.on_snapshot(snap((hi, 2 * GIB), (lo, 0), t=t + 0.5))
    assert [(d.verb.value, d.target.container_name, d.continue_stopped) for d in decisions] == [
        ("release", "lo", True)]
    assert enforcer.on_snapshot(snap((hi, 2 * GIB), (lo, GIB), t=t + 1.0)) == []
    enforcer.close()
