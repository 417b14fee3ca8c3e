"""PrometheusCluster: the extender's view -- the placement batch, pair scores read rarely,
promised pods asked for by UID, and stale-while-revalidate so requests do not wait."""

from __future__ import annotations

import time

import pytest

from gpuwatch.cluster.prometheus import PrometheusError
from gpuwatch.cluster.source import PrometheusCluster
from gpuwatch.cluster.state import placement_queries, pods_queries, topology_queries
from tests.unit.test_cluster_prometheus import Answer, FakeClock, FakePrometheus, fake_prometheus, vector

NODE = {"node": "n1", "gpu": "0"}


def answer_basics(prom: FakePrometheus, free: str = "5e10") -> None:
    q = placement_queries()
    prom.answers[q["gpu_memory_total"]] = vector((NODE, "8e10"))
    prom.answers[q["gpu_memory_free"]] = vector((NODE, free))
    prom.answers[q["gpu_healthy"]] = vector(({**NODE, "reason": "ok", "xid": ""}, "1"))
    prom.answers[q["backend_up"]] = vector(({"node": "n1", "simulated": "true"}, "1"))
    prom.answers[q["last_scrape"]] = vector(({"node": "n1"}, "1800000000"))
    prom.answers[topology_queries()["pair_score"]] = vector(({"node": "n1", "gpu": "0", "peer": "1"}, "450"))


def test_state_from_the_placement_batch_with_pair_scores_read_rarely() -> None:
    clock = FakeClock()
    with fake_prometheus() as prom:
        answer_basics(prom)
        cluster = PrometheusCluster(prom.url, cache_s=1.0, revalidate_s=1.0, topology_cache_s=60, clock=clock)
        state = cluster.state()
        (gpu,) = state.nodes["n1"].gpus
        assert (gpu.memory_total_bytes, gpu.memory_free_bytes, gpu.healthy) == (8e10, 5e10, True)
        assert state.nodes["n1"].pair_score(0, 1) == 450
        assert cluster.state() is state  # within cache_s: no HTTP
        clock.now += 2
        cluster.state()
        pair = topology_queries()["pair_score"]
        assert prom.count(pair) == 1  # static: not asked again within topology_cache_s
        assert prom.count(placement_queries()["gpu_memory_free"]) == 2
        assert cluster.state().nodes["n1"].pair_score(0, 1) == 450  # still merged in
        cluster.close()


def test_promised_pods_are_asked_for_by_uid() -> None:
    with fake_prometheus() as prom:
        answer_basics(prom)
        query = pods_queries(["uid-9"])["container_memory"]
        prom.answers[query] = vector(({"node": "n1", "gpu": "0", "namespace": "ml", "pod": "p", "pod_uid": "uid-9",
                                       "container": "c", "container_id": "x"}, "1e9"))
        cluster = PrometheusCluster(prom.url)
        state = cluster.state(["uid-9"])
        assert [c.pod_uid for c in state.nodes["n1"].containers] == ["uid-9"]
        assert prom.count(query) == 1
        cluster.close()


def test_stale_while_revalidate_serves_at_once_and_refreshes_in_the_background() -> None:
    clock = FakeClock()
    with fake_prometheus() as prom:
        answer_basics(prom)
        cluster = PrometheusCluster(prom.url, cache_s=1.0, revalidate_s=10.0, clock=clock)
        first = cluster.state()
        slow = placement_queries()["gpu_memory_free"]
        prom.answers[slow] = Answer(body=vector((NODE, "1e10")).body, delay_s=0.5)
        clock.now += 2  # past the cache, within revalidate
        started = time.monotonic()
        assert cluster.state() is first  # answered from the old view, no wait
        assert time.monotonic() - started < 0.2
        deadline = time.monotonic() + 5
        while cluster.refreshes_total < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        clock.now += 0.1
        assert cluster.state().nodes["n1"].gpus[0].memory_free_bytes == 1e10
        cluster.close()


def test_outage_surfaces_once_the_view_is_too_old() -> None:
    clock = FakeClock()
    with fake_prometheus() as prom:
        answer_basics(prom)
        cluster = PrometheusCluster(prom.url, timeout_s=0.5, cache_s=1.0, revalidate_s=5.0, clock=clock)
        cluster.state()
        prom.answers[placement_queries()["gpu_memory_free"]] = Answer(status=500, body=b"boom",
                                                                      content_type="text/plain")
        clock.now += 2
        assert cluster.state().nodes  # still the last view, refresh fails in the background
        time.sleep(0.5)
        clock.now += 5
        with pytest.raises(PrometheusError):
            cluster.state()
        cluster.close()
