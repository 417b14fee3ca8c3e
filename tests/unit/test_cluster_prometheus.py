"""PrometheusReader against a real HTTP server on 127.0.0.1 that answers like Prometheus'
/api/v1/query: success, API errors, HTTP errors, non-JSON, slow answers, the cache."""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from gpuwatch.cluster.prometheus import (
    PrometheusError,
    PrometheusQueryError,
    PrometheusReader,
    PrometheusResponseError,
    PrometheusTimeout,
    PrometheusUnreachable,
    Sample,
)
from gpuwatch.core.errors import GpuwatchError


@dataclass
class Answer:
    status: int = 200
    body: bytes = b""
    delay_s: float = 0.0
    content_type: str = "application/json"


def vector(*series: tuple[dict[str, str], str], ts: float = 1_800_000_000.5) -> Answer:
    result = [{"metric": labels, "value": [ts, value]} for labels, value in series]
    return Answer(body=json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode())


def api_error(status: int, error_type: str, error: str) -> Answer:
    return Answer(status=status, body=json.dumps({"status": "error", "errorType": error_type,
                                                  "error": error}).encode())


@dataclass
class FakePrometheus:
    """Answers POST {prefix}/api/v1/query by the form's `query`; records every request."""

    url: str = ""
    answers: dict[str, Answer] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    peers: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, query: str) -> int:
        with self.lock:
            return sum(1 for r in self.requests if r["form"].get("query") == query)


@contextmanager
def fake_prometheus() -> Iterator[FakePrometheus]:
    """A FakePrometheus serving on 127.0.0.1 (base URL with a /prom route prefix)."""
    fake = FakePrometheus()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as Prometheus

        def log_message(self, format: str, *args: Any) -> None:
            return None

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            form = dict(urllib.parse.parse_qsl(self.rfile.read(length).decode()))
            with fake.lock:
                fake.requests.append({"method": "POST", "path": self.path, "form": form,
                                      "content_type": self.headers.get("Content-Type", "")})
                fake.peers.add(self.client_address[1])
            if self.path != "/prom/api/v1/query":
                answer = Answer(status=404, body=b"404 page not found\n", content_type="text/plain")
            else:
                answer = fake.answers.get(form.get("query", ""), vector())
            time.sleep(answer.delay_s)
            try:
                self.send_response(answer.status)
                self.send_header("Content-Type", answer.content_type)
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)
            except OSError:
                pass  # the client gave up (timeout test)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}/prom"
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def prom() -> Iterator[FakePrometheus]:
    with fake_prometheus() as fake:
        yield fake


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_batch_posts_form_encoded_queries_and_returns_samples(prom: FakePrometheus) -> None:
    prom.answers["up_q"] = vector(({"node": "a", "gpu": "0"}, "1"), ({"node": "b", "gpu": "1"}, "NaN"))
    prom.answers["scalar_q"] = Answer(body=b'{"status":"success","data":{"resultType":"scalar",'
                                           b'"result":[1800000000.5,"42"]}}')
    long_query = "sum(" + " + ".join(f"metric_{i}" for i in range(2000)) + ")"  # too long for a GET URL
    with PrometheusReader(prom.url + "/", timeout_s=2.0) as reader:
        results = reader.query_batch({"up": "up_q", "scalar": "scalar_q", "empty": long_query})
    assert results["up"][0] == Sample({"node": "a", "gpu": "0"}, 1.0, 1_800_000_000.5)
    assert results["up"][1].labels == {"node": "b", "gpu": "1"} and results["up"][1].value != results["up"][1].value
    assert results["scalar"] == [Sample({}, 42.0, 1_800_000_000.5)]
    assert results["empty"] == []
    assert {r["method"] for r in prom.requests} == {"POST"}
    assert {r["path"] for r in prom.requests} == {"/prom/api/v1/query"}
    assert all(r["content_type"] == "application/x-www-form-urlencoded" for r in prom.requests)
    assert {r["form"]["timeout"] for r in prom.requests} == {"2000ms"}
    assert prom.count(long_query) == 1
    assert (reader.queries_total, reader.errors_total, reader.batches_total) == (3, 0, 1)


def test_api_error_names_the_query_and_the_error(prom: FakePrometheus) -> None:
    prom.answers["bad{"] = api_error(400, "bad_data", 'invalid parameter "query": 1:5: parse error')
    with PrometheusReader(prom.url) as reader, pytest.raises(PrometheusQueryError) as info:
        reader.query_batch({"good": "up", "broken": "bad{"})
    err = info.value
    assert isinstance(err, GpuwatchError) and err.query == "broken" and err.url == prom.url
    assert "query broken failed" in err.message and "parse error" in err.message and "bad_data" in err.message
    assert err.fix
    assert reader.errors_total == 1 and reader.queries_total == 2


def test_server_side_timeout_says_prometheus_is_slow(prom: FakePrometheus) -> None:
    prom.answers["heavy"] = api_error(503, "timeout", "query timed out in expression evaluation")
    with PrometheusReader(prom.url) as reader, pytest.raises(PrometheusQueryError) as info:
        reader.query_batch({"heavy": "heavy"})
    assert "timed out" in str(info.value) and "overloaded" in info.value.fix


def test_http_500_without_json(prom: FakePrometheus) -> None:
    prom.answers["q"] = Answer(status=500, body=b"<html>Internal Server Error</html>", content_type="text/html")
    with PrometheusReader(prom.url) as reader, pytest.raises(PrometheusResponseError) as info:
        reader.query_batch({"q": "q"})
    assert "HTTP 500" in info.value.message and "Internal Server Error" in info.value.message
    assert "text/html" in info.value.message


