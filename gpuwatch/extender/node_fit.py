"""Filter and prioritize: where a GPU pod fits, and where it fits best (pure; no I/O).

Per node (`evaluate`):
* the node must have fresh gpuwatch data (newer than `max_data_age_s`) and NVML up;
* a GPU is a candidate when it is healthy, not held by an exclusive pod, and
  - exclusive: has no tenant (in a pod or not: processes outside any pod count, and the
    reason names them) and no promise,
  - shared: its free memory minus the safety margin (max(`margin_bytes`, `margin_ratio`
    of its size)) minus memory promised to pods not yet visible fits the per-GPU request;
* `auto` (KubeGPU's adaptive mode choice): exclusive on idle GPUs when one is idle or the
  request is large (at least half a GPU's memory or time), else shared on the
  least-loaded GPUs that fit; a large request with no idle GPU does not fit;
* the pod's namespace stays within its GPU memory quota (the policy's quota the agents
  export; whole GPUs count with their size);
* remote-GPU pods (`gpuwatch.io/remote-gpu`) take no local GPU: a node fits when a NIC is up.
Failures carry a sentence a person can act on ("GPU 3 unhealthy: XID 79", "largest free
GPU memory 6.1 GiB < 8 GiB", "namespace ml-research at 16/16 GiB quota"); failures no
preemption can cure (unhealthy or too small GPUs, too few GPUs, no data) are unresolvable.

Score (0..1, scaled to 0..10 by the server):
* binpack: fullest GPUs that still fit (and fuller nodes), so whole GPUs and nodes stay
  free for big jobs; spread: the opposite;
* multi-GPU pods: the GPU set with the best sum of NVIDIA allocator pair scores
  (gpuwatch_gpu_pair_score), normalised by the best set among the candidate nodes, blended
  half and half with packing;
* remote-GPU pods: network headroom (fastest NIC's speed minus the node's recent
  throughput) over the best candidate's, +0.2 with RDMA.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuwatch.cluster.values import ClusterGpu, ClusterNode, ClusterState
from gpuwatch.extender.promises import Promise
from gpuwatch.extender.request import GpuRequest, Sharing, format_bytes
from gpuwatch.policy.placement import GpuLoad, choose_gpu

LARGE_FRACTION = 0.5
MAX_EXACT_SET_GPUS = 10  # exact best GPU set up to this many candidates, greedy beyond


@dataclass(frozen=True)
class PlacementConfig:
    policy: str = "binpack"  # or "spread"
    margin_bytes: int = 512 * 2**20
    margin_ratio: float = 0.02
    max_data_age_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """One node's answer for one pod."""

    node: str
    fits: bool
    reason: str = ""  # why not (fits False)
    unresolvable: bool = False
    gpus: tuple[int, ...] = ()  # the GPUs it would take
    mode: Sharing = Sharing.SHARED  # the sharing mode it would run in (auto resolved)
    packing: float = 0.0  # 0..1, already oriented to the policy (higher = better)
    topology: float = 0.0  # raw pair-score sum of `gpus`
    network: float = 0.0  # raw headroom in bytes/s (remote pods)
    rdma: bool = False

    @property
    def detail(self) -> str:
        if not self.fits:
            return f"{self.node}: no ({self.reason})"
        return (f"{self.node}: GPUs {list(self.gpus)} {self.mode.value}, packing {self.packing:.2f}, "
                f"pair sum {self.topology:.0f}, headroom {self.network:.3g} B/s")


@dataclass(frozen=True, slots=True)
class _Gpu:
    gpu: ClusterGpu
    free_bytes: float  # after margin and promises
    tenants: int  # including promised pods
    reason: str  # why it cannot take the pod ("" when it can)


