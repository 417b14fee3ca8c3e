"""Every option of a long-running command settable from the environment.

Containers and systemd units configure daemons by environment more often than by
arguments (a ConfigMap's `envFrom`, an `Environment=` line). `with_env_options` gives each
option of a command the variable `GPUWATCH_<COMMAND>_<OPTION>` (dashes as underscores,
upper case: `--prometheus-url` of `extender` is GPUWATCH_EXTENDER_PROMETHEUS_URL) and shows
it in `--help`. The prefix is click's `auto_envvar_prefix` shape, but the name is the long
option's as the user reads it in --help (`--interval` -> ..._INTERVAL), not click's
Python parameter name (`interval_s`), which auto_envvar_prefix would use. A variable an option
already had (GPUWATCH_NVML_LIBRARY) keeps working beside it and wins when both are set.
A command-line argument always wins over the environment. Flags take 1/0, true/false,
yes/no; options given several times take a space-separated list.
"""

from __future__ import annotations

import click


def env_name(command: str, option: click.Option) -> str:
    """GPUWATCH_<COMMAND>_<OPTION> for one option of `gpuwatch <command>`."""
    longs = [opt for opt in option.opts if opt.startswith("--")]
    name = longs[0][2:] if longs else (option.name or "")
    return f"GPUWATCH_{command}_{name}".upper().replace("-", "_")


def with_env_options(command: click.Command) -> click.Command:
    """Give every option of `command` its GPUWATCH_<COMMAND>_<OPTION> variable (in --help too)."""
    assert command.name is not None
    for param in command.params:
        if not isinstance(param, click.Option) or param.name is None or param.hidden:
            continue
        auto = env_name(command.name, param)
        if isinstance(param.envvar, str):
            param.envvar = [param.envvar, auto]
        elif param.envvar:
            param.envvar = [*param.envvar, auto]
        else:
            param.envvar = auto
        param.show_envvar = True
    return command
