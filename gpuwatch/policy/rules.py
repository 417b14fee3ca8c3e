"""The validated, immutable policy: what the loader produces and the evaluator reads.

A policy is an ordered list of rules. The first rule whose selector matches a container
applies to it (like a firewall): put specific rules first and a `default` rule last.
Each rule carries limits and an ordered action ladder (alert at 90%, throttle at 100% for
10 s, checkpoint-then-kill after 60 s ...). Per-namespace quotas are a separate list and
apply to the sum over a namespace's containers.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from enum import StrEnum

from gpuwatch.core.units import MemoryAmount

DEFAULT_PROTECTED_NAMESPACES: tuple[str, ...] = ("kube-system",)


class ActionKind(StrEnum):
    """What a ladder step does. Order here = disruptiveness (least first)."""

    ALERT = "alert"
    THROTTLE = "throttle"
    PAUSE = "pause"
    CHECKPOINT_KILL = "checkpoint-then-kill"
    KILL = "kill"

    @property
    def disruptive(self) -> bool:
        return self is not ActionKind.ALERT

    @property
    def reversible(self) -> bool:
        """Throttle and pause are undone (thawed) when the violation clears."""
        return self in (ActionKind.THROTTLE, ActionKind.PAUSE)

    @property
    def terminal(self) -> bool:
        return self in (ActionKind.CHECKPOINT_KILL, ActionKind.KILL)


class LimitKind(StrEnum):
    """Which measured quantity a limit (and a ladder step's `on`) refers to."""

    GPU_MEMORY = "gpu_memory"
    GPU_TIME = "gpu_time_share"
    DEVICES = "devices"
    PROCESSES = "max_processes"


@dataclass(frozen=True)
class Selector:
    """Which containers a rule applies to; every given field must match (AND).

    Strings are shell globs (fnmatch). `labels` match pod labels/annotations as found in
    the runtime bundle. `default: true` matches every container (not bare host cgroups).
    """

    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    container_id: str | None = None
    cgroup: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    default: bool = False

    def names_namespace_explicitly(self, namespace: str) -> bool:
        """True when the selector names this namespace literally (no wildcard)."""
        return self.namespace == namespace


@dataclass(frozen=True)
class Limits:
    gpu_memory: MemoryAmount | None = None
    gpu_time_share: float | None = None
    """Fraction of one GPU's time (0.5 = half a GPU), summed over the container's GPUs."""
    window_s: float = 30.0
    """Window over which GPU-time share is measured from kernel_seconds_total."""
    devices: tuple[int, ...] | None = None
    max_processes: int | None = None

    def kinds(self) -> tuple[LimitKind, ...]:
        found = []
        if self.gpu_memory is not None:
            found.append(LimitKind.GPU_MEMORY)
        if self.gpu_time_share is not None:
            found.append(LimitKind.GPU_TIME)
        if self.devices is not None:
            found.append(LimitKind.DEVICES)
        if self.max_processes is not None:
            found.append(LimitKind.PROCESSES)
        return tuple(found)


@dataclass(frozen=True)
class ActionStep:
    """One rung of the ladder: when usage/limit >= `at` for `for_s` seconds, do `kind`."""

    kind: ActionKind
    at_ratio: float = 1.0
    for_s: float = 0.0
    on: tuple[LimitKind, ...] = ()
    """Limits this step watches; empty = all of the rule's limits."""
    signal: int = int(signal.SIGUSR1)
    grace_s: float = 30.0
    share: float | None = None
    """Throttle target (fraction of a GPU); None = the rule's gpu_time_share."""
    repeat_s: float = 300.0
    """Alert-only: re-alert at most this often while the violation lasts."""
    line: int = 0


@dataclass(frozen=True)
class Rule:
    name: str
    selector: Selector
    limits: Limits
    actions: tuple[ActionStep, ...]
    priority: int = 0
    """Higher = more important: lowest priority is paused/killed first (deadlocks, fair share)."""
    line: int = 0


@dataclass(frozen=True)
class NamespaceQuota:
    """A limit on the sum over all containers of one namespace (glob allowed)."""

    namespace: str
    limits: Limits
    actions: tuple[ActionStep, ...]
    line: int = 0


@dataclass(frozen=True)
class Tuning:
    """Anti-flap knobs shared by all rules."""

    hysteresis_ratio: float = 0.05
    """A step clears only when usage drops below (at - hysteresis)."""
    release_after_s: float = 10.0
    """A reversible action (throttle/pause) is released after the violation stayed clear this long."""
    min_hold_s: float = 10.0
    """A reversible action is held at least this long once taken."""
    max_actions_per_minute: int = 30
    """Node-wide cap on disruptive actions; extra ones are deferred (and reported)."""


@dataclass(frozen=True)
class DeadlockSettings:
    enabled: bool = True
    action: ActionKind = ActionKind.CHECKPOINT_KILL
    grace_s: float = 10.0
    signal: int = int(signal.SIGUSR1)
    blocked_window_s: float = 10.0
    """A container is blocked if an OOM/stopped-at-allocation event was seen this recently."""


class FairShareSplit(StrEnum):
    """How a GPU's memory is divided among its containers while it is oversubscribed."""

    DEMAND = "demand"
    """Adaptive fair share (Chen et al.): water-filled, weighted by demand x priority weight."""
    EQUAL = "equal"
    """Static fair share: capacity / containers on the GPU, whatever they ask for."""


@dataclass(frozen=True)
class FairShareSettings:
    enabled: bool = False
    """When a GPU's memory is oversubscribed, containers wait (paused) instead of running into OOM."""
    split: FairShareSplit = FairShareSplit.DEMAND


class AdmissionOrder(StrEnum):
    """Admission order among waiting containers of the same priority (rescheduling.order)."""

    ARRIVAL = "arrival"
    """First come, first admitted (a later one only backfills where it does not delay it)."""
    SMALLEST = "smallest"
    """The smallest memory demand first (shortest-job-first by memory; ties by arrival)."""


@dataclass(frozen=True)
class ReschedulingSettings:
    """Execution rescheduling under fair share: who waits for memory, for how long, and how
    containers that have not allocated yet are kept from allocating past the queue."""

    checkpoint_after_s: float | None = None
    """A container waiting for memory this long gets the checkpoint signal (None: never)."""
    signal: int = int(signal.SIGUSR1)
    grace_s: float = 30.0
    gate_new: bool = True
    """With the kernel probes: containers not yet on a GPU get a 0-byte limit with the stop
    action, so their first allocation waits for admission instead of racing the queue."""
    demand_from_limit: bool = True
    """A container whose rule sets a gpu_memory limit declares that much as its demand: it is
    admitted for all of it at its first allocation (and waits until all of it fits), so jobs
    that grow never hold part of the GPU while waiting for the rest."""
    headroom: float = 1.0
    """With a declared demand: a container is admitted for what it holds and asks now plus this
    fraction of its declared demand (never more than the declared demand). 1.0 (100%): the
    whole declared demand at once. Less over-admits (its later growth waits, stopped at the
    allocation, when the GPU has no room: never OOM)."""
    order: AdmissionOrder = AdmissionOrder.ARRIVAL
    """Within a priority, who is admitted first: arrival order, or the smallest demand first."""


class ElasticThrottle(StrEnum):
    """Who the elastic controller throttles while some job yields (elastic.throttle)."""

    ALL_BUT_TOP = "all-but-top"
    YIELDING = "yielding"


class ElasticDivide(StrEnum):
    """How the elastic controller divides a GPU's time among jobs with an efficiency (elastic.divide)."""

    EFFICIENCY = "efficiency"
    """In proportion to growth efficiency (FlowCon): a job whose curve flattens yields gradually."""
    PLATEAU = "plateau"
    """Only plateaued jobs yield (to the floor); the others share the rest equally."""


@dataclass(frozen=True)
class ElasticSettings:
    """Progress-aware elastic GPU time (FlowCon): co-located jobs' time shares follow their
    growth efficiency (progress per GPU-second, normalised by the job's own early rate)."""

    enabled: bool = False
    window_s: float = 10.0
    """Growth efficiency is measured over this much wall time of progress reads."""
    floor: float = 0.1
    """No job with a progress input gets less than this share of its GPU."""
    hysteresis: float = 0.05
    """A target share moves only when the new one differs by more than this."""
    min_dwell_s: float = 15.0
    """A GPU's division stays at least this long before it changes again."""
    plateau: float = 0.05
    """Normalised efficiency below this = plateaued: the job yields down to the floor."""
    min_gpu_s: float = 0.5
    """A window's rate counts only when the job ran this many GPU-seconds in it."""
    period_s: float = 0.5
    """Freeze/thaw period of the elastic throttles: every freeze costs the GPU the moment it
    takes to give the frozen job's turn to another, so a longer period wastes less."""
    contended: float = 0.0
    """Only where the GPU's engine is contended: nobody starts yielding on a GPU whose tenants
    together are busy less than this fraction of the time (their SM utilisation summed; a
    freeze there costs the yielding job time and gives the others none they lacked); yielding
    in force ends when it falls below half of it. 0: always (the default)."""
    throttle: ElasticThrottle = ElasticThrottle.ALL_BUT_TOP
    """Who is held to its share while some job yields: every tenant but the one with the largest
    share (all-but-top), or only the yielding jobs (yielding: the others share the rest of the
    GPU by plain time slicing, so no share below what a job would use is imposed on it)."""
    divide: ElasticDivide = ElasticDivide.EFFICIENCY
    """In proportion to efficiency, or only plateaued jobs yield (a job still learning keeps an
    equal part: slowing it delays what it has left to gain)."""
    checkpoint_plateaued: bool = False
    """While containers wait for memory on its GPU, a plateaued job there gets the checkpoint
    signal (rescheduling.signal, .grace): it has little left to gain, and its memory lets a
    waiting job start; it resumes from its checkpoint when its controller restarts it."""


@dataclass(frozen=True)
class Policy:
    rules: tuple[Rule, ...]
    namespace_quotas: tuple[NamespaceQuota, ...] = ()
    protected_namespaces: tuple[str, ...] = DEFAULT_PROTECTED_NAMESPACES
    tuning: Tuning = field(default_factory=Tuning)
    deadlock: DeadlockSettings = field(default_factory=DeadlockSettings)
    fair_share: FairShareSettings = field(default_factory=FairShareSettings)
    rescheduling: ReschedulingSettings = field(default_factory=ReschedulingSettings)
    elastic: ElasticSettings = field(default_factory=ElasticSettings)
    source: str = "<memory>"


EMPTY_POLICY = Policy(rules=())