def promised_on(promises: Iterable[Promise]) -> dict[str, dict[int, tuple[int, int]]]:
    """node -> gpu -> (promised bytes, promised pods)."""
    out: dict[str, dict[int, tuple[int, int]]] = {}
    for p in promises:
        per_gpu = out.setdefault(p.node, {})
        for gpu in p.gpus:
            used, pods = per_gpu.get(gpu, (0, 0))
            per_gpu[gpu] = (used + p.bytes_per_gpu, pods + 1)
    return out


def _unhealthy_text(gpu: ClusterGpu) -> str:
    if gpu.reason == "xid" and gpu.xid is not None:
        return f"GPU {gpu.index} unhealthy: XID {gpu.xid}"
    return f"GPU {gpu.index} unhealthy: {gpu.reason}"


def _margin(gpu: ClusterGpu, config: PlacementConfig) -> float:
    return max(config.margin_bytes, config.margin_ratio * (gpu.memory_total_bytes or 0))


def _resolve_mode(request: GpuRequest, gpus: Sequence[ClusterGpu], promised: Mapping[int, tuple[int, int]]) -> Sharing:
    if request.sharing is not Sharing.AUTO:
        return request.sharing
    idle = sum(1 for g in gpus if g.healthy and not g.exclusive and g.tenants == 0 and g.index not in promised)
    sizes = [g.memory_total_bytes for g in gpus if g.memory_total_bytes]
    large = (request.share is not None and request.share >= LARGE_FRACTION) or (
        request.memory_bytes is not None and bool(sizes) and request.memory_bytes >= LARGE_FRACTION * min(sizes))
    if large or idle >= request.gpus:
        return Sharing.EXCLUSIVE
    return Sharing.SHARED


def evaluate(request: GpuRequest, node: ClusterNode | None, state: ClusterState,
             promised: Mapping[str, dict[int, tuple[int, int]]], namespace_promised_bytes: float,
             config: PlacementConfig, now_s: float, name: str = "") -> Verdict:
    """Can `node` take the pod, on which GPUs, and how good a fit is it (before normalisation)."""
    name = node.name if node is not None else name
    if node is None:
        return Verdict(name, False, f"no gpuwatch data for node {name} (is the agent running and scraped?)", True)
    if node.last_scrape_s is not None and now_s - node.last_scrape_s > config.max_data_age_s:
        return Verdict(name, False, f"gpuwatch data for {name} is {now_s - node.last_scrape_s:.0f} s old "
                                    f"(bound {config.max_data_age_s:.0f} s)", True)
    if request.remote:
        if node.network_speed_bytes is None:
            return Verdict(name, False, "remote GPU pod: no NIC up with a known speed", True)
        headroom = max(0.0, node.network_speed_bytes - (node.network_throughput_bytes or 0.0))
        return Verdict(name, True, mode=request.sharing, network=headroom, rdma=node.rdma)
    if not node.backend_up:
        return Verdict(name, False, f"NVML is down on {name}", True)
    if not node.gpus:
        return Verdict(name, False, "no GPUs", True)
    node_promised = promised.get(name, {})
    mode = _resolve_mode(request, node.gpus, node_promised)
    candidates = [_judge_gpu(g, request, mode, node_promised.get(g.index, (0, 0)), config) for g in node.gpus]
    fitting = [c for c in candidates if not c.reason]
    if len(fitting) < request.gpus:
        return _no_fit(name, request, mode, candidates, len(fitting))
    chosen = _best_set(fitting, request.gpus, node, config.policy)
    quota = _quota_problem(request, chosen, state, namespace_promised_bytes)
    if quota:
        return Verdict(name, False, quota, False)
    return Verdict(name, True, gpus=tuple(c.gpu.index for c in chosen), mode=mode,
                   packing=_packing(request, chosen, node, config.policy),
                   topology=_pair_sum([c.gpu.index for c in chosen], node))


