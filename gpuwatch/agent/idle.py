"""The agent on a node without NVIDIA devices: serve, say so, cost nothing, wake when a GPU comes.

The "all nodes" DaemonSet (clusters with neither GPU Feature Discovery nor NFD's PCI labels)
puts an agent on every node. Where there is no NVIDIA device node, the agent starts none of
its sources (no BPF compile, no NVML retries, no /proc walks): it serves /metrics
(`gpuwatch_agent_idle{node} 1` and build info, no GPU series: no GpuwatchNvmlDown alert for a
node that has no GPU), /healthz and /readyz (both ok: nothing is wrong with an agent that has
no GPU to watch), and looks for device nodes again every
IDLE_RECHECK_S. When one appears (a driver installed, a GPU hot-added) it stops serving and
the agent starts as usual. The device nodes are what the driver creates before NVML can
work: `<prefix>ctl` and `<prefix><N>` (prefix /dev/nvidia, the probes' --device-prefix).
"""

from __future__ import annotations

import glob
import logging
import threading
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger("gpuwatch.agent")

IDLE_RECHECK_S = 30.0


def nvidia_devices(prefix: str = "/dev/nvidia") -> list[str]:
    """The NVIDIA device nodes present (`/dev/nvidiactl`, `/dev/nvidia0`, ...)."""
    return sorted({*glob.glob(glob.escape(prefix) + "ctl"), *glob.glob(glob.escape(prefix) + "[0-9]*")})


class _IdleCollector:
    """gpuwatch_agent_idle{node} 1 and gpuwatch_build_info: all an idle agent has to say."""

    def __init__(self, node: str) -> None:
        self.node = node

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from gpuwatch import __version__

        idle = GaugeMetricFamily("gpuwatch_agent_idle", "1: no NVIDIA devices on this node, the agent idles.",
                                 labels=["node"])
        idle.add_metric([self.node], 1.0)
        yield idle
        build = GaugeMetricFamily("gpuwatch_build_info", "gpuwatch build information.", labels=["version"])
        build.add_metric([__version__], 1.0)
        yield build


def idle_registry(node: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_IdleCollector(node))
    return registry


def idle_until_devices(node: str, prefix: str, listen_host: str, listen_port: int, interval_s: float,
                       stop: threading.Event, recheck_s: float = IDLE_RECHECK_S) -> bool:
    """Serve the idle endpoints until NVIDIA devices appear (True) or `stop` is set (False)."""
    from gpuwatch.exporter.liveness import idle_health
    from gpuwatch.exporter.metrics_server import serve

    reason = f"no NVIDIA device nodes ({prefix}ctl, {prefix}N) on this node"
    server = serve(idle_registry(node), listen_host, listen_port, health=idle_health(reason))
    log.info("%s: idling (no probes, no sampling; /metrics, /healthz, /readyz on http://%s:%d); looking "
             "again every %g s", reason, listen_host, server.port, recheck_s)
    try:
        while not stop.wait(recheck_s):
            found = nvidia_devices(prefix)
            if found:
                log.info("NVIDIA devices appeared (%s): starting the agent", ", ".join(found))
                return True
        return False
    finally:
        server.stop()
