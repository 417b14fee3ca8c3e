"""`gpuwatch quickstart`: the README's main job.

On a host with NVIDIA GPUs: sample them, serve /metrics on 127.0.0.1 and open `top`.
On a host without: say so loudly, bring up a SIMULATED node (2 GPUs), start 3 pods in
2 namespaces as real runc containers running simulated GPU workloads, and show the same
view and exporter over them. As root it runs the real agent (quickstart_agent.py): kernel
probes on where the host supports them (it says which and, if off, why), and on the
simulated node the enforcer with deploy/policies/demo.yaml, under which the trainer pod is
throttled -- its STATE shows it. Everything started is stopped again on exit (q, Ctrl-C,
SIGTERM, errors), frozen cgroups thawed first.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import click

from gpuwatch.core.model import Snapshot

log = logging.getLogger("gpuwatch.quickstart")
SIM_BANNER = (
    "No NVIDIA driver found on this host (libnvidia-ml.so.1 does not load).\n"
    "Starting a SIMULATED GPU node instead: 2 x 'gpuwatch-sim H100' devices and 3 pods in 2\n"
    "namespaces running simulated GPU workloads in real runc containers. The containers,\n"
    "cgroups, processes and driver ioctls are real; the GPUs are not."
)


def real_nvml_present() -> bool:
    if os.environ.get("GPUWATCH_NVML_LIBRARY"):
        return True
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


class LatestSource:
    """Feeds the screen from the sampler's published Snapshot (the exporter reads the same)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def next_snapshot(self) -> Snapshot:
        snapshot: Snapshot = self.sampler.latest()
        return snapshot

    def close(self) -> None:
        return None


def _serve(stack: ExitStack, sampler: Any, host: str, port: int) -> str:
    from gpuwatch.exporter.metrics_server import registry_for, serve

    try:
        server = serve(registry_for(sampler.latest), host, port, get_snapshot=sampler.latest)
    except OSError as err:
        click.echo(f"port {port} is busy ({err.strerror}); serving on a free port instead", err=True)
        server = serve(registry_for(sampler.latest), host, 0, get_snapshot=sampler.latest)
    stack.callback(server.stop)
    return f"http://{host}:{server.port}/metrics"


def _start_simulation(stack: ExitStack, devices: int) -> tuple[Any, Any, Callable[[], None]]:
    """Sim node + demo pods; returns (sim node, bundle roots for the identity resolver, a
    call that starts the pods: after the agent, so that its probes see them start)."""
    if os.geteuid() != 0:
        raise click.ClickException(
            "the simulated node runs workloads in runc containers, which needs root: "
            "run `sudo gpuwatch quickstart` (or `sudo bash deploy/setup.sh run`)")
    from gpuwatch.containers import BundleRoots
    from gpuwatch.sim import demo
    from gpuwatch.sim import node as simnode
    from gpuwatch.sim.runc import ContainerLab

    click.echo(click.style(SIM_BANNER, fg="yellow", bold=True), err=True)
    click.echo("building the simulated driver libraries and starting the node ...", err=True)
    sim = simnode.up(devices=devices, name="quickstart")
    stack.callback(simnode.down, "quickstart")
    base = Path(tempfile.mkdtemp(prefix="gpuwatch-quickstart-"))
    stack.callback(shutil.rmtree, base, True)  # after the lab below has stopped its containers
    dirs = demo.default_lab_dirs(base)
    lab = ContainerLab(**dirs)
    stack.enter_context(lab)

    def start_pods() -> None:
        click.echo(f"starting {len(demo.DEFAULT_WORKLOADS)} pods (runc) ...", err=True)
        demo.start_workloads(lab, sim)

    bundle_roots = BundleRoots(containerd_tasks=(str(dirs["bundle_root"]),),
                               runc_state=(str(dirs["runc_root"]),),
                               docker_containers=(str(dirs["docker_root"] / "containers"),))
    return sim, bundle_roots, start_pods


@click.command("quickstart")
@click.option("--listen", default="127.0.0.1:9400", show_default=True, metavar="HOST:PORT",
              help="Where /metrics is served while the view runs.")
@click.option("--interval", "interval_s", type=click.FloatRange(0.1, 60), default=1.0, show_default=True)
@click.option("--simulate", is_flag=True, help="Use the simulated node even if real GPUs are present.")
@click.option("--duration", "duration_s", type=float, default=None,
              help="Stop after this many seconds (default: until q / Ctrl-C; 10 s without a terminal).")
