"""`gpuwatch doctor`: what this host supports, what is off, and the fix for each gap."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from gpuwatch.cli.hostcheck import Status, run_all

_MARK = {Status.OK: "ok  ", Status.WARN: "WARN", Status.FAIL: "FAIL"}


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as one JSON document.")
@click.option("--strict", is_flag=True, help="Exit 1 when any check is not ok (for scripts and CI).")
def doctor(as_json: bool, strict: bool) -> None:
    """Check root, NVML, BCC + kernel headers, BTF, cgroup mode, tracepoints, runc, Prometheus.

    Every capability gpuwatch can lose is listed with what you lose and how to fix it.
    The kernel-headers line names the tree BCC will compile the probes against and where it
    comes from: BCC_KERNEL_SOURCE, host /lib/modules, host merged tree (deploy/setup.sh) or
    image bundled tree (the agent image's own Debian headers, for hosts that have none).
    Nothing is changed on the host.
    """
    checks = run_all()
    if as_json:
        click.echo(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            click.echo(f"[{_MARK[c.status]}] {c.name:<{width}}  {c.found}")
            if c.status is not Status.OK:
                if c.loses:
                    click.echo(f"       {'':<{width}}  loses: {c.loses}")
                if c.fix:
                    click.echo(f"       {'':<{width}}  fix:   {c.fix}")
    if strict and any(c.status is not Status.OK for c in checks):
        raise SystemExit(1)
