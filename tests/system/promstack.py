"""Real Prometheus and Alertmanager (Debian's binaries) on 127.0.0.1 for system tests.

Each server runs in its own temp dir on a free loopback port and is stopped (and its
process reaped) when the context exits, whatever happens inside.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited early:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout_s}s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class Prometheus:
    """A running Prometheus; `query()` returns the API's result list."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.base_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise AssertionError(f"query failed: {promql}: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, promql: str, timeout_s: float = 20.0) -> list[dict[str, Any]]:
        """Poll until the query returns data (or time out with the last answer)."""
        deadline = time.monotonic() + timeout_s
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if result:
                return result
            time.sleep(0.5)
        return result

    def alerts(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.base_url}/api/v1/alerts", timeout=10) as resp:
            alerts: list[dict[str, Any]] = json.load(resp)["data"]["alerts"]
        return alerts


def _duration(seconds: float) -> str:
    """Prometheus durations take integers with a unit: 1.5 -> '1500ms'."""
    return f"{round(seconds * 1000)}ms"


@contextmanager
def run_prometheus(work_dir: Path, targets: Sequence[str], rule_files: Sequence[Path] = (),
                   alertmanager: str | None = None, interval_s: float = 1.0,
                   binary: str = "prometheus") -> Iterator[Prometheus]:
    """Start Prometheus scraping `targets` (host:port) every `interval_s`."""
    work_dir.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "global": {"scrape_interval": _duration(interval_s), "evaluation_interval": _duration(interval_s)},
        "scrape_configs": [{"job_name": "gpuwatch", "static_configs": [{"targets": list(targets)}]}],
        "rule_files": [str(p) for p in rule_files],
    }
    if alertmanager:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    cfg = work_dir / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(config))
    port = free_port()
    log = work_dir / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={work_dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/-/ready", proc, 30, log)
        yield Prometheus(f"http://127.0.0.1:{port}")
    finally:
        _stop(proc)


@contextmanager
def run_alertmanager(work_dir: Path, webhook_url: str, bearer_token: str | None = None,
                     binary: str = "prometheus-alertmanager") -> Iterator[str]:
    """Start Alertmanager routing every alert to `webhook_url`; yields its host:port."""
    work_dir.mkdir(parents=True, exist_ok=True)
    receiver: dict[str, Any] = {"url": webhook_url, "send_resolved": True}
    if bearer_token:
        receiver["http_config"] = {"authorization": {"type": "Bearer", "credentials": bearer_token}}
    config = {
        "route": {"receiver": "gpuwatch", "group_wait": "0s", "group_interval": "1s",
                  "repeat_interval": "1h", "group_by": ["alertname", "namespace", "pod", "container"]},
        "receivers": [{"name": "gpuwatch", "webhook_configs": [receiver]}],
    }
    cfg = work_dir / "alertmanager.yml"
    cfg.write_text(yaml.safe_dump(config))
    port = free_port()
    cluster_port = free_port()
    log = work_dir / "alertmanager.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.path={work_dir / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{port}",
             f"--cluster.listen-address=127.0.0.1:{cluster_port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/-/ready", proc, 30, log)
        yield f"127.0.0.1:{port}"
    finally:
        _stop(proc)
