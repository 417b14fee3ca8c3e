"""The enforcer's side of the sharing annotations (gpuwatch/policy/sharing.py has the pure rules).

* `NodeContainers`: the typed hook through which the enforcer learns every container on the
  node, not only those in the snapshot (which lists GPU users): the exclusive gate must keep
  all of them off a held GPU, and glob namespace quotas are exported for the namespaces
  present. factory.CgroupNodeContainers is the real one (a walk of the cgroup v2 tree with
  identities from the containers layer); tests pass a list.
* `SharingLedger`: what the enforcer has already done (or, in a dry run, recorded) for the
  annotations, so every change is audited once and nothing is repeated each snapshot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpuwatch.core.model import ContainerIdentity

log = logging.getLogger(__name__)
SHARING_RULE = "sharing"
"""The `rule` of audit records and decisions that come from annotations, not policy rules."""


class NodeContainers(Protocol):
    def containers(self) -> Sequence[ContainerIdentity]:
        """Every container cgroup on the node now, with identity (namespace, labels) and
        cgroup id. May raise OSError (the enforcer logs it and goes on with what it knows)."""
        ...


@dataclass
class NodeListing:
    """Calls a NodeContainers when asked, at most every `min_interval_s` unless `now` is set;
    failures are logged once per distinct error and give an empty list."""

    source: NodeContainers | None
    min_interval_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    last: tuple[ContainerIdentity, ...] = ()
    last_s: float | None = None
    _errors: set[str] = field(default_factory=set)

    def get(self, now: bool) -> tuple[ContainerIdentity, ...]:
        if self.source is None:
            return ()
        t = self.clock()
        if not now and self.last_s is not None and t - self.last_s < self.min_interval_s:
            return self.last
        try:
            self.last = tuple(self.source.containers())
        except OSError as err:
            if str(err) not in self._errors:
                self._errors.add(str(err))
                log.warning("cannot list the node's containers (the exclusive gate covers only "
                            "containers seen using a GPU): %s", err)
            self.last = ()
        self.last_s = t
        return self.last


@dataclass
class SharingLedger:
    """Per container key: GPUs denied for exclusivity (as applied or, in a dry run, recorded),
    suppressed denials already audited, failed ones already audited, and the annotation
    throttles started."""

    denied: dict[str, tuple[int, ...]] = field(default_factory=dict)
    identities: dict[str, ContainerIdentity] = field(default_factory=dict)
    suppressed: dict[str, tuple[int, ...]] = field(default_factory=dict)
    failed: dict[str, tuple[int, ...]] = field(default_factory=dict)
    throttles: dict[str, float] = field(default_factory=dict)
    throttle_identities: dict[str, ContainerIdentity] = field(default_factory=dict)
    throttle_failed: dict[str, float] = field(default_factory=dict)
    last_seen_s: dict[str, float] = field(default_factory=dict)
    said: set[str] = field(default_factory=set)

    def say_once(self, topic: str, message: str, *args: object) -> None:
        """Log a warning once per topic for the life of the enforcer."""
        if topic not in self.said:
            self.said.add(topic)
            log.warning(message, *args)
