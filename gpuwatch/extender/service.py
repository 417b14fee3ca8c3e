"""The extender's two verbs over kube-scheduler's wire types (k8s.io/kube-scheduler/extender/v1).

Those Go structs carry no json tags, so on the wire the field names are the Go names:
ExtenderArgs {"Pod", "Nodes", "NodeNames"}; ExtenderFilterResult {"Nodes", "NodeNames",
"FailedNodes", "FailedAndUnresolvableNodes", "Error"}; HostPriorityList
[{"Host", "Score"}] with scores 0..MaxExtenderPriority (10). Go decodes field names case-
insensitively, so requests are read the same way; answers use the exact Go names. The Pod
and Nodes inside are ordinary Kubernetes objects (camelCase json).

With `nodeCacheCapable: true` kube-scheduler sends NodeNames and expects NodeNames back;
otherwise it sends a NodeList and expects the passing Node objects back unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

from gpuwatch.cluster.values import ClusterState
from gpuwatch.core.errors import GpuwatchError
from gpuwatch.extender.node_fit import PlacementConfig, Verdict, evaluate, promised_on, scores_of
from gpuwatch.extender.promises import Promises
from gpuwatch.extender.request import BadRequest, GpuRequest, Sharing, parse_pod

log = logging.getLogger(__name__)

MAX_EXTENDER_PRIORITY = 10
MAX_NODES = 20_000


class ClusterSource(Protocol):
    """Where the cluster view comes from (gpuwatch.cluster.source over Prometheus in production).
    `pod_uids`: pods with promised memory, whose arrival the view should show."""

    def state(self, pod_uids: Collection[str] = ()) -> ClusterState: ...


class StaleData(GpuwatchError):
    """Prometheus answered, but the gpuwatch data in it is too old to place pods by."""


def _field(obj: Mapping[str, Any], name: str) -> Any:
    """obj[name] matched case-insensitively, as Go's encoding/json matches field names."""
    if name in obj:
        return obj[name]
    lowered = name.lower()
    for key, value in obj.items():
        if isinstance(key, str) and key.lower() == lowered:
            return value
    return None


