"""/healthz fails when the sampling loop stalls and recovers when it runs again; /readyz
waits for the first cycle; an agent without NVIDIA devices idles live and ready."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from gpuwatch.agent.idle import idle_until_devices, nvidia_devices
from gpuwatch.core.model import GpuSweep
from gpuwatch.exporter.liveness import LoopHealth
from gpuwatch.exporter.metrics_server import registry_for, serve
from gpuwatch.pipeline.sampler import Sampler
from tests.unit.gpu_fakes import FakeBackend, FakeResolver, FakeWorld


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_liveness_follows_the_beat() -> None:
    clock = _Clock()
    beat: list[float | None] = [None]
    health = LoopHealth(lambda: beat[0], interval_s=1.0, stall_intervals=10, clock=clock)
    assert health.live().ok and not health.ready().ok  # starting
    clock.now += 11
    verdict = health.live()
    assert not verdict.ok and "no sampling cycle finished since start" in verdict.reason
    beat[0] = clock.now
    assert health.live().ok and health.ready().ok
    clock.now += 9.9
    assert health.live().ok
    clock.now += 0.2
    verdict = health.live()
    assert not verdict.ok and not health.ready().ok
    assert "10.1 s ago" in verdict.reason and "10 intervals of 1 s" in verdict.reason


def test_short_intervals_get_a_floor() -> None:
    health = LoopHealth(lambda: 0.0, interval_s=0.05, stall_intervals=10)
    assert health.stall_s == 5.0


class _StallingBackend(FakeBackend):
    """Sweeps block while `stall` is set, as a hung NVML call does."""

    def __init__(self, world: FakeWorld, stall: threading.Event, release: threading.Event) -> None:
        super().__init__(world)
        self.stall, self.release = stall, release

    def sweep(self) -> GpuSweep:
        if self.stall.is_set():
            self.release.wait(10)
        return super().sweep()


def test_healthz_goes_unhealthy_when_the_loop_stalls_and_back() -> None:
    world = FakeWorld()
    stall, release = threading.Event(), threading.Event()
    stall.set()  # the very first sweep hangs: not ready, then not live
    sampler = Sampler(lambda: _StallingBackend(world, stall, release), FakeResolver(), "n", interval_s=0.05)
    health = LoopHealth(sampler.loop_beat_s, interval_s=0.05, stall_intervals=4, min_stall_s=0.3)
    server = serve(registry_for(sampler.latest), "127.0.0.1", 0, health=health)
    try:
        sampler.start()
        code, body = _get(f"{server.url}/readyz")
        assert code == 503 and "first sampling cycle" in body
        time.sleep(0.5)
        code, body = _get(f"{server.url}/healthz")
        assert code == 503 and body.startswith("stalled:"), body
        stall.clear()
        release.set()
        time.sleep(0.3)
        assert _get(f"{server.url}/healthz")[0] == 200
        assert _get(f"{server.url}/readyz") == (200, "ready\n")
        stall.set()
        release.clear()
        time.sleep(0.6)
        code, body = _get(f"{server.url}/healthz")
        assert code == 503 and "the sampling loop last finished a cycle" in body
        assert _get(f"{server.url}/readyz")[0] == 503
        assert _get(f"{server.url}/metrics")[0] == 200  # metrics still served meanwhile
    finally:
        release.set()
        sampler.stop()
        server.stop()


def test_device_nodes_are_found_by_prefix(tmp_path: Path) -> None:
    prefix = str(tmp_path / "nvidia")
    assert nvidia_devices(prefix) == []
    (tmp_path / "nvidia-uvm").touch()  # not a GPU: the uvm node comes with the driver, not per GPU
    assert nvidia_devices(prefix) == []
    (tmp_path / "nvidiactl").touch()
    (tmp_path / "nvidia0").touch()
    assert nvidia_devices(prefix) == [prefix + "0", prefix + "ctl"]


def test_idle_agent_is_live_ready_and_wakes_on_a_device(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prefix = str(tmp_path / "nvidia")
    stop = threading.Event()
    woke: list[bool] = []
    runner = threading.Thread(target=lambda: woke.append(
        idle_until_devices("n", prefix, "127.0.0.1", port, 1.0, stop, recheck_s=0.1)))
    runner.start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                code, body = _get(f"http://127.0.0.1:{port}/healthz")
                break
            except OSError:
                time.sleep(0.05)
        assert code == 200 and "idle" in body
        assert _get(f"http://127.0.0.1:{port}/readyz")[0] == 200
        code, metrics = _get(f"http://127.0.0.1:{port}/metrics")
        assert code == 200 and 'gpuwatch_agent_idle{node="n"} 1.0' in metrics
        assert "gpuwatch_gpu_backend_up" not in metrics  # no GpuwatchNvmlDown for a node without GPUs
        (tmp_path / "nvidia0").touch()
        runner.join(5)
        assert woke == [True]
        try:
            _get(f"http://127.0.0.1:{port}/healthz")
            raise AssertionError("the idle server still serves after waking")
        except OSError:
            pass
    finally:
        stop.set()
        runner.join(5)
