"""`gpuwatch extender` as a process against a hostile Prometheus and large concurrent bodies.

Issue 20, item 1: pointed at a server answering 200 with endless JSON whitespace, the
extender and its worker reached 6 GiB in 30 s, each /filter took 18 s against
--prometheus-timeout 2 s, and it still ran 3 s after SIGTERM; sixteen concurrent 28 MiB
Node lists took it to 944 MiB (256 Mi limit). Here: /filter answers within the timeout
with Error set, memory stays bounded, SIGTERM ends it within 2 s even mid-refresh, and
concurrent large bodies are parsed a budget at a time.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from tests.hostile_server import HostileServer

REPO = Path(__file__).resolve().parents[2]
GPU_POD = {"metadata": {"name": "p", "namespace": "ml", "uid": "u1",
                        "annotations": {"gpuwatch.io/gpu-memory": "1Gi"}},
           "spec": {"containers": [{"name": "c"}]}}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tree_rss_mib(pid: int) -> float:
    """VmRSS of a process and its children (the worker process), MiB."""
    total = 0
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


@contextmanager
def extender(prometheus_url: str, *extra: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpuwatch", "extender", "--listen", f"127.0.0.1:{port}",
                             "--prometheus-url", prometheus_url, "--prometheus-timeout", "1", *extra],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError("extender did not start")
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def post_raw(port: int, path: str, body: bytes, timeout: float = 30) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def post(port: int, path: str, body: bytes, timeout: float = 30) -> tuple[int, dict[str, object], float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    started = time.monotonic()
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data), time.monotonic() - started


def test_endless_prometheus_answers_cost_bounded_time_and_memory() -> None:
    with HostileServer("endless") as prom, extender(prom.url) as (proc, port):
        body = json.dumps({"Pod": GPU_POD, "NodeNames": ["n1"]}).encode()
        peak = 0.0
        for _ in range(4):
            status, result, elapsed = post(port, "/filter", body)
            peak = max(peak, tree_rss_mib(proc.pid))
            assert status == 200 and "too much" in str(result["Error"]), result
            assert elapsed < 2.5
        assert peak < 256, peak


def test_sigterm_ends_it_within_2s_while_a_refresh_reads_a_slow_answer() -> None:
    with HostileServer("slow", slow_interval_s=0.2) as prom, extender(prom.url, "--prometheus-timeout", "30") \
            as (proc, port):
        body = json.dumps({"Pod": GPU_POD, "NodeNames": ["n1"]}).encode()
        threading.Thread(target=lambda: _quiet_post(port, body), daemon=True).start()
        time.sleep(1.0)  # the refresh is now reading a byte at a time
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        assert time.monotonic() - started < 2.0


def _quiet_post(port: int, body: bytes) -> None:
    # the extender is stopped under it: a refused, reset or cut-short answer (IncompleteRead) is expected
    with suppress(OSError, http.client.HTTPException, ValueError):
        post(port, "/filter", body)


def _node_list(nodes: int) -> bytes:
    item = {"metadata": {"name": "", "labels": {f"label-{i}": "x" * 40 for i in range(30)},
                         "annotations": {f"ann-{i}": "y" * 60 for i in range(20)}},
            "status": {"images": [{"names": [f"registry.example/image-{i}:{'z' * 30}"], "sizeBytes": i}
                                  for i in range(20)]}}
    items = []
    for n in range(nodes):
        node = json.loads(json.dumps(item))
        node["metadata"]["name"] = f"node-{n}"
        items.append(node)
    return json.dumps({"Pod": {"metadata": {"name": "cpu-only"}, "spec": {}}, "Nodes": {"items": items}}).encode()


@pytest.mark.skipif(os.cpu_count() is None, reason="needs /proc")
def test_concurrent_large_node_lists_are_parsed_a_budget_at_a_time() -> None:
    body = _node_list(1500)  # ~8 MiB
    with HostileServer("endless") as prom, extender(prom.url, "--max-request-bytes", "16Mi") as (proc, port):
        base = tree_rss_mib(proc.pid)
        peak = [0.0]
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], tree_rss_mib(proc.pid))
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        results: list[int] = []
        retries = [0]

        def filter_until_answered() -> None:
            # as kube-scheduler would try again: a 503 says the server is at its budget of request
            # bytes being parsed or answers not yet taken by their clients (Retry-After: 1)
            for _ in range(10):
                status, _data = post_raw(port, "/filter", body)
                if status != 503:
                    break
                retries[0] += 1
                time.sleep(1)
            results.append(status)

        threads = [threading.Thread(target=filter_until_answered) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        done.set()
        watcher.join()
        after = tree_rss_mib(proc.pid)
        assert results == [200] * 8, results  # each answered, some after a 503 and a retry
        print(f"body {len(body) / 2**20:.1f} MiB x8: base {base:.0f} MiB, peak {peak[0]:.0f}, after {after:.0f}, "
              f"{retries[0]} retries after a 503")
        assert peak[0] - base < 200, (base, peak[0])
        # what stays resident after the burst (glibc and pymalloc keep part of the parsed trees'
        # memory): 19-91 MiB over 18 runs here, so 80 failed 1 in 18; a leak would keep growing
        assert after - base < 120, (base, after)


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_the_worker_process_ends_when_the_extender_is_killed() -> None:
    """The cluster-view worker (and multiprocessing's resource tracker) must not outlive a
    SIGKILLed extender: a pool worker holds both ends of its task queue and waited on it for
    ever, stuck here reading an endless Prometheus answer, and kept the queue's named
    semaphores in /dev/shm (10 left per test run before)."""
    with HostileServer("endless") as prom, extender(prom.url) as (proc, port):
        deadline = time.monotonic() + 20
        helpers: list[int] = []
        while time.monotonic() < deadline and len(helpers) < 2:  # the worker and the tracker
            helpers = _children(proc.pid)
            time.sleep(0.1)
        assert len(helpers) >= 2, helpers
        with suppress(OSError):  # a refresh in flight: the worker is busy reading the endless answer
            post(port, "/filter", json.dumps({"Pod": GPU_POD, "NodeNames": ["n1"]}).encode(), timeout=3)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in helpers):
            time.sleep(0.1)
        left = [p for p in helpers if _alive(p)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"helpers of the killed extender still running: {left}"
