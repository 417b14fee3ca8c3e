"""The shipped Prometheus rules are valid and behave as documented (promtool, real binary)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import need_binary

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"


def test_rules_are_valid() -> None:
    promtool = need_binary("promtool", "prometheus")
    out = subprocess.run([promtool, "check", "rules", str(DASHBOARDS / "gpuwatch-rules.yml")],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rule_unit_tests_pass() -> None:
    promtool = need_binary("promtool", "prometheus")
    out = subprocess.run([promtool, "test", "rules", str(DASHBOARDS / "tests" / "rules_test.yml")],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr
