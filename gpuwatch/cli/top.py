"""`gpuwatch top`: live terminal view of the GPUs and the containers on them.

Live mode paints a curses screen (gpuwatch/tui/screen.py). `--once` prints one plain
table (or with `--json` one JSON document) for scripts; that is also what happens when
stdout is not a terminal. The sampler (and so NVML) is imported only when needed, so
`gpuwatch top --help` and `--snapshot-file` work on machines without a GPU driver.

`--prometheus URL` shows the whole cluster instead: every node's GPUs and containers as
Prometheus scraped them from the node agents (gpuwatch/cluster), with a NODE column.
"""

from __future__ import annotations

import importlib
import json
import logging
import socket
import sys
import time
from pathlib import Path
from typing import Any

import click

from gpuwatch.cli.runtime_roots import bundle_roots_from, runtime_root_options
from gpuwatch.core import snapshot_doc as jsondoc
from gpuwatch.core.errors import GpuwatchError, NvmlUnavailable
from gpuwatch.core.model import Snapshot
from gpuwatch.tui.render import NVML_FIX, nvml_down_text, plain_table
from gpuwatch.tui.sources import AgentSource, FileSource, SamplerSource, SnapshotSource
from gpuwatch.tui.view_state import SortKey, ViewState, filter_snapshot

ONCE_SETTLE_MAX_S = 0.5
"""With --once: the wait between the two sampler sweeps that utilisation is computed over."""

PROMETHEUS_TIMEOUT_S = 5.0
"""Per query of the cluster view (a person waits; the extender uses a shorter one)."""


def nvml_missing_message(err: GpuwatchError) -> str:
    return f"NVML not found ({err.message}): {NVML_FIX}"


def open_source(snapshot_file: Path | None, nvml_library: str | None, interval_s: float,
                node: str | None, bundle_roots: Any = None, agent_url: str | None = None) -> SnapshotSource:
    """The Snapshot source for this run: a saved document, a running agent, or the live sampler."""
    if snapshot_file is not None:
        return FileSource(snapshot_file)
    if agent_url is not None:
        return AgentSource(agent_url)
    try:
        sampler_module = importlib.import_module("gpuwatch.pipeline.sampler")
    except ImportError as err:
        raise click.ClickException(f"the gpuwatch sampler cannot be loaded: {err}") from err
    try:
        sampler = sampler_module.build_sampler(nvml_library=nvml_library, interval_s=interval_s,
                                               node=node or socket.gethostname(),
                                               bundle_roots=bundle_roots)
    except NvmlUnavailable as err:
        raise click.ClickException(nvml_missing_message(err)) from err
    return SamplerSource(sampler)


def take_once(source: SnapshotSource, settle_s: float, live: bool) -> Snapshot:
    """One Snapshot for --once. A live sampler needs two sweeps for utilisation."""
    snapshot = source.next_snapshot()
    if live:
        time.sleep(settle_s)
        snapshot = source.next_snapshot()
    return snapshot


@click.command("top")
@click.option("--interval", "-d", "interval_s", type=click.FloatRange(min=0.05), default=1.0,
              show_default=True, help="Refresh interval in seconds (+/- change it live).")
@click.option("--once", is_flag=True,
              help="Print one plain-text table and exit (implied when stdout is not a terminal).")
@click.option("--json", "as_json", is_flag=True,
              help="With --once: print one JSON document (node, time, devices, containers with "
                   "identity, processes with host and container PIDs, pods, namespaces). With "
                   "--prometheus: one document for the whole cluster (format gpuwatch.cluster/1: "
                   "nodes[] with name, backend_up, last_scrape, network, gpus[], pair_scores[], "
                   "containers[]; namespaces[] with memory and quota).")
@click.option("--filter", "filter_text", default="", metavar="TEXT",
              help="Only containers whose namespace, pod, container name or id contains TEXT.")
@click.option("--sort", "sort_key", type=click.Choice([k.value for k in SortKey]), default="memory",
              show_default=True, help="Sort containers by this key (`s` cycles it live).")
@click.option("--reverse", is_flag=True, help="Reverse the sort order (`r` live).")
@click.option("--flat", is_flag=True, help="One list of containers instead of grouping them per GPU.")
@click.option("--nvml-library", envvar="GPUWATCH_NVML_LIBRARY", default=None, metavar="PATH",
              help="Path to libnvidia-ml.so.1 (env GPUWATCH_NVML_LIBRARY); e.g. the simulated "
                   "node's library printed by `gpuwatch sim up`.")
@click.option("--node", default=None,
              help="Node name to show (default: this host's name); with --prometheus: only this node.")