def parse_args(body: Any) -> tuple[Any, list[str], list[dict[str, Any]] | None]:
    """(pod, candidate node names, the Node objects when sent as a NodeList). Raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("ExtenderArgs must be a JSON object")
    pod = _field(body, "Pod")
    if not isinstance(pod, dict):
        raise BadRequest("ExtenderArgs.Pod is missing or not an object")
    names = _field(body, "NodeNames")
    nodes = _field(body, "Nodes")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BadRequest("ExtenderArgs.NodeNames must be a list of strings")
        if len(names) > MAX_NODES:
            raise BadRequest(f"ExtenderArgs.NodeNames has {len(names)} nodes (at most {MAX_NODES})")
        return pod, list(names), None
    if nodes is None:
        raise BadRequest("ExtenderArgs has neither Nodes nor NodeNames")
    if not isinstance(nodes, dict):
        raise BadRequest("ExtenderArgs.Nodes must be a NodeList object")
    items = nodes.get("items") or []
    if not isinstance(items, list) or len(items) > MAX_NODES:
        raise BadRequest(f"ExtenderArgs.Nodes.items must be a list (at most {MAX_NODES} nodes)")
    node_names = []
    for i, item in enumerate(items):
        meta = item.get("metadata") if isinstance(item, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(name, str) or not name:
            raise BadRequest(f"ExtenderArgs.Nodes.items[{i}] has no metadata.name")
        node_names.append(name)
    return pod, node_names, items


class Extender:
    """filter / prioritize over a cluster view; thread-safe (one instance serves all requests)."""

    def __init__(self, source: ClusterSource, config: PlacementConfig | None = None,
                 promises: Promises | None = None, clock: Callable[[], float] = time.time) -> None:
        self._source = source
        self.config = config or PlacementConfig()
        self.promises = promises if promises is not None else Promises()
        self._clock = clock
        self._lock = threading.Lock()
        # kube-scheduler sends prioritize the nodes filter just passed, for the same pod and,
        # within a second, the same cluster view: the verdicts are reused, not recomputed
        self._recent: dict[tuple[GpuRequest, int], tuple[ClusterState, dict[str, Verdict]]] = {}

    # ---- the verbs ----------------------------------------------------------------------

    def filter(self, body: Any) -> dict[str, Any]:
        """ExtenderFilterResult for one ExtenderArgs. BadRequest for malformed arguments."""
        pod, names, items = parse_args(body)
        try:
            request = parse_pod(pod)
        except BadRequest as err:
            message = f"pod GPU request: {err}"
            return self._filter_result([], names, items, {}, dict.fromkeys(names, message))
        if not request.wants_gpu:
            return self._filter_result(names, names, items, {}, {})
        try:
            state = self._fresh_state()
        except GpuwatchError as err:
            log.warning("filter %s/%s: %s", request.namespace, request.name, err)
            return {"Nodes": None, "NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": {},
                    "Error": f"gpuwatch extender: {err}"}
        verdicts = self._verdicts(request, names, state)
        passed = [v.node for v in verdicts if v.fits]
        failed = {v.node: v.reason for v in verdicts if not v.fits and not v.unresolvable}
        unresolvable = {v.node: v.reason for v in verdicts if not v.fits and v.unresolvable}
        if log.isEnabledFor(logging.DEBUG):
            for verdict in verdicts:
                log.debug("filter %s/%s (%s): %s", request.namespace, request.name, request.describe(), verdict.detail)
        return self._filter_result(passed, names, items, failed, unresolvable)

    def prioritize(self, body: Any) -> list[dict[str, Any]]:
        """HostPriorityList (scores 0..10) for one ExtenderArgs. GpuwatchError when no data."""
        pod, names, _ = parse_args(body)
        try:
            request = parse_pod(pod)
        except BadRequest:
            return [{"Host": n, "Score": 0} for n in names]
        if not request.wants_gpu:
            return [{"Host": n, "Score": 0} for n in names]
        state = self._fresh_state()
        verdicts = self._verdicts(request, names, state)
        scores = scores_of(request, verdicts)
        # the best candidate gets 10 and the others in proportion: kube-scheduler ranks by
        # these integers, and 0..1 values close together would otherwise round alike
        best = max(scores.values(), default=0.0)
        result = [{"Host": n, "Score": max(0, min(MAX_EXTENDER_PRIORITY, round(
            MAX_EXTENDER_PRIORITY * scores.get(n, 0.0) / best) if best > 0 else 0))} for n in names]
        if log.isEnabledFor(logging.DEBUG):
            for verdict in verdicts:
                log.debug("prioritize %s/%s (%s): %s -> %.2f", request.namespace, request.name,
                          request.describe(), verdict.detail, scores.get(verdict.node, 0.0))
        self._promise(request, verdicts, scores, state)
        return result

    # ---- internals ----------------------------------------------------------------------

    def _fresh_state(self) -> ClusterState:
        state = self._source.state([p.pod_uid for p in self.promises.current()])
        self.promises.settle(state)
        if not state.nodes:
            raise StaleData("Prometheus has no gpuwatch data",
                            fix="check that Prometheus scrapes the agents (gpuwatch_gpu_backend_up)")
        newest = max((n.last_scrape_s for n in state.nodes.values() if n.last_scrape_s is not None), default=None)
        if newest is None:  # nodes known only from static facts (GPU sizes): nobody is scraped now
            raise StaleData("Prometheus has no current gpuwatch data (no agent is being scraped)",
                            fix="check that Prometheus scrapes the agents (gpuwatch_gpu_backend_up)")
        now = self._clock()
        if now - newest > self.config.max_data_age_s:
            raise StaleData(f"the newest gpuwatch data in Prometheus is {now - newest:.0f} s old "
                            f"(bound {self.config.max_data_age_s:.0f} s)",
                            fix="check that Prometheus still scrapes the agents")
        return state

    def _verdicts(self, request: GpuRequest, names: Sequence[str], state: ClusterState) -> list[Verdict]:
        key = (request, self.promises.version)
        with self._lock:
            seen_state, known = self._recent.get(key, (None, {}))
        if seen_state is state and all(name in known for name in names):
            return [known[name] for name in names]
        verdicts = self._evaluate(request, names, state)
        with self._lock:
            if len(self._recent) >= 4:  # one pod is scheduled at a time: a few are enough
                self._recent.pop(next(iter(self._recent)))
            self._recent[key] = (state, {v.node: v for v in verdicts})
        return verdicts

    def _evaluate(self, request: GpuRequest, names: Sequence[str], state: ClusterState) -> list[Verdict]:
        promises = self.promises.current(exclude_pod=request.uid)
        promised = promised_on(promises)
        namespace_promised = float(sum(p.bytes_per_gpu * len(p.gpus) for p in promises
                                       if p.namespace == request.namespace))
        now = self._clock()
        return [evaluate(request, state.nodes.get(name), state, promised, namespace_promised, self.config, now,
                         name=name) for name in names]

    def _promise(self, request: GpuRequest, verdicts: Sequence[Verdict], scores: Mapping[str, float],
                 state: ClusterState) -> None:
        if request.remote or not scores:
            return
        best = max((v for v in verdicts if v.fits), key=lambda v: scores.get(v.node, 0.0), default=None)
        if best is None:
            return
        node = state.nodes[best.node]
        sizes = {g.index: g.memory_total_bytes or 0 for g in node.gpus}
        per_gpu = request.memory_bytes if request.memory_bytes is not None else int(
            max((sizes.get(i, 0) for i in best.gpus), default=0))
        self.promises.add(request.uid, request.namespace, best.node, best.gpus, int(per_gpu),
                          best.mode is Sharing.EXCLUSIVE)

    @staticmethod
    def _filter_result(passed: Sequence[str], names: Sequence[str], items: list[dict[str, Any]] | None,
                       failed: dict[str, str], unresolvable: dict[str, str]) -> dict[str, Any]:
        keep = set(passed)
        result: dict[str, Any] = {"FailedNodes": failed, "FailedAndUnresolvableNodes": unresolvable, "Error": ""}
        if items is None:
            result["Nodes"] = None
            result["NodeNames"] = [n for n in names if n in keep]
        else:
            result["Nodes"] = {"metadata": {}, "items": [item for item, name in zip(items, names, strict=True)
                                                          if name in keep]}
            result["NodeNames"] = None
        return result
