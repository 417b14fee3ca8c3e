"""`gpuwatch extender`: kube-scheduler's extender webhook over the agents' metrics in Prometheus."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

import click

from gpuwatch.cli.addresses import parse_listen
from gpuwatch.cli.envvars import with_env_options
from gpuwatch.policy.placement import PLACEMENT_POLICIES

log = logging.getLogger("gpuwatch.extender")


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives threads their own malloc arenas (up to 8 per core), most of a threaded
    server's RSS; the extender's threads allocate little each, so two arenas suffice."""
    import contextlib
    import ctypes

    m_arena_max = -8  # <malloc.h>
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to tune
        ctypes.CDLL("libc.so.6").mallopt(m_arena_max, arenas)


def _size(text: str) -> int:
    from gpuwatch.extender.request import parse_quantity

    try:
        return int(parse_quantity(text))
    except ValueError as err:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 512Mi, 1Gi)") from err


@with_env_options
@click.command("extender")
@click.option("--listen", default="127.0.0.1:8888", show_default=True, metavar="HOST:PORT",
              help="Where kube-scheduler calls the verbs. In a cluster: 0.0.0.0:8888 behind a Service.")
@click.option("--prometheus-url", required=True, metavar="URL",
              help="The Prometheus that scrapes every node's gpuwatch agent, e.g. http://prometheus:9090.")
@click.option("--policy", type=click.Choice(PLACEMENT_POLICIES), default="binpack", show_default=True,
              help="binpack: fullest GPUs/nodes that still fit (keeps whole nodes free); spread: emptiest.")
@click.option("--url-prefix", default="", metavar="PATH",
              help="Path before the verbs: kube-scheduler's urlPrefix path part (e.g. /gpuwatch).")
@click.option("--memory-margin", default="512Mi", show_default=True, metavar="SIZE",
              help="Safety margin kept free on every GPU (at least; 2%% of the GPU's size when larger).")
@click.option("--max-data-age", "max_data_age_s", type=click.FloatRange(1, 3600), default=30.0,
              show_default=True, help="Seconds: older gpuwatch data in Prometheus counts as stale (filter "
                                      "then answers with Error, and an ignorable extender is skipped).")
@click.option("--promise-ttl", "promise_ttl_s", type=click.FloatRange(0, 600), default=10.0, show_default=True,
              help="Seconds memory promised to a just-placed pod counts until its metrics show it.")
@click.option("--prometheus-timeout", "prometheus_timeout_s", type=click.FloatRange(0.1, 60), default=2.0,
              show_default=True, help="Seconds for one batch of Prometheus queries, from connecting to the last byte "
                                      "(keep below kube-scheduler's httpTimeout).")
@click.option("--prometheus-max-bytes", default="32Mi", show_default=True, metavar="SIZE",
              help="Largest Prometheus answer read (a batch's answers together: twice this); 1,000 nodes' "
                   "largest is ~10 MiB.")
@click.option("--cache", "cache_s", type=click.FloatRange(0, 60), default=1.0, show_default=True,
              help="Seconds one batch of Prometheus answers is reused (one scheduling cycle).")
@click.option("--threads", type=click.IntRange(1, 64), default=8, show_default=True,
              help="Requests answered at once.")
@click.option("--max-request-bytes", default="32Mi", show_default=True, metavar="SIZE",
              help="Largest request body (full Node lists of big clusters are large; nodeCacheCapable is small).")
@click.option("-v", "--verbose", count=True, help="-v info (default), -vv debug: per-node reasoning.")
def extender(listen: str, prometheus_url: str, policy: str, url_prefix: str, memory_margin: str,
             max_data_age_s: float, promise_ttl_s: float, prometheus_timeout_s: float,
             prometheus_max_bytes: str, cache_s: float, threads: int, max_request_bytes: str, verbose: int) -> None:
    """Run a kube-scheduler extender (filter + prioritize verbs) until SIGTERM.

    \b
    filter:     a node passes when it has enough healthy GPUs whose real free memory
                (minus the margin and memory promised to pods on their way) fits the
                pod, idle GPUs for exclusive pods, and the namespace is under quota;
                every failed node gets a reason kube-scheduler shows in the pod's events.
    prioritize: binpack or spread, NVLink/PCIe pair scores for multi-GPU pods, network
                headroom for remote-GPU pods; scores 0..10.

    What a pod asks for: nvidia.com/gpu limits and the annotations gpuwatch.io/gpu-memory
    (8Gi), gpuwatch.io/gpu-share ("0.5"), gpuwatch.io/sharing (exclusive|shared|auto),
    gpuwatch.io/remote-gpu ("true"). Configure it in a KubeSchedulerConfiguration with
    ignorable: true (deploy/scheduling/), so scheduling goes on when Prometheus is down.

    Every option can be set from the environment too, as GPUWATCH_EXTENDER_<OPTION> (the
    variable is named with each option below); an argument wins over the environment.
    """
    from gpuwatch.cluster.source import PrometheusCluster
    from gpuwatch.extender.node_fit import PlacementConfig
    from gpuwatch.extender.promises import Promises
    from gpuwatch.extender.server import ExtenderApp, ExtenderMetrics, ExtenderServer
    from gpuwatch.extender.service import Extender

    logging.basicConfig(level=logging.DEBUG if verbose > 1 else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _limit_malloc_arenas()
    host, port = parse_listen(listen, "--listen")
    # a view is refreshed in the background once older than --cache, and served meanwhile
    # while its data is within --max-data-age (the bound filter enforces anyway)
    cluster = PrometheusCluster(prometheus_url, timeout_s=prometheus_timeout_s, cache_s=cache_s,
                                revalidate_s=max_data_age_s, max_bytes=_size(prometheus_max_bytes))
    cluster.warm()  # the worker process that parses Prometheus' answers, before the first request
    promises = Promises(ttl_s=promise_ttl_s)
    service = Extender(cluster, PlacementConfig(policy=policy, margin_bytes=_size(memory_margin),
                                                max_data_age_s=max_data_age_s), promises)
    metrics = ExtenderMetrics(prometheus_errors=lambda: float(cluster.errors_total),
                              prometheus_queries=lambda: float(cluster.queries_total),
                              promises=lambda: float(len(promises)))
    try:
        server = ExtenderServer(ExtenderApp(service, metrics, url_prefix), host, port, threads=threads,
                                max_body_bytes=_size(max_request_bytes))
    except OSError as err:
        raise click.ClickException(f"cannot listen on {listen}: {err.strerror or err}") from err
    stop = threading.Event()

    def _on_stop(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _on_stop)
    signal.signal(signal.SIGINT, _on_stop)
    server.start()
    prefix = "/" + url_prefix.strip("/") if url_prefix.strip("/") else ""
    log.info("extender on %s%s/{filter,prioritize} (policy %s), reading %s", server.url, prefix, policy,
             prometheus_url)
    try:
        stop.wait()
    finally:
        cluster.close()  # first: requests waiting on a refresh get their error now, not after it
        server.stop()