@click.option("--snapshot-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              hidden=True, help="Show a saved `--once --json` document, re-read every refresh.")
@click.option("--agent", "agent_url", default=None, metavar="URL",
              help="Show what a running agent exports (its /snapshot.json), e.g. http://127.0.0.1:9400.")
@click.option("--prometheus", "prometheus_url", default=None, metavar="URL",
              help="Show the whole cluster: every node's GPUs and containers as Prometheus has them "
                   "from the node agents, e.g. http://prometheus.monitoring:9090 (NODE column; no PIDs).")
@click.option("--namespace", default=None, metavar="NS",
              help="With --prometheus: only namespace NS's containers, on the GPUs and nodes they use.")
@runtime_root_options
def top(interval_s: float, once: bool, as_json: bool, filter_text: str, sort_key: str, reverse: bool,
        flat: bool, nvml_library: str | None, node: str | None, snapshot_file: Path | None,
        agent_url: str | None, prometheus_url: str | None, namespace: str | None,
        containerd_roots: tuple[str, ...], docker_roots: tuple[str, ...], runc_roots: tuple[str, ...]) -> None:
    """Live terminal view of GPUs and the containers on them.

    Per GPU: memory (bar), utilisation, temperature, power; per container: namespace, pod,
    container, GPU memory, SM share and cumulative kernel seconds. Enter on a container
    shows its processes with host and container PIDs. Press h for all keys.

    With --prometheus URL: the same view over every node Prometheus scrapes gpuwatch
    agents on (--node, --namespace narrow it down).
    """
    _quiet_library_logs()
    state = ViewState(sort_key=SortKey(sort_key), reverse=reverse, filter_text=filter_text,
                      group_by_gpu=not flat, interval_s=interval_s)
    if as_json:
        once = True
    if not once and not sys.stdout.isatty():
        click.echo("gpuwatch top: stdout is not a terminal; printing one table (as with --once)", err=True)
        once = True
    if prometheus_url is not None:
        others = [name for name, given in (("--agent", agent_url), ("--snapshot-file", snapshot_file))
                  if given is not None]
        if others:
            raise click.UsageError(f"--prometheus reads the cluster from Prometheus; drop {', '.join(others)}")
        _cluster_top(prometheus_url, node, namespace, state, once=once, as_json=as_json)
        return
    if namespace is not None:
        raise click.UsageError("--namespace needs --prometheus (locally, use --filter)")

    source = open_source(snapshot_file, nvml_library, interval_s, node,
                         bundle_roots_from(containerd_roots, docker_roots, runc_roots), agent_url)
    try:
        if once:
            sampling_here = snapshot_file is None and agent_url is None
            snapshot = take_once(source, min(interval_s, ONCE_SETTLE_MAX_S), live=sampling_here)
        else:
            _run_live(source, state)
            return
    finally:
        source.close()

    if as_json:
        click.echo(jsondoc.dumps(filter_snapshot(snapshot, filter_text)))
    elif snapshot.gpu_up or snapshot.devices:
        click.echo(plain_table(snapshot, state), nl=False)
    if not snapshot.gpu_up:
        click.echo(f"gpuwatch top: {nvml_down_text(snapshot)}", err=True)
        sys.exit(1)


def _cluster_top(url: str, node: str | None, namespace: str | None, state: ViewState, once: bool,
                 as_json: bool) -> None:
    """`top --prometheus`: the cluster view, one read for --once/--json, else the live screen."""
    from gpuwatch.cluster.prometheus import PrometheusReader
    from gpuwatch.tui.cluster_view import ClusterSource, cluster_document, cluster_snapshot

    try:
        reader = PrometheusReader(url, timeout_s=PROMETHEUS_TIMEOUT_S, cache_s=min(state.interval_s / 2, 1.0))
    except GpuwatchError as err:
        raise click.ClickException(str(err)) from err
    source = ClusterSource(reader, node=node, namespace=namespace)
    try:
        try:  # also before the live screen: a wrong URL fails here, not inside curses
            cluster, simulated = source.read()
        except GpuwatchError as err:
            raise click.ClickException(str(err)) from err
        if as_json:
            click.echo(json.dumps(cluster_document(cluster, simulated, reader.url, state.filter_text), indent=2,
                                  ensure_ascii=False, allow_nan=False))
        elif once:
            click.echo(plain_table(cluster_snapshot(cluster, simulated, reader.url), state), nl=False)
        else:
            _run_live(source, state)
    finally:
        source.close()


def _quiet_library_logs() -> None:
    """Keep the sampler's log lines off the terminal: they would tear the curses screen and
    add noise to --once output. What they say (NVML down, probes off) is in the Snapshot
    (gpu_error, notes) and shown by the view. Configured logging (handlers on the root
    logger) is left alone."""
    if not logging.getLogger().handlers:  # else logging's last-resort handler prints to stderr
        logging.getLogger("gpuwatch").addHandler(logging.NullHandler())


def _run_live(source: SnapshotSource, state: ViewState) -> None:
    import curses

    from gpuwatch.tui.screen import run_screen

    try:
        run_screen(source, state)
    except curses.error as err:
        raise click.ClickException(
            f"cannot start the terminal view ({err}); check TERM, or use --once for plain output") from err
