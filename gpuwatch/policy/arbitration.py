"""GPU memory arbitration (pure): deadlock breaking, allocations stopped at the kernel, and
adaptive fair share with execution rescheduling (Chen et al. 2019).

Inputs are one snapshot's containers grouped per GPU, the probes' rare events (OOM returns,
over-limit allocations, processes SIGSTOPped before an allocation) and the state of the
previous round; the output is Decisions (through the caller's `emit`, which applies the
safety and rate-limit rules), the memory each container may hold (pushed into the kernel
limit map by the enforcer) and the new state.

Without fair share: a process stopped at an allocation is continued (SIGCONT) once its
request fits in the GPU's free memory and within its own rule limit, highest priority first;
two or more containers blocked on allocations none of which fits is a deadlock (deadlock.py)
and the victim is removed.

With fair share (the `fair_share` and `rescheduling` policy sections), per GPU:
* demand = held + the pending request (a stopped allocation, or an OOM / over-limit event
  not yet admitted); the GPU is oversubscribed while the demands exceed what containers can
  have (its memory minus what processes outside containers hold);
* fair shares: `split: demand` (adaptive) water-fills the memory weighted by demand x
  priority weight; `split: equal` (static) gives each container memory / containers;
* demand: with `rescheduling.demand_from_limit` a container whose rule sets a gpu_memory
  limit declares that much: it is admitted for all of it at its first allocation, so jobs
  that grow never hold part of the GPU while waiting for the rest (a deadlock otherwise);
* admission, in priority then arrival order: a pending request is admitted when it fits in
  the memory nobody has been promised yet. Under `split: demand` requests are admitted in
  line until one does not fit; after it, later ones only backfill within their fair share
  (so a stream of small jobs cannot starve the one waiting). Under `split: equal` every
  container stays within its equal part (the GPU / the containers holding memory, counting
  itself; while others ask, holders are promised no more than the GPU / all of them; when
  every container on the GPU waits for more than its part, the first in line whose request
  fits goes ahead, so equal parts never leave a GPU idle for good -- and so under `split:
  demand`, where a first in line that does not fit could otherwise hold back a later request
  that does while nobody runs). A request that cannot fit on the GPU even if everyone else
  left is continued to fail with out-of-memory, as without gpuwatch. The rest wait: paused
  (frozen, and still stopped at the allocation), resumed in the same order as memory frees;
  one waiting past `rescheduling.checkpoint_after` gets the
  checkpoint signal;
* allowances: what each running container may hold (held + what was admitted, plus its part
  of the headroom) -- the kernel stops an allocation beyond it, so the sum of allowances never
  exceeds the GPU and nothing runs into OOM. An allowance only grows out of memory that no
  allowance covered in the previous round, so a shrinking one has reached the kernel before
  another container is told it may use that memory. A container found running that no round
  admitted (it started before the agent, or allocated with no gate) keeps what it holds and
  grows to its declared demand only out of such memory: it was never promised the rest.
  Memory nobody planned for (a CUDA context made on a GPU whose memory is all promised) takes
  back promises not yet allocated, latest first, so the allowances never exceed the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from gpuwatch.core.model import Snapshot
from gpuwatch.policy.deadlock import Contender, find_deadlock, priority_weight, weighted_fair_share
from gpuwatch.policy.decisions import Decision, Verb
from gpuwatch.policy.events import ProbeEvent, ProbeEventKind
from gpuwatch.policy.rules import ActionKind, AdmissionOrder, FairShareSplit, Policy
from gpuwatch.policy.usage import ContainerView

ANY_GPU = -1
"""Event gpu_index when the probe could not tell the device (CUDA-API events)."""
FAIR_RULE = "fair-share"
STOPPED_RULE = "stopped-at-allocation"
RESCHEDULING_RULE = "rescheduling"


@dataclass(frozen=True)
class Waiting:
    """A container paused until its pending allocation can be admitted."""

    gpu_index: int
    since_s: float
    requested_bytes: int
    event_s: float
    """Timestamp of the newest event behind the request (admitting it admits up to this)."""


@dataclass(frozen=True)
class ArbitrationState:
    deadlocks: Mapping[int, str] = field(default_factory=dict)
    """GPU index -> victim key of the deadlock currently being broken."""
    admitted_events_s: Mapping[str, float] = field(default_factory=dict)
    """Key -> newest event timestamp already admitted (continued, or let through)."""
    waiting: Mapping[str, Waiting] = field(default_factory=dict)
    allowances: Mapping[tuple[int, str], int] = field(default_factory=dict)
    """(GPU, key) -> bytes the container may hold on that GPU (last round)."""
    checkpointed: frozenset[str] = frozenset()
    """Containers sent the checkpoint signal for waiting too long (not admitted again)."""
    gated: frozenset[str] = frozenset()
    """Containers the enforcer held for admission at their first allocation while they were on
    no GPU yet (rescheduling.gate_new; set by the enforcer after each round): one that shows up
    holding only what it made before that allocation (its CUDA context) is still not admitted."""


@dataclass(frozen=True)
class MemoryStatus:
    """What the view shows about one container's memory on one GPU."""

    gpu_index: int
    held_bytes: int
    pending_bytes: int
    fair_share_bytes: int | None
    allowance_bytes: int | None
    waiting_since_s: float | None = None


