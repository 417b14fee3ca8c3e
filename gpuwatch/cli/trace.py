"""`gpuwatch trace`: a live per-container stream of GPU driver events, like the bcc tools.

Device opens, allocations with sizes, frees, out-of-memory returns, over-limit allocations
and kills, each with its process and container/pod/namespace. This is an explicit debugging
tool: it compiles the probes with per-event records switched on (-DGW_VERBOSE_EVENTS=1);
the agent never does. Needs root, BCC and kernel headers (see `gpuwatch doctor`).
"""

from __future__ import annotations

import signal
import sys
import time
from types import FrameType

import click

from gpuwatch.core.model import ContainerIdentity
from gpuwatch.probes.kernel_events import KernelEvent
from gpuwatch.probes.manager import ProbeConfig, ProbeManager
from gpuwatch.probes.trace_view import HEADER, TraceFilter, format_json, format_line

RESCAN_INTERVAL_S = 5.0


class _Stop(Exception):
    """Raised from the SIGTERM handler to leave the event loop through `finally`."""


class _Identities:
    """Event -> container identity via gpuwatch.containers: by the event's pid (reads
    /proc/<pid>/cgroup, so a brand-new container is known at once), else by cgroup id (the
    process may have exited). Answers are cached briefly: metadata can appear a moment later."""

    TTL_S = 1.0

    def __init__(self) -> None:
        from gpuwatch.containers.resolver import IdentityResolver

        self._resolver = IdentityResolver()
        self._cache: dict[int, tuple[float, ContainerIdentity]] = {}

    def get(self, ev: KernelEvent) -> ContainerIdentity | None:
        now = time.monotonic()
        hit = self._cache.get(ev.cgroup_id)
        if hit is not None and now - hit[0] < self.TTL_S:
            return hit[1]
        identity: ContainerIdentity | None = None
        proc = self._resolver.resolve_pid(ev.tgid)
        if proc is not None and proc.identity.cgroup_id in (None, ev.cgroup_id):
            identity = proc.identity
        if identity is None:
            identity = self._resolver.identity_for_cgroup_id(ev.cgroup_id)
        if identity is None and hit is not None:
            identity = hit[1]  # the cgroup is gone now; what we knew of it still holds
        if identity is not None:
            self._cache[ev.cgroup_id] = (now, identity)
        return identity


@click.command("trace")
@click.option("--container", default=None, help="Only this container (name, or id prefix).")
@click.option("--pod", default=None, help="Only this pod (name).")
@click.option("--namespace", default=None, help="Only this namespace.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--device-prefix", default="/dev/nvidia", show_default=True,
              help="Path prefix of the GPU device nodes (the simulated node uses its own).")
@click.option("--libcuda", "libcuda_paths", multiple=True, metavar="PATH",
              help="libcuda copy to probe (repeatable; default: ld cache, running processes, "
                   "container root filesystems).")
@click.option("--no-uprobes", is_flag=True, help="Driver ioctls only; no libcuda uprobes.")
@click.option("--duration", "duration_s", type=click.FloatRange(min=0), default=0.0,
              help="Stop after this many seconds (0 = until Ctrl-C / SIGTERM).")
def trace(container: str | None, pod: str | None, namespace: str | None, as_json: bool,
          device_prefix: str, libcuda_paths: tuple[str, ...], no_uprobes: bool, duration_s: float) -> None:
    """Live per-container stream of GPU driver events (BPF)."""
    flt = TraceFilter(container=container, pod=pod, namespace=namespace)
    pm = ProbeManager(ProbeConfig(device_prefix=device_prefix, libcuda_paths=libcuda_paths,
                                  alloc_uprobes=not no_uprobes, verbose_events=True))

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        pm.start()
        identities = _Identities()
        libs = ", ".join(lib.path for lib in pm.attached_libraries()) or "none"
        click.echo(f"gpuwatch trace: probes attached (device prefix {device_prefix}; libcuda: {libs}); "
                   "Ctrl-C to stop", err=True)
        if not as_json:
            click.echo(HEADER)
        t0_ns = time.monotonic_ns()
        deadline = time.monotonic() + duration_s if duration_s else None
        next_rescan = time.monotonic() + RESCAN_INTERVAL_S
        while deadline is None or time.monotonic() < deadline:
            for ev in pm.poll_events(200):
                identity = identities.get(ev)
                if not flt.matches(identity):
                    continue
                click.echo(format_json(ev, identity) if as_json else format_line(ev, identity, t0_ns))
            sys.stdout.flush()
            if time.monotonic() >= next_rescan:
                pm.rescan()
                next_rescan = time.monotonic() + RESCAN_INTERVAL_S
    except (KeyboardInterrupt, _Stop):
        pass  # a requested stop: detach below and exit 0
    finally:
        pm.stop()
        signal.signal(signal.SIGTERM, previous)
