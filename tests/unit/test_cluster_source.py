"""PrometheusCluster: the extender's view -- the placement batch, static facts read rarely,
promised pods asked for by UID, stale-while-revalidate, and the worker process."""

from __future__ import annotations

import pickle
import time

import pytest

from gpuwatch.cluster.prometheus import PrometheusError, PrometheusQueryError
from gpuwatch.cluster.queries import placement_queries, pods_queries, static_queries
from gpuwatch.cluster.source import PrometheusCluster
from tests.unit.test_cluster_prometheus import Answer, FakeClock, FakePrometheus, fake_prometheus, vector

NODE = {"node": "n1", "gpu": "0"}


def answer_basics(prom: FakePrometheus, free: str = "5e10") -> None:
    q = {**placement_queries(), **static_queries()}
    prom.answers[q["gpu_memory_total"]] = vector((NODE, "8e10"), ({"node": "n1", "gpu": "1"}, "8e10"))
    prom.answers[q["gpu_memory_free"]] = vector((NODE, free), ({"node": "n1", "gpu": "1"}, "8e10"))
    prom.answers[q["gpu_healthy"]] = vector(({"node": "n1", "gpu": "1", "reason": "xid", "xid": "79"}, "0"))
    prom.answers[q["backend_up"]] = vector(({"node": "n1", "simulated": "true"}, "1"))
    prom.answers[q["last_scrape"]] = vector(({"node": "n1"}, "1800000000"))
    prom.answers[q["pair_score"]] = vector(({"node": "n1", "gpu": "0", "peer": "1"}, "450"))


def test_state_from_the_placement_batch_with_static_facts_read_rarely() -> None:
    clock = FakeClock()
    with fake_prometheus() as prom:
        answer_basics(prom)
        cluster = PrometheusCluster(prom.url, cache_s=1.0, revalidate_s=1.0, static_every_s=60, clock=clock,
                                    worker_process=False)
        state = cluster.state()
        gpu0, gpu1 = state.nodes["n1"].gpus
        assert (gpu0.memory_total_bytes, gpu0.memory_free_bytes, gpu0.healthy, gpu0.reason) == (8e10, 5e10, True, "ok")
        assert (gpu1.healthy, gpu1.reason, gpu1.xid) == (False, "xid", 79)  # only unhealthy GPUs are asked for
        assert state.nodes["n1"].pair_score(0, 1) == 450
        assert cluster.state() is state  # within cache_s: no HTTP
        clock.now += 2
        cluster.state()
        static = static_queries()
        assert prom.count(static["pair_score"]) == prom.count(static["gpu_memory_total"]) == 1
        assert prom.count(placement_queries()["gpu_memory_free"]) == 2
        assert cluster.state().nodes["n1"].gpus[0].memory_total_bytes == 8e10  # static facts still merged in
        cluster.close()


def test_promised_pods_are_asked_for_by_uid() -> None:
    with fake_prometheus() as prom:
        answer_basics(prom)
        query = pods_queries(["uid-9"])["container_memory"]
        prom.answers[query] = vector(({"node": "n1", "gpu": "0", "namespace": "ml", "pod": "p", "pod_uid": "uid-9",
                                       "container": "c", "container_id": "x"}, "1e9"))
        cluster = PrometheusCluster(prom.url, worker_process=False)
        state = cluster.state(["uid-9"])
        assert [c.pod_uid for c in state.nodes["n1"].containers] == ["uid-9"]
        assert prom.count(query) == 1
        cluster.close()


def test_stale_while_revalidate_serves_at_once_and_refreshes_in_the_background() -> None:
    clock = FakeClock()
    with fake_prometheus() as prom:
        answer_basics(prom)
        cluster = PrometheusCluster(prom.url, cache_s=1.0, revalidate_s=10.0, clock=clock, worker_process=False)
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
        cluster = PrometheusCluster(prom.url, timeout_s=0.5, cache_s=1.0, revalidate_s=5.0, clock=clock,
                                    worker_process=False)
        cluster.state()
        prom.answers[placement_queries()["gpu_memory_free"]] = Answer(status=500, body=b"boom",
                                                                      content_type="text/plain")
        clock.now += 2
        assert cluster.state().nodes  # still the last view, refresh fails in the background
        time.sleep(0.5)
        clock.now += 5
        with pytest.raises(PrometheusError):
            cluster.state()
        assert cluster.errors_total >= 1
        cluster.close()


def test_the_worker_process_builds_the_view_and_its_errors_cross_back() -> None:
    with fake_prometheus() as prom:
        answer_basics(prom)
        cluster = PrometheusCluster(prom.url, cache_s=0.0, revalidate_s=0.0)
        try:
            state = cluster.state()
            assert state.nodes["n1"].gpus[0].memory_free_bytes == 5e10
            assert cluster.queries_total == len(placement_queries()) + len(static_queries())
            prom.answers[placement_queries()["gpu_memory_free"]] = Answer(
                status=400, body=b'{"status":"error","errorType":"bad_data","error":"parse error"}')
            with pytest.raises(PrometheusQueryError, match="parse error") as info:
                cluster.state()
            assert info.value.fix  # the fix survives the trip back
        finally:
            cluster.close()


def test_errors_pickle_whole() -> None:
    err = PrometheusQueryError("query x failed", fix="check it")
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is PrometheusQueryError and str(again) == str(err)