def quickstart(listen: str, interval_s: float, simulate: bool, duration_s: float | None) -> None:
    """Monitor this node's GPUs; with no GPU, a clearly labelled simulated node with 3 pods.

    Opens the `gpuwatch top` view and serves Prometheus metrics on --listen meanwhile.
    Without a terminal it prints the table once after a few samples instead.
    """
    from gpuwatch.cli.addresses import parse_listen
    from gpuwatch.pipeline.sampler import build_sampler

    host, port = parse_listen(listen, "--listen")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # unwind the ExitStack: nothing left behind
    simulated = simulate or not real_nvml_present()
    with ExitStack() as stack:
        nvml_library: str | None = None
        bundle_roots = None
        sim = None
        start_pods: Callable[[], None] = _nothing
        if simulated:
            sim, bundle_roots, start_pods = _start_simulation(stack, devices=2)
            nvml_library = str(sim.libraries.nvml_path)
            os.environ["GPUWATCH_SIM_STATE"] = str(sim.state_path)  # the fake NVML reads it at init
        if os.geteuid() == 0:  # the agent: probes, and the enforcer on the simulated node
            _run_agent(stack, host, port, interval_s, nvml_library, bundle_roots, sim, start_pods, duration_s)
            click.echo("stopping: containers, simulated node, agent and exporter are being cleaned up", err=True)
            return
        start_pods()
        click.echo("kernel probes: OFF -- not running as root (BPF needs it; `sudo gpuwatch quickstart` "
                   "turns them on); NVML monitoring only", err=True)
        sampler = build_sampler(nvml_library=nvml_library, interval_s=interval_s,
                                node=socket.gethostname(), bundle_roots=bundle_roots)
        sampler.start()
        stack.callback(sampler.stop)
        url = _serve(stack, sampler, host, port)
        click.echo(f"metrics: {url}   (try: curl -s {url} | grep gpuwatch_container)", err=True)
        _show(sampler, interval_s, duration_s)
        click.echo("stopping: containers, simulated node and exporter are being cleaned up", err=True)


def _nothing() -> None:
    return None


def _run_agent(stack: ExitStack, host: str, port: int, interval_s: float, nvml_library: str | None,
               bundle_roots: Any, sim: Any, start_pods: Callable[[], None], duration_s: float | None) -> None:
    """Run the real agent (probes; enforcer with the demo policy on the simulated node), say
    what is on and why not, then show its view (as `gpuwatch top --agent`)."""
    from gpuwatch.cli.quickstart_agent import AgentViewSource, free_port, probes_note, probes_summary, start_agent
    from gpuwatch.sim import demo

    work = Path(tempfile.mkdtemp(prefix="gpuwatch-quickstart-agent-"))
    stack.callback(shutil.rmtree, work, True)
    bound = free_port(host, port)
    if bound != port:
        click.echo(f"port {port} is busy; serving on {bound} instead", err=True)
    policy = demo.demo_policy_path() if sim is not None else None
    click.echo("starting the agent (compiling the kernel probes takes a few seconds) ...", err=True)
    agent = start_agent(work, host, bound, interval_s, nvml_library, bundle_roots, policy,
                        device_prefix=str(sim.dev_dir / "nvidia") if sim is not None else "/dev/nvidia",
                        kmsg_path=str(sim.kmsg_path) if sim is not None else "/dev/kmsg")
    stack.callback(agent.stop)  # first on the way out: throttled pods are thawed before they stop
    first = agent.snapshot()
    start_pods()
    click.echo(click.style(probes_summary(first, agent.log.lines), bold=True), err=True)
    if policy is not None:
        namespace, pod = demo.DEMO_THROTTLED_POD
        click.echo(click.style(
            f"enforcer: ON with {demo.DEMO_POLICY_RELPATH} -- {namespace}/{pod} may use 30% GPU time; it uses "
            f"~60%, so within seconds its STATE reads 'throttled to 30%' (audit log: {work / 'audit.jsonl'})",
            bold=True), err=True)
    elif sim is not None:
        click.echo(f"enforcer: OFF -- {demo.DEMO_POLICY_RELPATH} ships with the source tree, not found here",
                   err=True)
    else:
        click.echo("enforcer: OFF -- no policy on real GPUs (try: gpuwatch agent --policy "
                   "deploy/policies/alert-only.yaml --dry-run)", err=True)
    click.echo(f"metrics: {agent.url}/metrics   (try: curl -s {agent.url}/metrics | grep gpuwatch_container; "
               f"the same view elsewhere: gpuwatch top --agent {agent.url})", err=True)
    notes: tuple[str, ...] = (probes_note(first, agent.log.lines),)
    if policy is not None:
        notes += (f"enforcer ON: {demo.DEMO_POLICY_RELPATH} limits {'/'.join(demo.DEMO_THROTTLED_POD)} "
                  "to 30% GPU time (STATE)",)
    _show_source(AgentViewSource(agent, notes), interval_s, duration_s)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _show(sampler: Any, interval_s: float, duration_s: float | None) -> None:
    _show_source(LatestSource(sampler), interval_s, duration_s)


def _show_source(source: Any, interval_s: float, duration_s: float | None) -> None:
    from gpuwatch.tui.render import plain_table
    from gpuwatch.tui.view_state import ViewState

    state = ViewState(interval_s=interval_s)
    if sys.stdout.isatty() and duration_s is None:
        from gpuwatch.tui.screen import run_screen

        run_screen(source, state)
        return
    wait_s = duration_s if duration_s is not None else 10.0
    time.sleep(max(wait_s, 2 * interval_s + 0.5))
    click.echo(plain_table(source.next_snapshot(), state), nl=False)
