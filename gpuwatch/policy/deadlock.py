"""GPU-memory deadlock detection and adaptive fair share (pure).

Deadlock (the interposer paper's case: two containers on a 5 GiB GPU each hold 2 GiB and
each ask for 2 GiB more): at least two containers on one GPU are blocked on allocations
(OOM returns or stopped at allocation), none of the requests fits in the free memory, so
none can make progress. It is broken by removing the lowest-priority blocked container
whose memory lets another one proceed.

The fair-share primitives (water-filling, priority weights) are here too; arbitration.py
uses them for adaptive fair share and execution rescheduling (Chen et al.).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpuwatch.core.model import ContainerIdentity


@dataclass(frozen=True)
class Contender:
    """One container's position on one GPU."""

    key: str
    identity: ContainerIdentity
    gpu_index: int
    held_bytes: int
    requested_bytes: int
    priority: int
    blocked: bool


@dataclass(frozen=True)
class Deadlock:
    gpu_index: int
    free_bytes: int
    blocked: tuple[Contender, ...]
    victim: Contender
    unblocks: tuple[str, ...]
    """Keys of blocked containers whose request fits once the victim's memory is freed."""

    def reason(self) -> str:
        names = ", ".join(
            f"{c.identity.display_name} (holds {c.held_bytes} B, wants {c.requested_bytes} B, priority {c.priority})"
            for c in self.blocked
        )
        return (
            f"GPU {self.gpu_index} memory deadlock: free {self.free_bytes} B fits no pending request; "
            f"blocked: {names}; victim {self.victim.identity.display_name} has the lowest priority "
            f"whose memory unblocks {len(self.unblocks)} other(s)"
        )


def find_deadlock(gpu_index: int, free_bytes: int, contenders: Sequence[Contender]) -> Deadlock | None:
    """A deadlock on this GPU, with its victim, or None."""
    blocked = [c for c in contenders if c.gpu_index == gpu_index and c.blocked]
    if len(blocked) < 2 or any(c.requested_bytes <= free_bytes for c in blocked):
        return None
    order = sorted(blocked, key=lambda c: (c.priority, -c.held_bytes, c.key))
    victim = order[0]
    unblocks: tuple[str, ...] = ()
    for candidate in order:
        freed = free_bytes + candidate.held_bytes
        helped = tuple(o.key for o in blocked if o is not candidate and o.requested_bytes <= freed)
        if helped:
            victim, unblocks = candidate, helped
            break
    return Deadlock(gpu_index, free_bytes, tuple(blocked), victim, unblocks)


def priority_weight(priority: int) -> float:
    """Fair-share weight: priority 0 (or less) weighs 1, priority p weighs p + 1."""
    return float(max(priority, 0) + 1)


def weighted_fair_share(capacity_bytes: int, demands: Sequence[tuple[str, int, float]]) -> dict[str, int]:
    """Water-filling: nobody gets more than it asks; the rest is split by weight."""
    shares: dict[str, int] = {}
    left = max(capacity_bytes, 0)
    pending = [(key, demand, weight) for key, demand, weight in demands if weight > 0]
    while pending:
        total_weight = sum(w for _, _, w in pending)
        satisfied = [(k, d, w) for k, d, w in pending if d <= left * w / total_weight]
        if not satisfied:
            for key, _, weight in pending:
                shares[key] = int(left * weight / total_weight)
            return shares
        for key, demand, _ in satisfied:
            shares[key] = demand
            left -= demand
        pending = [p for p in pending if p not in satisfied]
    return shares