@dataclass(frozen=True)
class ArbitrationResult:
    detected: int
    resolved: int
    effective_limits_bytes: Mapping[str, int]
    """Key -> bytes the kernel should let the container hold (sum over its GPUs); only
    containers under fair share."""
    fair_shares_bytes: Mapping[str, int]
    """Key -> its fair share while a GPU it is on is oversubscribed."""
    status: Mapping[str, tuple[MemoryStatus, ...]]
    state: ArbitrationState


Emit = Callable[[Decision], Decision]


def events_by_key(
    views: Sequence[ContainerView], events: Sequence[ProbeEvent], since_s: float
) -> dict[str, list[ProbeEvent]]:
    """Events at or after `since_s`, by the container key their cgroup id or path names."""
    by_path: dict[str, str] = {}
    by_id: dict[int, str] = {}
    for view in views:
        by_path[view.identity.cgroup_path] = view.identity.key
        if view.identity.cgroup_id is not None:
            by_id[view.identity.cgroup_id] = view.identity.key
    out: dict[str, list[ProbeEvent]] = {}
    for event in events:
        if event.timestamp_s < since_s:
            continue
        key = by_id.get(event.cgroup_id) if event.cgroup_id is not None else None
        key = key or by_path.get(event.cgroup_path)
        if key is not None:
            out.setdefault(key, []).append(event)
    return out


def _on_gpu(events: Sequence[ProbeEvent], gpu: int) -> list[ProbeEvent]:
    return [e for e in events if e.gpu_index in (gpu, ANY_GPU)]


def pending_requests(
    views: Sequence[ContainerView], events: Sequence[ProbeEvent], since_s: float, admitted: Mapping[str, float]
) -> dict[str, int]:
    """Key -> the largest allocation the kernel stopped and that was not continued yet
    (rule ladders count it as memory demand)."""
    pending: dict[str, int] = {}
    for key, found in events_by_key(views, events, since_s).items():
        stops = [
            e
            for e in found
            if e.kind is ProbeEventKind.STOPPED_AT_ALLOCATION and e.timestamp_s > admitted.get(key, -1.0)
        ]
        if stops:
            pending[key] = max(e.requested_bytes for e in stops)
    return pending


def _capacity(snapshot: Snapshot, gpu_index: int) -> int | None:
    return next((d.memory_total_bytes for d in snapshot.devices if d.index == gpu_index), None)


def _free_bytes(snapshot: Snapshot, gpu_index: int, held: int) -> int | None:
    for device in snapshot.devices:
        if device.index != gpu_index:
            continue
        if device.memory_free_bytes is not None:
            return device.memory_free_bytes
        if device.memory_total_bytes is not None:
            return device.memory_total_bytes - held
    return None


