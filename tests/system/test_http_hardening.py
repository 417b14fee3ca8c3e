"""Issue 13, HTTP, on the real `gpuwatch agent` process (as the DaemonSet runs it: metrics on
0.0.0.0, webhook on loopback with a token): metrics only on the exposed port, 2,000 idle
connections cost the agent no thread and little memory, and a webhook fuzz run takes no
action and is counted in gpuwatch_webhook_requests_total.

Before (a thread per connection, no timeouts), 2,000 idle connections to the agent's /metrics
made 2,003 threads and +54 MB, and /snapshot.json was served on 0.0.0.0.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from tests.conftest import need_root
from tests.system.promstack import free_port
from tests.system.test_agent import running_agent, sample, scrape
from tests.unit.test_http_hardening import _exchange, _need_fds, _request, _statuses

TOKEN = "http-hardening-token-0123456789"
POLICY = Path(__file__).resolve().parents[2] / "deploy" / "policies" / "alert-only.yaml"


def _proc_status(pid: int) -> tuple[int, float]:
    """(threads, RSS MiB) of a process."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()
    return int(fields["Threads"][0]), int(fields["VmRSS"][0]) / 1024


@contextmanager
def agent(tmp_path: Path, *extra: str) -> Iterator[tuple[int, int, int]]:
    """The agent without GPUs (NVML absent: it serves its metrics all the same); yields
    (pid, metrics port, webhook port)."""
    need_root()
    port, hook_port = free_port(), free_port()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    argv = [sys.executable, "-m", "gpuwatch", "agent", f"--listen=0.0.0.0:{port}", "--node=hardening",
            "--no-probes", "--nvml-library=/nonexistent/libnvidia-ml.so.1", "--kmsg=none", "--no-network",
            f"--policy={POLICY}", f"--audit-log={tmp_path / 'audit.jsonl'}",
            f"--state-file={tmp_path / 'frozen.json'}", f"--lock-file={tmp_path / 'agent.lock'}",
            f"--webhook-listen=127.0.0.1:{hook_port}", f"--webhook-token-file={token_file}", *extra]
    env = {k: v for k, v in os.environ.items() if k != "GPUWATCH_WEBHOOK_TOKEN"}
    with running_agent(argv, {**env, "PYTHONUNBUFFERED": "1"}, tmp_path / "agent.log", port) as proc:
        yield proc.pid, port, hook_port


def _get(url: str, method: str = "GET") -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_exposed_metrics_port_serves_metrics_only_and_2000_idle_connections_cost_no_thread(
        tmp_path: Path) -> None:
    _need_fds(4500)
    with agent(tmp_path) as (pid, port, _):
        base = f"http://127.0.0.1:{port}"
        assert _get(base + "/metrics")[0] == 200
        code, body = _get(base + "/snapshot.json")
        assert code == 403 and b"--snapshot-remote" in body
        for method in ("POST", "PUT", "DELETE"):
            assert _get(base + "/metrics", method)[0] == 405
        time.sleep(1)
        threads_before, rss_before = _proc_status(pid)
        socks = []
        try:
            for _ in range(2000):
                sock = socket.socket()
                sock.setblocking(False)
                with suppress(BlockingIOError):
                    sock.connect(("127.0.0.1", port))
                socks.append(sock)
            time.sleep(3)
            threads_after, rss_after = _proc_status(pid)
            started = time.monotonic()
            text = scrape(port)
            scrape_s = time.monotonic() - started
        finally:
            for sock in socks:
                sock.close()
        print(f"agent under 2,000 idle connections: threads {threads_before} -> {threads_after}, "
              f"RSS {rss_before:.1f} -> {rss_after:.1f} MiB, scrape {scrape_s * 1000:.0f} ms")
        assert "gpuwatch_build_info" in text
        assert threads_after <= threads_before + 2  # the agent's own threads come and go; no thread each
        assert rss_after - rss_before < 10
        assert scrape_s < 8


def test_snapshot_remote_serves_snapshot_json_on_the_exposed_port(tmp_path: Path) -> None:
    with agent(tmp_path, "--snapshot-remote") as (_, port, _):
        code, body = _get(f"http://127.0.0.1:{port}/snapshot.json")
        assert code == 200 and json.loads(body)["node"] == "hardening"


def test_webhook_fuzz_on_the_agent_takes_no_action_and_is_counted(tmp_path: Path) -> None:
    rng = random.Random(1313)
    with agent(tmp_path) as (pid, port, hook_port):
        time.sleep(1)
        threads_before, rss_before = _proc_status(pid)
        codes: dict[int, int] = {}
        started = time.monotonic()
        for _ in range(1500):
            for code in _statuses(_exchange(hook_port, _request(rng, "/api/v1/alerts", TOKEN), 10)) or [0]:
                codes[code] = codes.get(code, 0) + 1
        elapsed = time.monotonic() - started
        threads_after, rss_after = _proc_status(pid)
        text = scrape(port)
        counts = {r: sample(text, "gpuwatch_webhook_requests_total", result=r)
                  for r in ("ok", "unauthorized", "rejected", "too_large", "rate_limited")}
        print(f"agent webhook fuzz: 1500 inputs in {elapsed:.1f}s, answers {dict(sorted(codes.items()))}, "
              f"counted {counts}, threads {threads_before} -> {threads_after}, RSS {rss_before:.1f} -> "
              f"{rss_after:.1f} MiB")
        assert not [c for c in codes if c >= 500 and c != 503], codes  # 503 only from the rate limit
        assert all(v is not None for v in counts.values()) and counts["unauthorized"] and counts["rejected"]
        audit = tmp_path / "audit.jsonl"
        assert not audit.exists() or not audit.read_text().strip(), "no alert may become an action"
        assert threads_after <= threads_before + 2
        assert rss_after - rss_before < 40
        log = (tmp_path / "agent.log").read_text()
        assert len(log.splitlines()) < 200, "refused requests are logged at most once per interval and kind"
        assert max(len(line) for line in log.splitlines()) < 2000


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-s"]))