def _judge_gpu(gpu: ClusterGpu, request: GpuRequest, mode: Sharing, promised: tuple[int, int],
               config: PlacementConfig) -> _Gpu:
    promised_bytes, promised_pods = promised
    tenants = gpu.tenants + promised_pods
    free = (gpu.memory_free_bytes if gpu.memory_free_bytes is not None else 0.0) - _margin(gpu, config) \
        - promised_bytes
    if not gpu.healthy:
        return _Gpu(gpu, free, tenants, _unhealthy_text(gpu))
    if gpu.exclusive:
        return _Gpu(gpu, free, tenants, f"GPU {gpu.index} is held exclusively")
    need = request.memory_bytes or 0
    if gpu.memory_total_bytes is not None and need > gpu.memory_total_bytes - _margin(gpu, config):
        return _Gpu(gpu, free, tenants, f"GPU {gpu.index} is too small ({format_bytes(gpu.memory_total_bytes)})")
    if mode is Sharing.EXCLUSIVE and (tenants or gpu.outside_pod):
        tenants = max(tenants, len(gpu.outside_pod))
        reason = f"GPU {gpu.index} has {tenants} tenant{'s' if tenants != 1 else ''}"
        if gpu.outside_pod:  # name what blocks it: no pod to evict, someone must stop the process
            reason += ": " + ", ".join(p.describe() for p in gpu.outside_pod[:2])
            reason += f" and {len(gpu.outside_pod) - 2} more" if len(gpu.outside_pod) > 2 else ""
        return _Gpu(gpu, free, tenants, reason)
    if gpu.memory_free_bytes is None:
        return _Gpu(gpu, free, tenants, f"GPU {gpu.index} free memory unknown")
    if need and free < need:
        return _Gpu(gpu, free, tenants, f"GPU {gpu.index} has {format_bytes(max(free, 0))} free")
    if not need and free <= 0:
        return _Gpu(gpu, free, tenants, f"GPU {gpu.index} is full")
    return _Gpu(gpu, free, tenants, "")


def _no_fit(name: str, request: GpuRequest, mode: Sharing, candidates: Sequence[_Gpu], fitting: int) -> Verdict:
    unhealthy = [c for c in candidates if not c.gpu.healthy]
    too_small = [c for c in candidates if "too small" in c.reason]
    usable = len(candidates) - len(unhealthy) - len(too_small)
    unresolvable = usable < request.gpus  # no eviction can make these fit
    if unresolvable:
        reason = "; ".join(c.reason for c in (*unhealthy, *too_small))
        if len(candidates) < request.gpus:
            reason = f"needs {request.gpus} GPUs, the node has {len(candidates)}" + (f"; {reason}" if reason else "")
    elif request.gpus == 1 and request.memory_bytes and mode is not Sharing.EXCLUSIVE:
        healthy = [c for c in candidates if c.gpu.healthy and not c.gpu.exclusive]
        largest = max((c.free_bytes for c in healthy), default=0.0)
        reason = (f"largest free GPU memory {format_bytes(max(largest, 0))} < {format_bytes(request.memory_bytes)}"
                  f" (after the safety margin and memory promised to pods on their way)")
        if unhealthy:
            reason += "; " + "; ".join(c.reason for c in unhealthy)
    else:
        wanted = "idle GPUs" if mode is Sharing.EXCLUSIVE else "GPUs"
        if request.memory_bytes:
            wanted += f" with {format_bytes(request.memory_bytes)} free"
        why = ", ".join(c.reason for c in candidates if c.reason)
        reason = f"needs {request.gpus} {wanted}, {fitting} of {len(candidates)} fit ({why})"
        if request.sharing is Sharing.AUTO and mode is Sharing.EXCLUSIVE:
            reason += "; auto mode: a large request runs exclusive"
    return Verdict(name, False, reason, unresolvable, mode=mode)


def _quota_problem(request: GpuRequest, chosen: Sequence[_Gpu], state: ClusterState,
                   namespace_promised_bytes: float) -> str:
    quota = state.namespace_quota_bytes.get(request.namespace)
    if quota is None:
        return ""
    if request.memory_bytes is not None:
        asks = float(request.total_memory_bytes)
    else:
        asks = float(sum(c.gpu.memory_total_bytes or 0 for c in chosen))
    used = state.namespace_memory_bytes.get(request.namespace, 0.0) + namespace_promised_bytes
    if used + asks > quota:
        return (f"namespace {request.namespace} at {format_bytes(used)}/{format_bytes(quota)} quota "
                f"(the pod asks {format_bytes(asks)} more)")
    return ""