def test_non_json_success_is_not_the_prometheus_api(prom: FakePrometheus) -> None:
    prom.answers["q"] = Answer(body=b"<html><form>login</form></html>", content_type="text/html")
    with PrometheusReader(prom.url) as reader, pytest.raises(PrometheusResponseError) as info:
        reader.query_batch({"q": "q"})
    assert "non-JSON" in info.value.message and "Prometheus itself" in info.value.fix


def test_json_error_status_without_api_document(prom: FakePrometheus) -> None:
    prom.answers["q"] = Answer(status=502, body=b'{"message": "bad gateway"}')
    with PrometheusReader(prom.url) as reader, pytest.raises(PrometheusResponseError) as info:
        reader.query_batch({"q": "q"})
    assert "HTTP 502" in info.value.message


def test_wrong_path_prefix(prom: FakePrometheus) -> None:
    with PrometheusReader(prom.url.removesuffix("/prom")) as reader, pytest.raises(PrometheusResponseError) as info:
        reader.query_batch({"q": "up"})
    assert "HTTP 404" in info.value.message


@pytest.mark.parametrize("body", [b'{"status":"success"}', b'{"status":"success","data":{"resultType":"matrix",'
                                                         b'"result":[]}}', b"[1, 2]"])
def test_unexpected_documents(prom: FakePrometheus, body: bytes) -> None:
    prom.answers["q"] = Answer(body=body)
    with PrometheusReader(prom.url) as reader, pytest.raises(PrometheusResponseError):
        reader.query_batch({"q": "q"})


def test_slow_answer_times_out(prom: FakePrometheus) -> None:
    prom.answers["slow"] = Answer(body=vector().body, delay_s=3.0)
    with PrometheusReader(prom.url, timeout_s=0.3) as reader:
        started = time.monotonic()
        with pytest.raises(PrometheusTimeout) as info:
            reader.query_batch({"fast": "up", "slow": "slow"})
        elapsed = time.monotonic() - started
    assert elapsed < 2.0, elapsed
    assert "did not answer query slow within 0.3s" in info.value.message
    assert info.value.query == "slow" and reader.errors_total == 1


def test_unreachable() -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with PrometheusReader(f"http://127.0.0.1:{port}", timeout_s=1.0) as reader, \
            pytest.raises(PrometheusUnreachable) as info:
        reader.query_batch({"q": "up"})
    assert info.value.message.startswith(f"Prometheus at http://127.0.0.1:{port} unreachable: ")
    assert "refused" in info.value.message and "URL" in info.value.fix


def test_not_an_http_url() -> None:
    with pytest.raises(PrometheusError, match="not an http"):
        PrometheusReader("prometheus:9090")


def test_queries_run_concurrently(prom: FakePrometheus) -> None:
    for i in range(4):
        prom.answers[f"q{i}"] = Answer(body=vector().body, delay_s=0.4)
    with PrometheusReader(prom.url, timeout_s=2.0) as reader:
        started = time.monotonic()
        reader.query_batch({f"n{i}": f"q{i}" for i in range(4)})
        assert time.monotonic() - started < 1.2  # 4 x 0.4 s one after another would be 1.6 s


def test_cache_hit_makes_no_request_and_expires(prom: FakePrometheus) -> None:
    clock = FakeClock()
    batch = {"a": "qa", "b": "qb"}
    with PrometheusReader(prom.url, cache_s=1.0, clock=clock) as reader:
        first = reader.query_batch(batch)
        clock.now += 0.5
        again = reader.query_batch(dict(reversed(batch.items())))  # same set, other order
        assert again == first and len(prom.requests) == 2 and reader.cache_hits_total == 1
        reader.query_batch({"a": "qa"})  # another set: read
        assert len(prom.requests) == 3
        reader.query_batch({"a": "qa"})
        assert len(prom.requests) == 3
        clock.now += 1.0
        reader.query_batch({"a": "qa"})
        assert len(prom.requests) == 4
        assert reader.batches_total == 3 and reader.queries_total == 4


def test_concurrent_callers_share_one_refresh(prom: FakePrometheus) -> None:
    prom.answers["slowish"] = Answer(body=vector(({"node": "a"}, "1")).body, delay_s=0.3)
    batch = {"x": "slowish", "y": "up"}
    results: list[Any] = []
    with PrometheusReader(prom.url, cache_s=5.0) as reader:
        threads = [threading.Thread(target=lambda: results.append(reader.query_batch(batch))) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
    assert len(results) == 8 and all(r == results[0] for r in results)
    assert prom.count("slowish") == 1 and prom.count("up") == 1
    assert reader.batches_total == 1 and reader.cache_hits_total == 7


def test_a_failed_batch_is_not_retried_within_cache_s(prom: FakePrometheus) -> None:
    clock = FakeClock()
    prom.answers["q"] = Answer(status=500, body=b"oops", content_type="text/plain")
    with PrometheusReader(prom.url, cache_s=1.0, clock=clock) as reader:
        for _ in range(3):
            with pytest.raises(PrometheusResponseError):
                reader.query_batch({"q": "q"})
        assert prom.count("q") == 1 and reader.errors_total == 1
        prom.answers["q"] = vector()
        clock.now += 1.5
        assert reader.query_batch({"q": "q"}) == {"q": []}


def test_connections_are_kept_alive(prom: FakePrometheus) -> None:
    with PrometheusReader(prom.url, cache_s=0.0, max_workers=2) as reader:
        for _ in range(10):
            reader.query_batch({"a": "qa", "b": "qb"})
    assert len(prom.requests) == 20
    assert len(prom.peers) <= 2, prom.peers  # one connection per worker, reused


def test_closed_reader_refuses(prom: FakePrometheus) -> None:
    reader = PrometheusReader(prom.url)
    reader.close()
    reader.close()
    with pytest.raises(PrometheusError, match="closed"):
        reader.query_batch({"q": "up"})
