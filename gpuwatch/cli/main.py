"""`gpuwatch` root command.

Subcommands are imported only when invoked, so `gpuwatch --help` works on a machine
without NVML, BCC or kernel headers. Typed gpuwatch errors become one-line messages
with a fix instead of tracebacks.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from gpuwatch import __version__
from gpuwatch.core.errors import GpuwatchError

# name -> (module, attribute, one-line help shown in `gpuwatch --help`)
LAZY_COMMANDS: dict[str, tuple[str, str, str]] = {
    "quickstart": ("gpuwatch.cli.quickstart", "quickstart",
                   "Monitor this node's GPUs (or a labelled simulation when there are none)."),
    "top": ("gpuwatch.cli.top", "top", "Live terminal view of GPUs and the containers on them."),
    "agent": ("gpuwatch.cli.agent", "agent", "Node daemon: sampler + exporter (+ probes, enforcer)."),
    "doctor": ("gpuwatch.cli.doctor", "doctor", "Check what this host supports and how to fix gaps."),
    "sim": ("gpuwatch.cli.sim", "sim", "Simulated GPU node for tests, benchmarks and demos."),
    "trace": ("gpuwatch.cli.trace", "trace", "Live per-container stream of GPU driver events (BPF)."),
    "policy": ("gpuwatch.cli.policy", "policy", "Check and explain enforcement policy files."),
    "extender": ("gpuwatch.cli.extender", "extender",
                 "kube-scheduler extender: place GPU pods by what nodes really have (from Prometheus)."),
    "version": ("gpuwatch.cli.main", "version_cmd", "Print the gpuwatch version."),
}


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module only when it is used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(LAZY_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = LAZY_COMMANDS.get(cmd_name)
        if entry is None:
            return None
        module_name, attr, short_help = entry
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            message = f"`gpuwatch {cmd_name}` is unavailable: {err}"
            return _unavailable_command(cmd_name, message, short_help)
        command = getattr(module, attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{module_name}.{attr} is not a click command")
        command.short_help = command.short_help or short_help
        return command

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except GpuwatchError as err:
            raise click.ClickException(str(err)) from err


def _unavailable_command(name: str, message: str, short_help: str) -> click.Command:
    def _fail() -> None:
        raise click.ClickException(message)

    return click.Command(name, callback=_fail, short_help=short_help, help=message)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpuwatch")
def cli() -> None:
    """gpuwatch: who uses which GPU, who breaks the rules, what the scheduler should know.

    Attributes GPU memory and kernel time to containers, pods and namespaces (NVML plus
    eBPF probes), exports Prometheus metrics and enforces per-container limits.

    Start with `gpuwatch doctor` to see what this host supports, then `gpuwatch top`.
    """


@click.command("version")
def version_cmd() -> None:
    """Print the gpuwatch version."""
    click.echo(f"gpuwatch {__version__}")
