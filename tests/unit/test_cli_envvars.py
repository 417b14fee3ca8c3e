"""Every option of `gpuwatch agent` and `gpuwatch extender` can be set from the environment
as GPUWATCH_<COMMAND>_<OPTION>, named in --help; arguments win; older names still work."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from gpuwatch.cli.agent import agent
from gpuwatch.cli.envvars import env_name
from gpuwatch.cli.extender import extender


def _options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and not p.hidden]


@pytest.mark.parametrize("command", [agent, extender], ids=["agent", "extender"])
def test_every_option_has_its_variable_in_help(command: click.Command) -> None:
    assert command.name is not None
    help_text = CliRunner().invoke(command, ["--help"], terminal_width=400).output
    for option in _options(command):
        name = env_name(command.name, option)
        long = next(o for o in option.opts if o.startswith("--"))
        assert name == "GPUWATCH_" + command.name.upper() + "_" + long[2:].upper().replace("-", "_")
        envvars = [option.envvar] if isinstance(option.envvar, str) else list(option.envvar or [])
        assert name in envvars, long
        assert name in help_text, f"{long}: {name} not shown in --help"


def _params(command: click.Command, args: list[str]) -> dict[str, object]:
    with command.make_context(command.name, args) as ctx:
        return dict(ctx.params)


def test_agent_options_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWATCH_AGENT_INTERVAL", "2.5")
    monkeypatch.setenv("GPUWATCH_AGENT_PROBES", "false")
    monkeypatch.setenv("GPUWATCH_AGENT_DRY_RUN", "1")
    monkeypatch.setenv("GPUWATCH_AGENT_CONTAINERD_ROOT", "/a /b")
    monkeypatch.setenv("GPUWATCH_AGENT_LISTEN", "0.0.0.0:9400")
    params = _params(agent, [])
    assert params["interval_s"] == 2.5 and params["probes"] is False and params["dry_run"] is True
    assert params["containerd_roots"] == ("/a", "/b")
    assert params["listen"] == "0.0.0.0:9400"
    assert _params(agent, ["--interval", "3"])["interval_s"] == 3.0  # the argument wins


def test_agent_keeps_its_older_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWATCH_LOCK_FILE", "/tmp/old.lock")
    assert _params(agent, [])["lock_file"] == "/tmp/old.lock"
    monkeypatch.delenv("GPUWATCH_LOCK_FILE")
    monkeypatch.setenv("GPUWATCH_AGENT_LOCK_FILE", "/tmp/new.lock")
    assert _params(agent, [])["lock_file"] == "/tmp/new.lock"


def test_extender_required_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWATCH_EXTENDER_PROMETHEUS_URL", "http://prometheus:9090")
    monkeypatch.setenv("GPUWATCH_EXTENDER_MAX_DATA_AGE", "12")
    params = _params(extender, [])
    assert params["prometheus_url"] == "http://prometheus:9090" and params["max_data_age_s"] == 12.0


def test_bad_environment_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWATCH_AGENT_INTERVAL", "fast")
    result = CliRunner().invoke(agent, [])
    assert result.exit_code == 2
    assert "interval" in result.output.lower() and "fast" in result.output
