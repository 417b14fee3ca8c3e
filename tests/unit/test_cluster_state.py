"""build_state on hand-written query results: every field, missing data, MIG, duplicates,
staleness; and the shape of the query batch."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from gpuwatch.cluster.prometheus import Sample
from gpuwatch.cluster.queries import (
    CLUSTER_QUERIES,
    build_state,
    cluster_queries,
    parse_gpu_label,
    simulated_nodes,
    stale_nodes,
)
from gpuwatch.cluster.values import ClusterContainer, ClusterGpu

NOW = 1_800_000_000.0
GIB = 1024.0**3


def s(value: float, **labels: str) -> Sample:
    return Sample(dict(labels), float(value), NOW)


def gpu_labels(node: str, gpu: str, **extra: str) -> dict[str, str]:
    return {"node": node, "gpu": gpu, **extra}


def ctr(node: str, gpu: str, pod: str, value: float, namespace: str = "ml", container: str = "main",
        cid: str = "") -> Sample:
    return s(value, node=node, gpu=gpu, namespace=namespace, pod=pod, pod_uid=f"uid-{pod}", container=container,
             container_id=cid or f"cid-{pod}-{container}")


def full_results() -> dict[str, list[Any]]:
    """Node a: two GPUs (GPU 1 unhealthy from Xid 79), two containers, NVLink pair, RDMA;
    node b: one GPU, no network data."""
    return {
        "gpu_healthy": [
            s(1, node="a", gpu="0", uuid="GPU-a0", model="H100", reason="ok", xid=""),
            s(0, node="a", gpu="1", uuid="GPU-a1", model="H100", reason="xid", xid="79"),
            s(1, node="b", gpu="0", uuid="GPU-b0", model="A100", reason="ok", xid=""),
        ],
        "gpu_memory_total": [s(80 * GIB, node="a", gpu="0"), s(80 * GIB, node="a", gpu="1"),
                             s(40 * GIB, node="b", gpu="0")],
        "gpu_memory_used": [s(20 * GIB, node="a", gpu="0"), s(0, node="a", gpu="1"), s(1 * GIB, node="b", gpu="0")],
        "gpu_memory_free": [s(60 * GIB, node="a", gpu="0"), s(80 * GIB, node="a", gpu="1"),
                            s(39 * GIB, node="b", gpu="0")],
        "gpu_utilization": [s(0.5, node="a", gpu="0"), s(0.0, node="a", gpu="1"), s(0.25, node="b", gpu="0")],
        "gpu_tenants": [s(2, node="a", gpu="0"), s(0, node="a", gpu="1"), s(1, node="b", gpu="0")],
        "gpu_exclusive": [s(0, node="a", gpu="0"), s(0, node="a", gpu="1"), s(1, node="b", gpu="0")],
        "gpu_container_series": [s(2, node="a", gpu="0"), s(1, node="b", gpu="0")],
        "pair_score": [s(160, node="a", gpu="0", peer="1"), s(160, node="a", gpu="1", peer="0")],
        "backend_up": [s(1, node="a", simulated="false"), s(1, node="b", simulated="true")],
        "last_scrape": [s(NOW - 1.5, node="a"), s(NOW - 3.0, node="b")],
        "network_speed": [s(12.5e9, node="a")],
        "network_throughput": [s(1e6, node="a")],
        "rdma": [s(1, node="a")],
        "container_memory": [ctr("a", "0", "train", 16 * GIB), ctr("a", "0", "nb", 4 * GIB, container="jupyter"),
                             ctr("b", "0", "serve", 1 * GIB, namespace="inf")],
        "container_sm": [ctr("a", "0", "train", 0.4), ctr("a", "0", "nb", 0.1, container="jupyter"),
                         ctr("b", "0", "serve", 0.25, namespace="inf")],
        "container_kernel": [ctr("a", "0", "train", 120.0), ctr("a", "0", "nb", 3.5, container="jupyter"),
                             ctr("b", "0", "serve", 7.0, namespace="inf")],
        "namespace_memory": [s(20 * GIB, namespace="ml"), s(1 * GIB, namespace="inf")],
        "namespace_quota": [s(32 * GIB, namespace="ml")],
    }


def test_every_field_of_the_model_comes_from_its_query() -> None:
    state = build_state(full_results(), NOW)
    assert state.fetched_at_s == NOW
    assert list(state.nodes) == ["a", "b"]
    a, b = state.nodes["a"], state.nodes["b"]
    assert a.gpus[0] == ClusterGpu(node="a", index=0, uuid="GPU-a0", model="H100", memory_total_bytes=80 * GIB,
                                   memory_used_bytes=20 * GIB, memory_free_bytes=60 * GIB, utilization_ratio=0.5,
                                   healthy=True, reason="ok", xid=None, tenants=2, exclusive=False)
    assert a.gpus[1] == ClusterGpu(node="a", index=1, uuid="GPU-a1", model="H100", memory_total_bytes=80 * GIB,
                                   memory_used_bytes=0.0, memory_free_bytes=80 * GIB, utilization_ratio=0.0,
                                   healthy=False, reason="xid", xid=79, tenants=0, exclusive=False)
    assert b.gpus[0].exclusive and b.gpus[0].tenants == 1 and b.gpus[0].model == "A100"
    assert a.pair_scores == ((0, 1, 160.0), (1, 0, 160.0)) and a.pair_score(0, 1) == 160.0
    assert a.backend_up and b.backend_up
    assert a.last_scrape_s == NOW - 1.5 and b.last_scrape_s == NOW - 3.0
    assert a.network_speed_bytes == 12.5e9 and a.network_throughput_bytes == 1e6 and a.rdma
    assert b.network_speed_bytes is None and b.network_throughput_bytes is None and not b.rdma
    assert a.containers == (
        ClusterContainer(node="a", gpu=0, namespace="ml", pod="nb", pod_uid="uid-nb", container="jupyter",
                         container_id="cid-nb-jupyter", memory_bytes=4 * GIB, sm_utilization_ratio=0.1,
                         kernel_seconds_total=3.5),
        ClusterContainer(node="a", gpu=0, namespace="ml", pod="train", pod_uid="uid-train", container="main",
                         container_id="cid-train-main", memory_bytes=16 * GIB, sm_utilization_ratio=0.4,
                         kernel_seconds_total=120.0),
    )
    assert [c.pod for c in b.containers] == ["serve"]
    assert state.namespace_memory_bytes == {"ml": 20 * GIB, "inf": 1 * GIB}
    assert state.namespace_quota_bytes == {"ml": 32 * GIB}
    assert simulated_nodes(full_results()) == {"b"}


def test_plain_tuples_work_as_samples() -> None:
    results = {"backend_up": [({"node": "n", "simulated": "false"}, 1.0, NOW)],
               "container_memory": [({"node": "n", "gpu": "0", "namespace": "x", "pod": "p", "pod_uid": "u",
                                      "container": "c", "container_id": "id"}, 5.0, NOW)]}
    state = build_state(results, NOW)
    assert state.nodes["n"].containers[0].memory_bytes == 5.0


def test_missing_data_is_none_not_zero() -> None:
    results: dict[str, list[Any]] = {
        "backend_up": [s(1, node="bare", simulated="false")],
        # a GPU with health only, one with memory only (no health series), a NaN utilisation
        "gpu_healthy": [s(1, node="n", gpu="0", uuid="U0", model="M", reason="ok", xid="")],
        "gpu_memory_total": [s(8 * GIB, node="n", gpu="3")],
        "gpu_utilization": [s(math.nan, node="n", gpu="0")],
        "container_memory": [ctr("n", "0", "p", 1 * GIB)],
    }
    state = build_state(results, NOW)
    bare = state.nodes["bare"]
    assert bare.gpus == () and bare.containers == () and bare.pair_scores == ()
    assert bare.last_scrape_s is None and bare.network_speed_bytes is None and bare.network_throughput_bytes is None
    assert bare.backend_up and not bare.rdma
    n = state.nodes["n"]
    assert not n.backend_up  # no gpuwatch_gpu_backend_up series: not known to be up
    g0, g3 = n.gpus
    assert (g0.memory_total_bytes, g0.memory_used_bytes, g0.memory_free_bytes, g0.utilization_ratio) == (
        None, None, None, None)
    assert g0.healthy and g0.tenants == 0 and not g0.exclusive
    assert g3.index == 3 and g3.memory_total_bytes == 8 * GIB
    assert not g3.healthy and g3.reason == "unknown" and g3.uuid == ""
    c = n.containers[0]
    assert c.memory_bytes == 1 * GIB and c.sm_utilization_ratio is None and c.kernel_seconds_total is None
    assert state.namespace_memory_bytes == {} and state.namespace_quota_bytes == {}


def test_empty_results_are_an_empty_cluster() -> None:
    state = build_state({}, NOW)
    assert state.nodes == {} and state.fetched_at_s == NOW
    assert build_state({name: [] for name in CLUSTER_QUERIES}, NOW).nodes == {}


def test_mig_series_are_not_physical_gpus_and_containers_add_up_on_the_parent() -> None:
    results: dict[str, list[Any]] = {
        "gpu_healthy": [s(1, node="n", gpu="0", uuid="GPU-0", model="A100", reason="ok", xid=""),
                        s(1, node="n", gpu="0/mig1", uuid="MIG-1", model="A100 MIG 1g.10gb", reason="ok", xid="")],
        "gpu_memory_total": [s(80 * GIB, node="n", gpu="0"), s(10 * GIB, node="n", gpu="0/mig1"),
                             s(10 * GIB, node="n", gpu="0/mig2")],
        "gpu_tenants": [s(5, node="n", gpu="0/mig1")],
        "gpu_container_series": [s(1, node="n", gpu="0/mig1"), s(2, node="n", gpu="0/mig2")],
        "pair_score": [s(60, node="n", gpu="0/mig1", peer="0/mig2")],
        "container_memory": [ctr("n", "0/mig1", "p", 3 * GIB), ctr("n", "0/mig2", "p", 2 * GIB),
                             ctr("n", "0/mig2", "q", 1 * GIB)],
        "container_sm": [ctr("n", "0/mig1", "p", 0.25), ctr("n", "0/mig2", "p", 0.5)],
        "container_kernel": [ctr("n", "0/mig1", "p", 10.0), ctr("n", "0/mig2", "p", 5.0)],
    }
    state = build_state(results, NOW)
    node = state.nodes["n"]
    assert [(g.index, g.uuid, g.memory_total_bytes) for g in node.gpus] == [(0, "GPU-0", 80 * GIB)]
    assert node.gpus[0].tenants == 3  # MIG tenants gauge ignored; 1 + 2 container series on its instances
    assert node.pair_scores == ()
    by_pod = {c.pod: c for c in node.containers}
    assert by_pod["p"].gpu == 0 and by_pod["p"].memory_bytes == 5 * GIB
    assert by_pod["p"].sm_utilization_ratio == 0.75 and by_pod["p"].kernel_seconds_total == 15.0
    assert by_pod["q"].memory_bytes == 1 * GIB and by_pod["q"].sm_utilization_ratio is None


def test_a_parent_series_next_to_mig_series_is_not_added_to_them() -> None:
    results = {"container_memory": [ctr("n", "0", "p", 5 * GIB), ctr("n", "0/mig1", "p", 3 * GIB),
                                    ctr("n", "0/mig2", "p", 2 * GIB)]}
    assert build_state(results, NOW).nodes["n"].containers[0].memory_bytes == 5 * GIB


@pytest.mark.parametrize("label", ["", "x", "-1", "0/", "/mig1", "\uff11"])  # the last: a fullwidth digit one
def test_malformed_gpu_labels_are_skipped(label: str) -> None:
    results = {"gpu_memory_total": [s(1, node="n", gpu=label)], "container_memory": [ctr("n", label, "p", 1.0)]}
    state = build_state(results, NOW)
    assert state.nodes == {}


def test_gpu_label_parsing() -> None:
    assert parse_gpu_label("7") == (7, False)
    assert parse_gpu_label("2/mig3") == (2, True)
    assert parse_gpu_label("a") is None


def test_duplicate_series_do_not_double_count() -> None:
    """Two scrape jobs / HA replicas: the same series twice (identical labels once the
    queries' `max by` dropped job and instance), or federated results that kept them."""
    base = full_results()
    doubled = {name: [*samples, *samples] for name, samples in base.items()}
    assert build_state(doubled, NOW) == build_state(base, NOW)
    # with target labels still on (a hand-made query without `max by`): same answer
    tagged = {name: [Sample({**x.labels, "instance": inst}, x.value, x.timestamp_s)
                     for inst in ("p0", "p1") for x in samples] for name, samples in base.items()}
    assert build_state(tagged, NOW) == build_state(base, NOW)


def test_of_duplicate_health_verdicts_the_unhealthy_one_wins() -> None:
    results = {"gpu_healthy": [s(1, node="n", gpu="0", uuid="U", model="M", reason="ok", xid=""),
                               s(0, node="n", gpu="0", uuid="U", model="M", reason="lost", xid=""),
                               s(0, node="n", gpu="0", uuid="U", model="M", reason="xid", xid="48")]}
    gpu = build_state(results, NOW).nodes["n"].gpus[0]
    assert (gpu.healthy, gpu.reason, gpu.xid) == (False, "lost", None)


def test_tenants_fall_back_to_counting_container_series() -> None:
    results = {"gpu_memory_total": [s(1, node="n", gpu="0"), s(1, node="n", gpu="1")],
               "gpu_container_series": [s(3, node="n", gpu="0"), s(2, node="n", gpu="1")],
               "gpu_tenants": [s(1, node="n", gpu="1")]}
    gpus = build_state(results, NOW).nodes["n"].gpus
    assert [g.tenants for g in gpus] == [3, 1]  # counted where no gauge; the agent's gauge wins where present


def test_staleness() -> None:
    results = {"backend_up": [s(1, node=n, simulated="false") for n in ("fresh", "old", "unknown")],
               "last_scrape": [s(NOW - 5, node="fresh"), s(NOW - 600, node="old")]}
    state = build_state(results, NOW)
    assert state.nodes["old"].last_scrape_s == NOW - 600
    assert stale_nodes(state, max_age_s=60) == ["old", "unknown"]
    assert stale_nodes(state, max_age_s=3600) == ["unknown"]


def test_series_without_a_node_label_are_ignored() -> None:
    results = {"backend_up": [s(1, simulated="false")], "container_memory": [ctr("", "0", "p", 1.0)],
               "gpu_memory_total": [s(1, gpu="0")]}
    assert build_state(results, NOW).nodes == {}


def test_queries_aggregate_away_target_labels() -> None:
    for name, promql in CLUSTER_QUERIES.items():
        assert promql.startswith(("max by", "sum by", "count by")), name
        assert "instance" not in promql and "job" not in promql, name


def test_queries_scoped_to_one_node_escape_the_name() -> None:
    queries = cluster_queries('we"ird\\node')
    assert all('node="we\\"ird\\\\node"' in q for q in queries.values())
    assert set(queries) == set(CLUSTER_QUERIES)
    slim = cluster_queries(containers=False)
    assert "container_memory" not in slim and "gpu_container_series" in slim


def synthetic_results(nodes: int = 1000, gpus: int = 8, per_gpu: int = 2) -> dict[str, list[Sample]]:
    """What the batch returns at `nodes` x `gpus`, `per_gpu` containers on every GPU."""
    r: dict[str, list[Sample]] = {name: [] for name in CLUSTER_QUERIES}
    for n in range(nodes):
        node = f"node-{n:04d}"
        r["backend_up"].append(s(1, node=node, simulated="false"))
        r["last_scrape"].append(s(NOW - 2, node=node))
        r["network_speed"].append(s(12.5e9, node=node))
        r["network_throughput"].append(s(1e6, node=node))
        for g in range(gpus):
            gl = str(g)
            r["gpu_healthy"].append(s(1, node=node, gpu=gl, uuid=f"GPU-{n}-{g}", model="H100", reason="ok", xid=""))
            for name, value in (("gpu_memory_total", 80 * GIB), ("gpu_memory_used", 20 * GIB),
                                ("gpu_memory_free", 60 * GIB), ("gpu_utilization", 0.5),
                                ("gpu_tenants", per_gpu), ("gpu_exclusive", 0), ("gpu_container_series", per_gpu)):
                r[name].append(s(value, node=node, gpu=gl))
            for p in range(gpus):
                if p != g:
                    r["pair_score"].append(s(160, node=node, gpu=gl, peer=str(p)))
            for c in range(per_gpu):
                pod = f"pod-{g}-{c}"
                r["container_memory"].append(ctr(node, gl, pod, 4 * GIB))
                r["container_sm"].append(ctr(node, gl, pod, 0.2))
                r["container_kernel"].append(ctr(node, gl, pod, 100.0))
    return r


def test_build_state_is_fast_at_a_thousand_nodes() -> None:
    results = synthetic_results()
    started = time.perf_counter()
    state = build_state(results, NOW)
    elapsed = time.perf_counter() - started
    assert len(state.nodes) == 1000 and sum(len(n.gpus) for n in state.nodes.values()) == 8000
    assert sum(len(n.containers) for n in state.nodes.values()) == 16000
    assert elapsed < 3.0, f"build_state took {elapsed:.2f}s at 1,000 nodes x 8 GPUs"  # ~0.1 s measured
