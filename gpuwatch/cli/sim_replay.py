"""`gpuwatch sim replay TRACE`: re-issue a recorded ioctl trace on the simulated node.

Registered on the `sim` group (gpuwatch/cli/sim.py); the sim package is imported inside the
command so `gpuwatch --help` stays fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.command("replay")
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--name", "name", default="default", show_default=True,
              help="Simulated node whose device nodes receive the calls (when --sim-root is not given).")
@click.option("--sim-root", "sim_root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Sim root holding dev/nvidiactl, dev/nvidiaN, dev/nvidia-uvm (default: the node's).")
@click.option("--pause-at-checkpoints", is_flag=True,
              help='At each checkpoint print {"checkpoint": NAME, "nvml": [...]} on stdout and wait for a line '
                   "on stdin (a test reads the probe maps meanwhile).")
@click.option("--driver", "driver", type=click.Choice(["none", "fuse"]), default="none", show_default=True,
              help="none: each block carries the driver's recorded answer before the call. fuse: a user-space "
                   "driver (FUSE, in the replay's own mount namespace) writes the answer into the argument's "
                   "block during the call, as the real driver does; needs root.")
def replay_cmd(trace_path: Path, name: str, sim_root: Path | None, pause_at_checkpoints: bool, driver: str) -> None:
    """Re-issue the ioctls of a recorded trace (gpuwatch/sim/TRACE_FORMAT.md) on the
    simulated node's device nodes, so the real kernel probes decode them.

    Each call's parameter blocks are rebuilt with the driver's recorded answer already in
    place (no driver runs on the simulated node); the replaying process is the traced one.

    \b
    gpuwatch sim replay trace.jsonl --sim-root /run/gpuwatch-sim/default
    gpuwatch sim replay trace.jsonl --pause-at-checkpoints   # JSON line per checkpoint, then wait
    """
    from gpuwatch.sim.replay import Replayer
    from gpuwatch.sim.tracefile import Checkpoint, read_trace

    trace = read_trace(trace_path)
    if sim_root is None:
        from gpuwatch.sim import node as simnode

        sim_root = simnode.get_node(name).root

    def pause(cp: Checkpoint) -> None:
        click.echo(json.dumps({"checkpoint": cp.name, "nvml": list(cp.nvml)}))
        sys.stdout.flush()
        if sys.stdin.readline() == "":
            raise click.ClickException(f"stdin closed at checkpoint {cp.name!r}: replay stopped")

    report = Replayer(sim_root / "dev", pause if pause_at_checkpoints else None, driver=driver).replay(trace)
    click.echo(f"replayed {trace_path}: {report.opens} opens, {report.ioctls} ioctls, "
               f"{report.checkpoints} checkpoints", err=True)
