"""`gpuwatch top` command line: --once/--json/non-TTY, flags, sampler wiring and errors.

The sampler is replaced by a fake module implementing the same interface
(`build_sampler(...) -> object with run_once()/stop()`), so these run without NVML.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuwatch.cli import top as top_module
from gpuwatch.cli.main import cli
from gpuwatch.core import snapshot_doc as jsondoc
from gpuwatch.core.errors import NvmlUnavailable
from gpuwatch.core.model import Snapshot
from tests.unit.test_tui_samples import sample_snapshot


@pytest.fixture
def snap_file(tmp_path: Path) -> Path:
    path = tmp_path / "snap.json"
    path.write_text(jsondoc.dumps(sample_snapshot()), encoding="utf-8")
    return path


def run(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(cli, ["top", *args], env=env)


def test_help_works_and_hides_snapshot_file() -> None:
    result = run("--help")
    assert result.exit_code == 0
    for flag in ("--interval", "-d", "--once", "--json", "--filter", "--sort", "--nvml-library", "--node"):
        assert flag in result.output
    assert "--snapshot-file" not in result.output


def test_not_a_tty_behaves_as_once_and_says_so(snap_file: Path) -> None:
    result = run("--snapshot-file", str(snap_file))
    assert result.exit_code == 0, result.output
    assert "not a terminal" in result.stderr
    assert "GPU 0" in result.stdout and "trainer" in result.stdout and "4321" in result.stdout
    assert "not a terminal" not in result.stdout


def test_once_prints_table_without_the_notice(snap_file: Path) -> None:
    result = run("--once", "--snapshot-file", str(snap_file))
    assert result.exit_code == 0
    assert result.stderr == ""
    assert "SIMULATED GPU NODE" in result.stdout


def test_once_json_is_the_document(snap_file: Path) -> None:
    result = run("--once", "--json", "--snapshot-file", str(snap_file))
    assert result.exit_code == 0
    assert jsondoc.loads(result.stdout) == sample_snapshot()


def test_json_alone_implies_once_and_filter_applies(snap_file: Path) -> None:
    result = run("--json", "--filter", "research", "--snapshot-file", str(snap_file))
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert [c["identity"]["container_name"] for c in doc["containers"]] == ["jupyter"]
    assert [p["pod"] for p in doc["pods"]] == ["nb-7"]


def test_sort_and_flat_flags_reach_the_table(snap_file: Path) -> None:
    result = run("--once", "--flat", "--sort", "sm", "--snapshot-file", str(snap_file))
    rows = [line.split()[2] for line in result.stdout.splitlines()
            if line.startswith("  ") and ("GiB" in line or "MiB" in line) and "host pid" not in line]
    assert rows == ["server", "trainer", "jupyter", "(host)"]
    reverse = run("--once", "--flat", "--sort", "sm", "--reverse", "--snapshot-file", str(snap_file))
    rows_rev = [line.split()[2] for line in reverse.stdout.splitlines()
                if line.startswith("  ") and ("GiB" in line or "MiB" in line) and "host pid" not in line]
    assert rows_rev == list(reversed(rows))


def test_bad_sort_key_is_rejected(snap_file: Path) -> None:
    result = run("--once", "--sort", "colour", "--snapshot-file", str(snap_file))
    assert result.exit_code == 2 and "colour" in result.output


def test_missing_snapshot_file_is_one_clear_error(tmp_path: Path) -> None:
    result = run("--once", "--snapshot-file", str(tmp_path / "nope.json"))
    assert result.exit_code == 1
    assert "cannot read snapshot file" in result.stderr and "Traceback" not in result.output


# --------------------------------------------------------------------------- sampler wiring


class FakeSampler:
    def __init__(self, snapshots: list[Snapshot]) -> None:
        self.snapshots = snapshots
        self.sweeps = 0
        self.stopped = False

    def run_once(self) -> Snapshot:
        snap = self.snapshots[min(self.sweeps, len(self.snapshots) - 1)]
        self.sweeps += 1
        return snap

    def stop(self) -> None:
        self.stopped = True


def install_fake_sampler(monkeypatch: pytest.MonkeyPatch, sampler: FakeSampler | Exception) -> dict[str, Any]:
    calls: dict[str, Any] = {}

    def build_sampler(nvml_library: str | None = None, interval_s: float = 1.0, node: str | None = None,
                      **kw: Any) -> FakeSampler:
        calls.update(nvml_library=nvml_library, interval_s=interval_s, node=node)
        if isinstance(sampler, Exception):
            raise sampler
        return sampler

    module = types.ModuleType("gpuwatch.pipeline.sampler")
    module.build_sampler = build_sampler  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gpuwatch.pipeline.sampler", module)
    sleeps: list[float] = []
    monkeypatch.setattr(top_module.time, "sleep", sleeps.append)
    calls["sleeps"] = sleeps
    return calls


def test_once_takes_two_sweeps_and_prints_the_second(monkeypatch: pytest.MonkeyPatch) -> None:
    first = dataclasses.replace(sample_snapshot(), node="first-sweep")
    second = dataclasses.replace(sample_snapshot(), node="second-sweep")
    sampler = FakeSampler([first, second])
    calls = install_fake_sampler(monkeypatch, sampler)
    result = run("--once", "-d", "2")
    assert result.exit_code == 0, result.output
    assert sampler.sweeps == 2 and sampler.stopped
    assert calls["sleeps"] == [top_module.ONCE_SETTLE_MAX_S]
    assert "node second-sweep" in result.stdout and "first-sweep" not in result.stdout
    assert calls["interval_s"] == 2.0
    assert calls["node"] == socket.gethostname()


def test_short_interval_shortens_the_settle_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = install_fake_sampler(monkeypatch, FakeSampler([sample_snapshot()]))
    assert run("--once", "--interval", "0.1").exit_code == 0
    assert calls["sleeps"] == [0.1]


def test_nvml_library_flag_env_and_node(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = install_fake_sampler(monkeypatch, FakeSampler([sample_snapshot()]))
    assert run("--once", "--nvml-library", "/x/libnvidia-ml.so.1", "--node", "n7").exit_code == 0
    assert (calls["nvml_library"], calls["node"]) == ("/x/libnvidia-ml.so.1", "n7")
    assert run("--once", env={"GPUWATCH_NVML_LIBRARY": "/sim/lib.so"}).exit_code == 0
    assert calls["nvml_library"] == "/sim/lib.so"


def test_nvml_missing_is_one_line_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_sampler(monkeypatch, NvmlUnavailable("libnvidia-ml.so.1: cannot open shared object file"))
    result = run("--once")
    assert result.exit_code == 1
    error_lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(error_lines) == 1
    assert "NVML not found" in error_lines[0] and "cannot open shared object" in error_lines[0]
    assert "gpuwatch sim up" in error_lines[0] and "--nvml-library" in error_lines[0]
    assert result.stdout == ""


def test_nvml_down_snapshot_exits_nonzero_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    down = Snapshot(timestamp_s=1.0, node="n", devices=(), containers=(), gpu_up=False,
                    gpu_error="NVML_ERROR_DRIVER_NOT_LOADED")
    install_fake_sampler(monkeypatch, FakeSampler([down]))
    result = run("--once")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in result.stderr and "gpuwatch sim up" in result.stderr
    as_json = run("--once", "--json")
    assert as_json.exit_code == 1
    assert json.loads(as_json.stdout)["gpu_up"] is False


def test_missing_sampler_module_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gpuwatch.pipeline.sampler", None)  # import raises ImportError
    result = run("--once")
    assert result.exit_code == 1 and "sampler cannot be loaded" in result.stderr


def test_sampler_warnings_do_not_reach_the_terminal() -> None:
    """Without logging configured, a sampler warning would be printed by logging's last-resort
    handler onto the curses screen; `top` routes gpuwatch logs to a NullHandler instead."""
    script = (
        "import logging, sys\n"
        "from gpuwatch.cli.top import _quiet_library_logs\n"
        "_quiet_library_logs()\n"
        "logging.getLogger('gpuwatch.pipeline.sampler').warning('GPU backend down')\n"
        "logging.getLogger('other').warning('still shown')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0
    assert "GPU backend down" not in done.stderr
    assert "still shown" in done.stderr


def test_agent_source_shows_what_a_running_exporter_serves() -> None:
    """`top --agent URL` reads the real exporter's /snapshot.json (same format as --json)."""
    from gpuwatch.exporter.metrics_server import registry_for, serve

    snap = sample_snapshot()
    server = serve(registry_for(lambda: snap), "127.0.0.1", 0, get_snapshot=lambda: snap)
    try:
        result = run("--once", "--json", "--agent", server.url)
        assert result.exit_code == 0, result.output
        shown = jsondoc.loads(result.output)
        assert [c.identity.container_id for c in shown.containers] == [c.identity.container_id for c in snap.containers]
        assert [c.memory_bytes for c in shown.containers] == [c.memory_bytes for c in snap.containers]
        table = run("--once", "--agent", server.url)
        assert table.exit_code == 0 and snap.containers[0].identity.pod_name in table.output
    finally:
        server.stop()


def test_agent_source_unreachable_says_how_to_fix() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run("--once", "--agent", f"http://127.0.0.1:{port}")
    assert result.exit_code != 0
    assert "cannot read" in result.output and "--agent" in result.output
