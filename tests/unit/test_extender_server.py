"""The extender over real HTTP (waitress on 127.0.0.1): verbs, keep-alive, limits, bad input,
concurrency, no-data errors, its own metrics."""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpuwatch.cluster.values import ClusterState
from gpuwatch.core.errors import GpuwatchError
from gpuwatch.extender.promises import Promises
from gpuwatch.extender.server import ExtenderApp, ExtenderMetrics, ExtenderServer
from gpuwatch.extender.service import Extender
from tests.unit.test_extender_placement import NOW, Static, cluster, gpu, node

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "extender"


class Down:
    def state(self, pod_uids: object = ()) -> ClusterState:
        raise GpuwatchError("Prometheus at http://127.0.0.1:1 unreachable", fix="start it")


@contextmanager
def serving(source: Any = None, **kw: Any) -> Iterator[ExtenderServer]:
    state = cluster(node("gpu-a", [gpu("gpu-a", 0, 4)]), node("gpu-b", [gpu("gpu-b", 0, 60)]),
                    node("gpu-c", [gpu("gpu-c", 0, 70)]))
    service = Extender(source or Static(state), promises=Promises(), clock=lambda: NOW)
    app = ExtenderApp(service, ExtenderMetrics(), url_prefix=kw.pop("url_prefix", ""))
    server = ExtenderServer(app, "127.0.0.1", 0, **kw)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def post(conn: http.client.HTTPConnection, path: str, body: bytes | str) -> tuple[int, Any]:
    data = body.encode() if isinstance(body, str) else body
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw.decode(errors="replace")


def test_verbs_with_keep_alive() -> None:
    fixture = (FIXTURES / "filter_nodenames.json").read_text()
    with serving() as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        status, result = post(conn, "/filter", fixture)
        assert status == 200 and result["NodeNames"] == ["gpu-b", "gpu-c"]
        assert result["FailedNodes"]["gpu-a"].startswith("largest free GPU memory")
        sock = conn.sock
        status, ranked = post(conn, "/prioritize", fixture)
        assert status == 200 and {h["Host"] for h in ranked} == {"gpu-a", "gpu-b", "gpu-c"}
        assert conn.sock is sock  # same connection: keep-alive
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        assert 'gpuwatch_extender_requests_total{result="ok",verb="filter"} 1.0' in metrics
        assert "gpuwatch_extender_request_duration_seconds_bucket" in metrics


def test_url_prefix() -> None:
    fixture = (FIXTURES / "filter_nodenames.json").read_text()
    with serving(url_prefix="/gpuwatch/") as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        assert post(conn, "/gpuwatch/filter", fixture)[0] == 200
        assert post(conn, "/filter", fixture)[0] == 404


def test_bad_requests_get_4xx_with_a_reason() -> None:
    with serving(max_body_bytes=64 * 1024) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        cases = [
            ("/filter", "{not json", 400, "not JSON"),
            ("/filter", "[" * 30_000 + "]" * 30_000, 400, ""),
            ("/filter", '{"Pod": {"a": ' + "[" * 80 + "]" * 80 + '}, "NodeNames": []}', 400, "deeper"),
            ("/filter", json.dumps({"NodeNames": ["a"]}), 400, "Pod"),
            ("/prioritize", json.dumps({"Pod": {}, "NodeNames": "a"}), 400, "NodeNames"),
            ("/filter", "", 400, "body"),
        ]
        for path, body, code, needle in cases:
            status, answer = post(conn, path, body)
            assert status == code, (body[:50], answer)
            assert needle in str(answer)
        conn.request("GET", "/filter")
        resp = conn.getresponse()
        assert resp.status == 405 and resp.getheader("Allow") == "POST"
        resp.read()
        conn.request("POST", "/metrics", body=b"{}")
        resp = conn.getresponse()
        assert resp.status == 405
        resp.read()
        conn.request("GET", "/nope")
        resp = conn.getresponse()
        assert resp.status == 404
        resp.read()
        conn.close()
        big = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        status, _ = post(big, "/filter", b" " * (128 * 1024))
        assert status == 413


def test_short_body_does_not_hold_a_thread() -> None:
    with serving(channel_timeout_s=1, threads=1) as server:
        liar = socket.create_connection(("127.0.0.1", server.port))
        liar.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{\"Pod\":")
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        fixture = (FIXTURES / "filter_nodenames.json").read_text()
        started = time.monotonic()
        assert post(conn, "/filter", fixture)[0] == 200  # the only worker thread is free
        assert time.monotonic() - started < 2
        liar.settimeout(5)
        assert liar.recv(100) == b""  # closed by the channel timeout
        liar.close()


def test_concurrent_requests() -> None:
    fixture = (FIXTURES / "filter_nodenames.json").read_text()
    statuses: list[int] = []
    lock = threading.Lock()

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
        for i in range(10):
            status, _ = post(conn, "/filter" if i % 2 else "/prioritize", fixture)
            with lock:
                statuses.append(status)

    with serving() as server:
        threads = [threading.Thread(target=client) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert statuses == [200] * 160


def test_prometheus_down_filter_errors_prioritize_503() -> None:
    fixture = (FIXTURES / "filter_nodenames.json").read_text()
    with serving(Down()) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        status, result = post(conn, "/filter", fixture)
        assert status == 200 and "unreachable" in result["Error"]
        assert result["NodeNames"] is None
        status, result = post(conn, "/prioritize", fixture)
        assert status == 503 and "unreachable" in result["Error"]
        conn.request("GET", "/metrics")
        assert 'result="error",verb="filter"' in conn.getresponse().read().decode()


def test_fuzzed_bodies_never_crash_the_service() -> None:
    rng = random.Random(8)
    base = json.loads((FIXTURES / "filter_nodelist.json").read_text())

    def mutate(value: Any, depth: int = 0) -> Any:
        roll = rng.random()
        if depth > 6 or roll < 0.15:
            return rng.choice([None, 0, -1, 1e308, "", "x" * 300, [], {}, True, "8Gi", "\u0000", ["a"], 2**70])
        if isinstance(value, dict):
            return {k: mutate(v, depth + 1) for k, v in value.items() if rng.random() > 0.1}
        if isinstance(value, list):
            return [mutate(v, depth + 1) for v in value if rng.random() > 0.1]
        return value

    with serving() as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        seen: set[int] = set()
        for i in range(400):
            body: bytes | str = json.dumps(mutate(base)) if i % 4 else bytes(rng.getrandbits(8) for _ in range(64))
            status, _ = post(conn, "/filter" if i % 2 else "/prioritize", body)
            seen.add(status)
            if conn.sock is None:
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        assert seen <= {200, 400}, seen