def _packing(request: GpuRequest, chosen: Sequence[_Gpu], node: ClusterNode, policy: str) -> float:
    """How full the chosen GPUs (70 %) and the node (30 %) are after placing the pod; 1 = full."""
    need = request.memory_bytes
    fullness = []
    for c in chosen:
        total = c.gpu.memory_total_bytes or 0
        if total <= 0:
            continue
        taken = total if need is None and request.sharing is Sharing.EXCLUSIVE else (need or 0)
        fullness.append(min(1.0, (total - c.free_bytes + taken) / total))
    gpu_part = sum(fullness) / len(fullness) if fullness else 0.0
    totals = sum(g.memory_total_bytes or 0 for g in node.gpus)
    used = sum((g.memory_total_bytes or 0) - (g.memory_free_bytes or 0) for g in node.gpus)
    node_part = min(1.0, used / totals) if totals else 0.0
    full = 0.7 * gpu_part + 0.3 * node_part
    return full if policy == "binpack" else 1.0 - full


def _pair_sum(indices: Sequence[int], node: ClusterNode) -> float:
    if len(indices) < 2:
        return 0.0
    scores = {(a, b): s for a, b, s in node.pair_scores}
    return sum(scores.get((a, b), 0.0) for a, b in itertools.combinations(indices, 2))


def _best_set(fitting: Sequence[_Gpu], k: int, node: ClusterNode, policy: str) -> list[_Gpu]:
    """The k GPUs to take: one GPU by the node's placement rule (policy/placement.py, the rule
    bench_sharing places its jobs by); several by the best pair-score sum, ties broken by the
    packing policy."""
    if k <= 1:
        loads = [GpuLoad(i, int(c.free_bytes), 0, c.tenants) for i, c in enumerate(fitting)]
        chosen_index = choose_gpu(0, loads, policy=policy, queue_on_gpu=False)
        return [] if chosen_index is None else [fitting[chosen_index]]

    def order(c: _Gpu) -> float:  # binpack: least free first; spread: most free first
        return c.free_bytes if policy == "binpack" else -c.free_bytes

    ranked = sorted(fitting, key=order)
    scores = {(a, b): s for a, b, s in node.pair_scores}
    if len(ranked) <= MAX_EXACT_SET_GPUS:
        best = max(itertools.combinations(ranked, k),
                   key=lambda combo: sum(scores.get((a.gpu.index, b.gpu.index), 0.0)
                                         for a, b in itertools.combinations(combo, 2)))
        return list(best)
    chosen = [ranked[0]]  # greedy: add the GPU that links best to those already chosen
    rest = ranked[1:]
    while len(chosen) < k:
        pick = max(rest, key=lambda c: sum(scores.get((x.gpu.index, c.gpu.index), 0.0) for x in chosen))
        chosen.append(pick)
        rest.remove(pick)
    return chosen


def scores_of(request: GpuRequest, verdicts: Sequence[Verdict]) -> dict[str, float]:
    """0..1 per fitting node: packing, blended with topology (multi-GPU) or network (remote)."""
    fits = [v for v in verdicts if v.fits]
    if not fits:
        return {}
    if request.remote:
        best = max(v.network for v in fits) or 1.0
        return {v.node: min(1.0, 0.8 * v.network / best + (0.2 if v.rdma else 0.0)) for v in fits}
    if request.gpus > 1:
        best_topology = max(v.topology for v in fits)
        return {v.node: 0.5 * v.packing + 0.5 * (v.topology / best_topology if best_topology > 0 else 1.0)
                for v in fits}
    return {v.node: v.packing for v in fits}