@dataclass
class _Seat:
    """One container on one GPU during a round (mutable scratch)."""

    key: str
    view: ContainerView
    gpu: int
    held: int
    pending: int
    pending_event_s: float
    stopped: bool
    blocked: bool
    priority: int
    arrival_s: float
    managed: bool
    """Matched by a rule: it may be queued, paused and continued (others only count as holders)."""
    declared: int = 0
    """Its rule's gpu_memory limit under rescheduling.demand_from_limit: its whole demand."""
    headroom: float = 1.0
    """rescheduling.headroom: admitted for held + pending + this fraction of `declared`."""

    @property
    def promise(self) -> int:
        """What admission promises it: its declared demand, or (headroom below 100%) its
        current footprint plus the headroom, capped at the declared demand."""
        if self.headroom >= 1.0 or not self.declared:
            return self.declared
        return min(self.declared, self.held + self.pending + int(self.headroom * self.declared))

    @property
    def demand(self) -> int:
        return max(self.held + self.pending, self.promise)


@dataclass(frozen=True)
class ArbitrationInput:
    """Everything one round of memory arbitration reads.

    `managed`: keys of the containers a rule matches (None: all); only they are queued,
    paused and continued, the others' memory just counts. `strict_limits`: keys whose rule
    has a pause/checkpoint/kill step on gpu_memory (None: every limit is strict): a request
    over such a limit is left to that ladder."""

    policy: Policy
    snapshot: Snapshot
    views: Sequence[ContainerView]
    priorities: Mapping[str, int]
    events: Sequence[ProbeEvent]
    limits_by_key: Mapping[str, int]
    first_seen_s: Mapping[str, float]
    prev: ArbitrationState
    t: float
    emit: Emit
    managed: Collection[str] | None = None
    strict_limits: Collection[str] | None = None


