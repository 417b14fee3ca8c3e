"""Extender decisions on hand-built cluster views: pod requests, filter reasons, binpack vs
spread, topology for multi-GPU pods, exclusive, auto, quota, promises, remote GPUs, and the
wire format kube-scheduler sends and expects."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.cluster.values import ClusterContainer, ClusterGpu, ClusterNode, ClusterState
from gpuwatch.extender.node_fit import PlacementConfig
from gpuwatch.extender.promises import Promises
from gpuwatch.extender.request import BadRequest, Sharing, parse_pod, parse_quantity
from gpuwatch.extender.service import Extender, parse_args

GIB = 2**30
NOW = 1_800_000_000.0
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "extender"


def gpu(node: str, index: int, free_gib: float, total_gib: float = 80, **kw: Any) -> ClusterGpu:
    return ClusterGpu(node=node, index=index, uuid=f"GPU-{node}-{index}", model="H100",
                      memory_total_bytes=total_gib * GIB, memory_used_bytes=(total_gib - free_gib) * GIB,
                      memory_free_bytes=free_gib * GIB, utilization_ratio=0.1, **kw)


def node(name: str, gpus: list[ClusterGpu], pairs: dict[tuple[int, int], float] | None = None,
         **kw: Any) -> ClusterNode:
    scores = tuple((a, b, s) for (a, b), s in (pairs or {}).items()) + tuple(
        (b, a, s) for (a, b), s in (pairs or {}).items())
    kw.setdefault("last_scrape_s", NOW - 2)
    return ClusterNode(name=name, gpus=tuple(gpus), pair_scores=scores, **kw)


class Static:
    def __init__(self, state: ClusterState) -> None:
        self.value = state

    def state(self, pod_uids: object = ()) -> ClusterState:
        return self.value


def cluster(*nodes: ClusterNode, **kw: Any) -> ClusterState:
    return ClusterState(nodes={n.name: n for n in nodes}, fetched_at_s=NOW, **kw)


def pod(annotations: dict[str, str] | None = None, gpus: int | str | None = None, ns: str = "ml",
        uid: str = "uid-1") -> dict[str, Any]:
    limits = {"nvidia.com/gpu": str(gpus)} if gpus is not None else {}
    return {"metadata": {"name": "p", "namespace": ns, "uid": uid, "annotations": annotations or {}},
            "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]}}


def extender(state: ClusterState, policy: str = "binpack", promises: Promises | None = None) -> Extender:
    return Extender(Static(state), PlacementConfig(policy=policy),
                    promises if promises is not None else Promises(clock=lambda: 0.0),
                    clock=lambda: NOW)


def run_filter(ext: Extender, p: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return ext.filter({"Pod": p, "NodeNames": names})


def scores(ext: Extender, p: dict[str, Any], names: list[str]) -> dict[str, int]:
    return {h["Host"]: h["Score"] for h in ext.prioritize({"Pod": p, "NodeNames": names})}


# ---- requests ----------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "value"), [("8Gi", 8 * GIB), ("1.5Gi", 1.5 * GIB), ("8G", 8e9), ("1e9", 1e9),
                                             ("512Mi", 512 * 2**20), ("1024", 1024), ("500m", 0.5)])
def test_quantities(text: str, value: float) -> None:
    assert float(parse_quantity(text)) == value


def test_pod_requests() -> None:
    r = parse_pod(pod(gpus=2))
    assert (r.gpus, r.memory_bytes, r.sharing) == (2, None, Sharing.EXCLUSIVE)
    r = parse_pod(pod({"gpuwatch.io/gpu-memory": "8Gi"}))
    assert (r.gpus, r.memory_bytes, r.sharing) == (1, 8 * GIB, Sharing.SHARED)
    r = parse_pod(pod({"gpuwatch.io/gpu-share": "0.25", "gpuwatch.io/sharing": "AUTO"}))
    assert (r.gpus, r.share, r.sharing) == (1, 0.25, Sharing.AUTO)
    assert not parse_pod(pod()).wants_gpu
    assert parse_pod(pod({"gpuwatch.io/remote-gpu": "true"})).remote


@pytest.mark.parametrize(("annotations", "gpus", "needle"), [
    ({"gpuwatch.io/gpu-memory": "8 gigs"}, None, "gpu-memory"),
    ({"gpuwatch.io/gpu-memory": "-1Gi"}, None, "gpu-memory"),
    ({"gpuwatch.io/gpu-share": "1.5"}, None, "(0, 1]"),
    ({"gpuwatch.io/gpu-share": "half"}, None, "gpu-share"),
    ({"gpuwatch.io/sharing": "sometimes"}, None, "exclusive, shared, auto"),
    ({"gpuwatch.io/remote-gpu": "maybe"}, None, "remote-gpu"),
    ({"gpuwatch.io/gpu-share": "0.5", "gpuwatch.io/sharing": "exclusive"}, None, "exclusive"),
    ({}, "1.5", "whole number"),
    ({}, "lots", "nvidia.com/gpu"),
])
def test_bad_requests_are_reported_not_guessed(annotations: dict[str, str], gpus: str | None, needle: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_pod(pod(annotations, gpus))
    assert needle in str(info.value)


def test_bad_pod_request_fails_every_node_unresolvably_with_the_reason() -> None:
    ext = extender(cluster(node("a", [gpu("a", 0, 80)])))
    result = run_filter(ext, pod({"gpuwatch.io/gpu-memory": "8 gigs"}), ["a"])
    assert result["NodeNames"] == [] and not result["FailedNodes"]
    assert "gpu-memory" in result["FailedAndUnresolvableNodes"]["a"]


# ---- filter ------------------------------------------------------------------------------

def test_filter_reasons_people_can_act_on() -> None:
    state = cluster(
        node("fits", [gpu("fits", 0, 40)]),
        node("small", [gpu("small", 0, 7.7)]),
        node("sick", [gpu("sick", 0, 80, healthy=False, reason="xid", xid=79),
                      gpu("sick", 1, 80, healthy=False, reason="lost")]),
        node("nvml", [gpu("nvml", 0, 80)], backend_up=False),
        node("stale", [gpu("stale", 0, 80)], last_scrape_s=NOW - 120),
    )
    result = run_filter(extender(state), pod({"gpuwatch.io/gpu-memory": "8Gi"}), [
        "fits", "small", "sick", "nvml", "stale", "unknown"])
    assert result["NodeNames"] == ["fits"]
    assert result["FailedNodes"] == {"small": "largest free GPU memory 6.1 GiB < 8 GiB (after the safety margin "
                                              "and memory promised to pods on their way)"}
    unresolvable = result["FailedAndUnresolvableNodes"]
    assert unresolvable["sick"] == "GPU 0 unhealthy: XID 79; GPU 1 unhealthy: lost"
    assert unresolvable["nvml"] == "NVML is down on nvml"
    assert "120 s old" in unresolvable["stale"]
    assert "no gpuwatch data for node unknown" in unresolvable["unknown"]
    assert result["Error"] == ""


def test_gpu_too_small_is_unresolvable() -> None:
    state = cluster(node("a", [gpu("a", 0, 16, total_gib=16)]))
    result = run_filter(extender(state), pod({"gpuwatch.io/gpu-memory": "20Gi"}), ["a"])
    assert "too small" in result["FailedAndUnresolvableNodes"]["a"]


def test_exclusive_needs_idle_gpus_and_respects_exclusive_holders() -> None:
    state = cluster(
        node("busy", [gpu("busy", 0, 70, tenants=1), gpu("busy", 1, 80, exclusive=True, tenants=1)]),
        node("idle", [gpu("idle", 0, 80), gpu("idle", 1, 80)]),
    )
    ext = extender(state)
    result = run_filter(ext, pod(gpus=1), ["busy", "idle"])
    assert result["NodeNames"] == ["idle"]
    reason = result["FailedNodes"]["busy"]
    assert "needs 1 idle GPUs" in reason and "GPU 0 has 1 tenant" in reason and "held exclusively" in reason
    # a shared pod may join GPU 0 but never the exclusive one
    result = run_filter(ext, pod({"gpuwatch.io/gpu-memory": "8Gi"}), ["busy"])
    assert result["NodeNames"] == ["busy"]


def test_auto_mode_large_requests_need_an_idle_gpu() -> None:
    state = cluster(node("a", [gpu("a", 0, 70, tenants=2)]))
    ext = extender(state)
    small = pod({"gpuwatch.io/gpu-memory": "4Gi", "gpuwatch.io/sharing": "auto"})
    large = pod({"gpuwatch.io/gpu-memory": "48Gi", "gpuwatch.io/sharing": "auto"})
    assert run_filter(ext, small, ["a"])["NodeNames"] == ["a"]
    result = run_filter(ext, large, ["a"])
    assert result["NodeNames"] == [] and "auto mode" in result["FailedNodes"]["a"]


def test_namespace_quota() -> None:
    state = cluster(node("a", [gpu("a", 0, 80)]), namespace_memory_bytes={"ml": 16 * GIB},
                    namespace_quota_bytes={"ml": 16 * GIB})
    result = run_filter(extender(state), pod({"gpuwatch.io/gpu-memory": "8Gi"}), ["a"])
    assert result["FailedNodes"]["a"] == "namespace ml at 16 GiB/16 GiB quota (the pod asks 8 GiB more)"
    other = run_filter(extender(state), pod({"gpuwatch.io/gpu-memory": "8Gi"}, ns="web"), ["a"])
    assert other["NodeNames"] == ["a"]


def test_pods_without_gpu_pass_untouched() -> None:
    ext = extender(cluster())
    assert run_filter(ext, pod(), ["x", "y"])["NodeNames"] == ["x", "y"]


def test_no_data_or_stale_data_is_an_error_for_ignorable_extenders() -> None:
    result = run_filter(extender(cluster()), pod(gpus=1), ["a"])
    assert "no gpuwatch data" in result["Error"]
    stale = cluster(node("a", [gpu("a", 0, 80)], last_scrape_s=NOW - 300))
    assert "300 s old" in run_filter(extender(stale), pod(gpus=1), ["a"])["Error"]


# ---- prioritize --------------------------------------------------------------------------

def test_binpack_prefers_fuller_nodes_spread_the_emptier() -> None:
    state = cluster(node("full", [gpu("full", 0, 20)]), node("empty", [gpu("empty", 0, 80)]))
    p = pod({"gpuwatch.io/gpu-memory": "8Gi"})
    packed = scores(extender(state, "binpack"), p, ["full", "empty"])
    spread = scores(extender(state, "spread"), p, ["full", "empty"])
    assert packed["full"] > packed["empty"]
    assert spread["empty"] > spread["full"]
    assert all(0 <= s <= 10 for s in (*packed.values(), *spread.values()))


@pytest.mark.parametrize(("policy", "expected_gpu"), [("binpack", 1), ("spread", 2)])
def test_within_a_node_the_gpu_is_chosen_by_the_nodes_placement_rule(policy: str, expected_gpu: int) -> None:
    """One GPU of a node: the fullest that fits (binpack) or the emptiest (spread) -- the rule
    of gpuwatch/policy/placement.py that bench_sharing places its jobs by."""
    gpus = [gpu("n", 0, 6), gpu("n", 1, 12), gpu("n", 2, 70), gpu("n", 3, 40)]
    ext = extender(cluster(node("n", gpus)), policy)
    assert scores(ext, pod({"gpuwatch.io/gpu-memory": "8Gi"}), ["n"])  # it fits
    assert ext.promises.current()[0].gpus == (expected_gpu,)  # GPU 0's 6 GiB is too little


def test_two_gpu_pods_go_where_the_gpus_are_linked() -> None:
    gpus = lambda n: [gpu(n, i, 80) for i in range(4)]  # noqa: E731
    nvlink = node("nvlink", gpus("nvlink"), pairs={(0, 1): 450, (2, 3): 450, (0, 2): 10, (0, 3): 10, (1, 2): 10,
                                                    (1, 3): 10})
    pcie = node("pcie", gpus("pcie"), pairs={(a, b): 50 if a // 2 == b // 2 else 10
                                              for a in range(4) for b in range(a + 1, 4)})
    ext = extender(cluster(nvlink, pcie))
    result = scores(ext, pod(gpus=2), ["pcie", "nvlink"])
    assert result["nvlink"] > result["pcie"]
    promise = ext.promises.current()[0]
    assert (promise.node, set(promise.gpus), promise.exclusive) == ("nvlink", {0, 1}, True)


def test_promised_memory_counts_until_the_pod_shows_up() -> None:
    clock = [0.0]
    promises = Promises(ttl_s=10, clock=lambda: clock[0])
    state = cluster(node("a", [gpu("a", 0, 20)]), node("b", [gpu("b", 0, 40)]))
    ext = extender(state, promises=promises)
    first = pod({"gpuwatch.io/gpu-memory": "10Gi"}, uid="first")
    second = pod({"gpuwatch.io/gpu-memory": "10Gi"}, uid="second")
    assert scores(ext, first, ["a", "b"])["a"] >= 0
    assert [p.node for p in promises.current()] == ["a"]
    # a has 20 GiB free minus 10 promised minus the margin: the second pod no longer fits there
    result = run_filter(ext, second, ["a", "b"])
    assert "a" in result["FailedNodes"] and result["NodeNames"] == ["b"]
    # re-scoring the first pod itself does not count its own promise against it
    assert run_filter(ext, first, ["a"])["NodeNames"] == ["a"]
    # the pod shows up in a's metrics: promise settled
    arrived = dataclasses.replace(state.nodes["a"], containers=(ClusterContainer(
        node="a", gpu=0, namespace="ml", pod="p", pod_uid="first", container="c", container_id="x",
        memory_bytes=10 * GIB),))
    ext_state = ClusterState(nodes={**state.nodes, "a": arrived}, fetched_at_s=NOW)
    Extender(Static(ext_state), promises=promises, clock=lambda: NOW).filter({"Pod": second, "NodeNames": ["a"]})
    assert promises.current() == []
    # or expires
    scores(ext, first, ["a", "b"])
    clock[0] = 11
    assert promises.current() == []


def test_remote_gpu_pods_score_network_headroom() -> None:
    state = cluster(
        node("fast-busy", [], network_speed_bytes=12.5e9, network_throughput_bytes=11e9),
        node("fast-idle", [], network_speed_bytes=12.5e9, network_throughput_bytes=1e8, rdma=True),
        node("no-nic", []),
    )
    ext = extender(state)
    p = pod({"gpuwatch.io/remote-gpu": "true"})
    result = run_filter(ext, p, ["fast-busy", "fast-idle", "no-nic"])
    assert result["NodeNames"] == ["fast-busy", "fast-idle"]
    ranked = scores(ext, p, ["fast-busy", "fast-idle", "no-nic"])
    assert ranked["fast-idle"] == 10 and ranked["fast-busy"] < ranked["fast-idle"] and ranked["no-nic"] == 0


# ---- wire format -------------------------------------------------------------------------

def test_kube_scheduler_fixtures_nodenames_and_nodelist() -> None:
    state = cluster(node("gpu-a", [gpu("gpu-a", 0, 4), gpu("gpu-a", 1, 5)]),
                    node("gpu-b", [gpu("gpu-b", 0, 60), gpu("gpu-b", 1, 70)]),
                    node("gpu-c", [gpu("gpu-c", 0, 30, healthy=False, reason="xid", xid=48), gpu("gpu-c", 1, 9)]))
    ext = extender(state)
    names = json.loads((FIXTURES / "filter_nodenames.json").read_text())
    result = ext.filter(names)
    assert result["NodeNames"] == ["gpu-b"] and result["Nodes"] is None
    assert set(result["FailedNodes"]) == {"gpu-a", "gpu-c"}  # gpu-c: 9 GiB free minus the margin
    assert "GPU 0 unhealthy: XID 48" in result["FailedNodes"]["gpu-c"]
    full = json.loads((FIXTURES / "filter_nodelist.json").read_text())
    result = ext.filter(full)
    assert result["NodeNames"] is None
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["gpu-b"]
    assert result["Nodes"]["items"][0] == full["Nodes"]["items"][1]  # the Node object comes back unchanged
    assert set(result) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    ranked = ext.prioritize(names)
    assert [set(h) for h in ranked] == [{"Host", "Score"}] * 3
    assert json.loads(json.dumps(ranked))  # plain JSON


@pytest.mark.parametrize("body", [[], {"Pod": None, "NodeNames": []}, {"Pod": {}}, {"Pod": {}, "NodeNames": [1]},
                                  {"Pod": {}, "Nodes": {"items": [{"metadata": {}}]}}, {"Pod": {}, "Nodes": []}])
def test_malformed_args_raise_bad_request(body: Any) -> None:
    with pytest.raises(BadRequest):
        parse_args(body)


def test_field_names_match_case_insensitively_like_go() -> None:
    _, names, items = parse_args({"pod": pod(gpus=1), "nodenames": ["a"]})
    assert names == ["a"] and items is None