class _Round:
    def __init__(self, inputs: ArbitrationInput) -> None:
        policy, t, views, prev = inputs.policy, inputs.t, inputs.views, inputs.prev
        limits_by_key, priorities, first_seen_s, managed = (inputs.limits_by_key, inputs.priorities,
                                                           inputs.first_seen_s, inputs.managed)
        self.policy, self.snapshot, self.t, self.emit = policy, inputs.snapshot, t, inputs.emit
        self.prev = prev
        self.limits_by_key = limits_by_key
        self.strict_limits = inputs.strict_limits
        self.by_key = {v.identity.key: v for v in views}
        self.recent = events_by_key(views, inputs.events, t - policy.deadlock.blocked_window_s)
        self.admitted = {k: v for k, v in prev.admitted_events_s.items() if k in self.by_key}
        self.waiting = {k: w for k, w in prev.waiting.items() if k in self.by_key}
        self.checkpointed = {k for k in prev.checkpointed if k in self.by_key}
        self.deadlocks = dict(prev.deadlocks)
        self.allowances: dict[tuple[int, str], int] = {}
        self.fair_shares: dict[str, int] = {}
        self.status: dict[str, list[MemoryStatus]] = {}
        self.detected = self.resolved = 0
        self.seats: dict[int, list[_Seat]] = {}
        for view in views:
            key = view.identity.key
            mine = self.recent.get(key, [])
            for row in view.rows:
                on_gpu = _on_gpu(mine, row.gpu_index)
                fresh = [e for e in on_gpu if e.timestamp_s > self.admitted.get(key, -1.0)]
                stopped = any(e.kind is ProbeEventKind.STOPPED_AT_ALLOCATION for e in fresh)
                pending = max((e.requested_bytes for e in fresh), default=0)
                event_s = max((e.timestamp_s for e in fresh), default=-1.0)
                waiting = self.waiting.get(key)
                if waiting is not None and waiting.gpu_index == row.gpu_index:
                    # a waiting request is kept until it is admitted, however old its event
                    pending = max(pending, waiting.requested_bytes)
                    event_s = max(event_s, waiting.event_s)
                    stopped = True
                blocked = any(e.kind in (ProbeEventKind.OOM, ProbeEventKind.STOPPED_AT_ALLOCATION) for e in fresh)
                declared = limits_by_key.get(key, 0) if policy.rescheduling.demand_from_limit and \
                    len(view.rows) == 1 else 0
                self.seats.setdefault(row.gpu_index, []).append(
                    _Seat(key, view, row.gpu_index, row.memory_bytes, pending, event_s, stopped,
                          blocked or key in self.waiting, priorities.get(key, 0), first_seen_s.get(key, t),
                          managed is None or key in managed, declared, policy.rescheduling.headroom)
                )

    # -- deadlocks ---------------------------------------------------------------------
    def deadlock(self, gpu: int, seats: list[_Seat]) -> None:
        settings = self.policy.deadlock
        if gpu in self.deadlocks and self.deadlocks[gpu] not in {s.key for s in seats}:
            # the victim is gone (checkpointed and ended): that deadlock is over; one that
            # persists among the others is a new one, with a victim of its own
            self.deadlocks.pop(gpu)
            self.resolved += 1
        held = sum(s.held for s in seats)
        free = _free_bytes(self.snapshot, gpu, held)
        if free is None:
            return
        # under fair share a waiter is admitted for its whole demand (its declared one with
        # rescheduling.demand_from_limit), not just the allocation it stopped at: waiters whose
        # demands fit nowhere while nobody runs are deadlocked even if one small allocation would fit
        capacity = (_capacity(self.snapshot, gpu) or 0) if self.policy.fair_share.enabled else 0
        contenders = [
            Contender(s.key, s.view.identity, gpu, s.held,
                      max(s.pending, min(s.demand, capacity) - s.held) if capacity and s.pending > 0 else s.pending,
                      s.priority, s.blocked)
            for s in seats
        ]
        found = find_deadlock(gpu, free, contenders) if settings.enabled else None
        # Under rescheduling a running holder frees its memory when it ends: waiting is not a
        # deadlock while one runs (the checkpoint deadline covers holders that never end).
        if found is not None and self.policy.fair_share.enabled and any(
            not c.blocked and c.held_bytes > 0 for c in contenders
        ):
            found = None
        if found is not None and gpu not in self.deadlocks:
            self.detected += 1
            self.deadlocks[gpu] = found.victim.key
            self.emit(
                Decision(
                    Verb(settings.action.value),
                    found.victim.identity,
                    "deadlock",
                    "deadlock",
                    found.reason(),
                    (("free_bytes", float(free)),),
                    signal=settings.signal,
                    grace_s=settings.grace_s,
                )
            )
            if settings.action is not ActionKind.PAUSE:
                self.waiting.pop(found.victim.key, None)
                self.checkpointed.add(found.victim.key)
        elif found is None and gpu in self.deadlocks:
            self.resolved += 1
            victim = self.deadlocks.pop(gpu)
            if settings.action is ActionKind.PAUSE and victim in self.by_key:
                self.emit(
                    Decision(
                        Verb.RELEASE,
                        self.by_key[victim].identity,
                        "deadlock",
                        "deadlock",
                        f"GPU {gpu} deadlock resolved; resuming the paused victim",
                    )
                )

    # -- without fair share: continue stopped allocations that fit ------------------------
    def continue_stopped(self, gpu: int, seats: list[_Seat]) -> None:
        held = sum(s.held for s in seats)
        free = _free_bytes(self.snapshot, gpu, held)
        if free is None:
            return
        for seat in sorted(seats, key=lambda s: (-s.priority, s.pending, s.key)):
            if not seat.managed or not seat.stopped or seat.pending <= 0 or self.deadlocks.get(gpu) == seat.key:
                continue
            if seat.pending > free or not self._within_own_limit(seat):
                continue
            free -= seat.pending
            self.admitted[seat.key] = seat.pending_event_s
            self.emit(self._continue(seat))

    def _within_own_limit(self, seat: _Seat) -> bool:
        """False when the request takes the container over its own limit and its rule has a
        memory step that pauses, checkpoints or kills: that ladder decides. (Over a limit
        whose ladder only alerts, the request is handled like any other.)"""
        own = self.limits_by_key.get(seat.key)
        if own is None or seat.view.memory_bytes + seat.pending <= own:
            return True
        return self.strict_limits is not None and seat.key not in self.strict_limits

    @staticmethod
    def _continue(seat: _Seat) -> Decision:
        return Decision(
            Verb.RELEASE,
            seat.view.identity,
            STOPPED_RULE,
            "deadlock",
            f"GPU {seat.gpu} now has room for the stopped allocation of {seat.pending} B",
            continue_stopped=True,
        )

    # -- fair share and rescheduling ---------------------------------------------------------
    def fair_share(self, gpu: int, seats: list[_Seat]) -> None:
        capacity = _capacity(self.snapshot, gpu)
        if not capacity:
            return
        settings = self.policy.fair_share
        held = sum(s.held for s in seats)
        free = _free_bytes(self.snapshot, gpu, held)
        outside = max(capacity - (free if free is not None else capacity - held) - held, 0)
        avail = capacity - outside  # what containers can have: not what host processes hold
        live = [s for s in seats if s.key not in self.checkpointed]
        oversubscribed = sum(s.demand for s in live) > avail
        prev = {s.key: self.prev.allowances.get((gpu, s.key)) for s in live}
        shares = self._shares(avail, live, settings.split, prev)
        if oversubscribed:
            for s in live:
                self.fair_shares[s.key] = self.fair_shares.get(s.key, 0) + shares[s.key]
        # memory already promised: a running container may still grow to its last allowance
        promised = {
            s.key: s.held if s.key in self.waiting else max(s.held, prev[s.key] or 0)
            for s in live
        }
        unpromised = avail - sum(promised.values()) - sum(s.held for s in seats if s.key in self.checkpointed)
        if self.policy.rescheduling.order is AdmissionOrder.SMALLEST:
            order = sorted(live, key=lambda s: (-s.priority, s.demand, s.arrival_s, s.key))
        else:
            order = sorted(live, key=lambda s: (-s.priority, s.arrival_s, s.key))
        admitted: list[_Seat] = []
        waiting: list[_Seat] = []
        line_blocked = False  # someone earlier in line waits: the rest may only backfill within their share
        for seat in order:
            if not seat.managed or seat.pending <= 0 or self.deadlocks.get(gpu) == seat.key:
                continue
            if not self._within_own_limit(seat):
                continue  # the rule's ladder decides
            if seat.held + seat.pending > avail:
                self._never_fits(gpu, seat, avail)
                continue
            demand = min(seat.demand, avail)  # a declared demand beyond the GPU is promised the GPU at most
            if settings.split is FairShareSplit.EQUAL:
                allowed = demand <= shares[seat.key]
            else:
                allowed = not line_blocked or not oversubscribed or demand <= shares[seat.key]
            extra = max(demand - promised[seat.key], 0)  # beyond what it was promised already
            if extra <= unpromised and allowed:
                unpromised -= extra
                admitted.append(seat)
            else:
                waiting.append(seat)
                line_blocked = True
        if waiting and not admitted and not any(
                s.key not in self.waiting and s.pending <= 0 and s.held > 0 for s in live):
            # everyone here waits and nobody runs, so no memory will ever free: under equal parts
            # (three jobs of 3 GiB on an 8 GiB GPU each get 2.7) or behind a first in line whose
            # request does not fit (the others may only backfill within their share). Waiting
            # must not leave a GPU idle for good: the first in line whose request fits in the
            # unpromised memory goes ahead (none fits: a deadlock, the deadlock section's case).
            for index, seat in enumerate(waiting):
                extra = max(min(seat.demand, avail) - promised[seat.key], 0)
                if extra <= unpromised:
                    unpromised -= extra
                    admitted.append(waiting.pop(index))
                    break
        for seat in admitted:
            self.admitted[seat.key] = max(self.admitted.get(seat.key, -1.0), seat.pending_event_s)
            if seat.key in self.waiting:
                continue  # resumed below, in order
            if seat.stopped:
                self.emit(self._continue(seat))
        for seat in waiting:
            if seat.key in self.waiting:
                continue
            decision = self.emit(
                Decision(
                    Verb.PAUSE,
                    seat.view.identity,
                    FAIR_RULE,
                    "fair_share",
                    f"GPU {gpu} memory oversubscribed: {seat.pending} B more do not fit "
                    f"({max(unpromised, 0)} B unpromised, fair share {shares[seat.key]} B); waits its turn "
                    f"(priority {seat.priority}, then arrival)",
                    (("held_bytes", float(seat.held)), ("requested_bytes", float(seat.pending)),
                     ("fair_share_bytes", float(shares[seat.key]))),
                )
            )
            if not decision.suppressed:
                self.waiting[seat.key] = Waiting(gpu, self.t, seat.pending, seat.pending_event_s)
        for seat in admitted:
            if seat.key not in self.waiting:
                continue
            waited = self.t - self.waiting[seat.key].since_s
            self.emit(
                Decision(
                    Verb.RELEASE,
                    seat.view.identity,
                    FAIR_RULE,
                    "fair_share",
                    f"GPU {gpu} has room again for {seat.pending} B; resuming in priority order "
                    f"after {waited:.1f}s",
                    continue_stopped=True,
                )
            )
            del self.waiting[seat.key]
        # a waiting container whose request went away (it was continued by someone else)
        for seat in live:
            if seat.key in self.waiting and seat.pending <= 0 and self.waiting[seat.key].gpu_index == gpu:
                self.emit(Decision(Verb.RELEASE, seat.view.identity, FAIR_RULE, "fair_share",
                                   f"GPU {gpu}: nothing pending any more; resuming", continue_stopped=True))
                del self.waiting[seat.key]
        self._checkpoint_overdue(gpu, live)
        # a checkpointed container holds its memory until it has ended: nobody is promised it before
        leaving = sum(s.held for s in seats if s.key in self.checkpointed)
        self._allowances(gpu, avail - leaving, live, shares, oversubscribed, prev, admitted)

    def _never_fits(self, gpu: int, seat: _Seat, avail: int) -> None:
        """A request that cannot fit on this GPU even if every other container left (what it
        holds + what it asks > what containers can have there). Waiting would hang the job for
        good and, in arrival order, hold back everyone behind it: its request is answered now
        -- a stopped allocation is continued and the driver fails it with out-of-memory, as it
        would without gpuwatch; a failed one (an OOM event) is not queued."""
        self.admitted[seat.key] = max(self.admitted.get(seat.key, -1.0), seat.pending_event_s)
        was_waiting = self.waiting.pop(seat.key, None) is not None
        if seat.stopped or was_waiting:
            self.emit(Decision(
                Verb.RELEASE, seat.view.identity, FAIR_RULE, "fair_share",
                f"GPU {gpu} can never hold {seat.held} B held + {seat.pending} B asked ({avail} B for "
                "containers): the allocation goes on and fails with out-of-memory, as without gpuwatch",
                (("held_bytes", float(seat.held)), ("requested_bytes", float(seat.pending)),
                 ("available_bytes", float(avail))),
                continue_stopped=True,
            ))

    @staticmethod
    def _shares(avail: int, seats: list[_Seat], split: FairShareSplit, prev: Mapping[str, int | None]
                ) -> dict[str, int]:
        """Fair share per container. Equal (static) split: the GPU / the containers that hold
        memory or were given some, counting the one asking (so a GPU nobody else uses is all
        its, and one of several that ask at once is always admitted)."""
        if not seats:
            return {}
        if split is FairShareSplit.EQUAL:
            holders = {s.key for s in seats if s.held > 0 or (prev.get(s.key) or 0) > 0}
            return {s.key: avail // max(len(holders | {s.key}), 1) for s in seats}
        demands = [(s.key, s.demand, priority_weight(s.priority) * max(s.demand, 1)) for s in seats]
        shares = weighted_fair_share(avail, demands)
        return {s.key: shares.get(s.key, 0) for s in seats}

    def _checkpoint_overdue(self, gpu: int, seats: list[_Seat]) -> None:
        settings = self.policy.rescheduling
        if settings.checkpoint_after_s is None:
            return
        for seat in seats:
            waiting = self.waiting.get(seat.key)
            if waiting is None or waiting.gpu_index != gpu or self.t - waiting.since_s < settings.checkpoint_after_s:
                continue
            decision = self.emit(
                Decision(
                    Verb.CHECKPOINT_KILL,
                    seat.view.identity,
                    RESCHEDULING_RULE,
                    "rescheduling",
                    f"waited {self.t - waiting.since_s:.0f}s for {waiting.requested_bytes} B on GPU {gpu} "
                    f"(rescheduling.checkpoint_after {settings.checkpoint_after_s:g}s)",
                    (("held_bytes", float(seat.held)), ("requested_bytes", float(waiting.requested_bytes))),
                    signal=settings.signal,
                    grace_s=settings.grace_s,
                )
            )
            if not decision.suppressed:
                del self.waiting[seat.key]
                self.checkpointed.add(seat.key)

    def _allowances(
        self,
        gpu: int,
        avail: int,
        seats: list[_Seat],
        shares: Mapping[str, int],
        oversubscribed: bool,
        prev: Mapping[str, int | None],
        admitted: list[_Seat],
    ) -> None:
        admitted_keys = {s.key for s in admitted}
        running = [s for s in seats if s.key not in self.waiting and s.managed]
        base: dict[str, int] = {}
        goal: dict[str, int] = {}  # what it is promised: base, or (found running) its promise out of slack
        fresh: set[str] = set()
        for s in running:
            base[s.key] = s.held + (s.pending if s.key in admitted_keys else 0)
            # held memory starts a container only if it was not held back last round: a gated
            # container that has made its CUDA context since still waits for its first admission
            # (else a round between the context and the first allocation promised it everything)
            last = prev[s.key]
            held_back = last == 0 or (last is None and s.key in self.prev.gated)
            started = s.key in admitted_keys or (last or 0) > 0 or (s.held > 0 and not held_back)
            if started and s.key not in self.admitted:
                # running without ever being admitted by a round (it ran before the agent started, or
                # allocated with no gate): it keeps what it holds and grows to its promise only out of
                # memory nobody holds or was promised -- promising each such container all it declared
                # at once could exceed the GPU
                goal[s.key] = max(base[s.key], s.promise)
            elif started:
                base[s.key] = max(base[s.key], s.promise)  # admitted for all it declared (or its headroom)
            elif self.policy.rescheduling.gate_new:
                fresh.add(s.key)  # nothing allocated or admitted yet: its first allocation waits for admission
            goal.setdefault(s.key, base[s.key])
        if oversubscribed or any(s.key in self.waiting for s in seats):
            if self.policy.fair_share.split is FairShareSplit.EQUAL:
                # the equal part among all that hold or ask: a lone holder does not keep the GPU promised
                asking = {s.key for s in seats if s.held > 0 or s.pending > 0 or s.key in self.waiting}
                shares = {k: min(v, avail // max(len(asking | {k}), 1)) for k, v in shares.items()}
            target = {s.key: max(goal[s.key], shares.get(s.key, 0)) for s in running}
        else:
            spare = max(avail - sum(s.demand for s in seats), 0)
            weights = {s.key: priority_weight(s.priority) for s in running}
            total = sum(weights.values()) or 1.0
            target = {s.key: goal[s.key] + int(spare * weights[s.key] / total) for s in running}
        # grow only out of memory no allowance covered last round (shrinks reach the kernel first)
        current: dict[str, int] = {}
        for seat in running:
            last = prev[seat.key]
            current[seat.key] = max(last if last is not None else base[seat.key], base[seat.key])
        slack = avail - sum(current.values()) - sum(s.held for s in seats if s.key in self.waiting or not s.managed)
        for seat in sorted(running, key=lambda s: (-s.priority, s.arrival_s, s.key)):
            key = seat.key
            if key in fresh:
                # allowed nothing more; what it holds already (its CUDA context) stays counted
                self.allowances[(gpu, key)] = 0
                continue
            if target[key] <= current[key]:
                self.allowances[(gpu, key)] = target[key]
                continue
            grow = min(target[key] - current[key], max(slack, 0))
            slack -= grow
            self.allowances[(gpu, key)] = current[key] + grow
        excess = sum(self.allowances[(gpu, s.key)] if s.key not in fresh else s.held for s in running) + sum(
            s.held for s in seats if s.key in self.waiting or not s.managed) - avail
        if excess > 0:
            self._trim(gpu, running, excess, {s.key: s.held + (s.pending if s.key in admitted_keys else 0)
                                              for s in running})
        for seat in seats:
            if not seat.managed:
                continue
            waiting = self.waiting.get(seat.key)
            allowance = self.allowances.get((gpu, seat.key))
            if waiting is not None:
                self.allowances[(gpu, seat.key)] = seat.held
                allowance = seat.held
            self.status.setdefault(seat.key, []).append(
                MemoryStatus(gpu, seat.held, seat.pending if seat.key not in admitted_keys else 0,
                             shares.get(seat.key) if oversubscribed else None, allowance,
                             waiting.since_s if waiting is not None else None)
            )

    def _trim(self, gpu: int, running: list[_Seat], excess: int, floor: Mapping[str, int]) -> None:
        """The allowances promise more than the GPU has: memory nobody planned for was taken (a
        container made its CUDA context on a GPU whose memory was all promised -- a pod placed
        by something else than gpuwatch's placement -- or a process outside containers grew).
        Promises not yet allocated are taken back, lowest priority and latest arrival first, down
        to what each holds (and a request admitted this round), so that an allocation within an
        allowance can never run the GPU out of memory: a container whose promise was cut is
        stopped at its next allocation and waits, instead of failing with an OOM."""
        for seat in sorted(running, key=lambda s: (-s.priority, s.arrival_s, s.key), reverse=True):
            if excess <= 0:
                return
            allowance = self.allowances.get((gpu, seat.key), 0)
            cut = min(max(allowance - floor[seat.key], 0), excess)
            if cut > 0:
                self.allowances[(gpu, seat.key)] = allowance - cut
                excess -= cut

    def result(self) -> ArbitrationResult:
        limits: dict[str, int] = {}
        for (_, key), allowance in self.allowances.items():
            limits[key] = limits.get(key, 0) + allowance
        return ArbitrationResult(
            self.detected,
            self.resolved,
            limits,
            self.fair_shares,
            {k: tuple(v) for k, v in self.status.items()},
            ArbitrationState(
                deadlocks=self.deadlocks,
                admitted_events_s=self.admitted,
                waiting=self.waiting,
                allowances=self.allowances,
                checkpointed=frozenset(self.checkpointed),
            ),
        )


def arbitrate_memory(inputs: ArbitrationInput) -> ArbitrationResult:
    """One round of memory arbitration over every GPU the snapshot's containers use."""
    run = _Round(inputs)
    policy = inputs.policy
    for gpu in sorted(run.seats):
        seats = run.seats[gpu]
        run.deadlock(gpu, seats)
        if policy.fair_share.enabled:
            run.fair_share(gpu, seats)
        else:
            run.continue_stopped(gpu, seats)
    return run.result()
