"""The promtool cases of every alert (dashboards/tests/alerts_test.yml beside rules_test.yml)
pass with the real promtool, and the generated PrometheusRule's rules check as rule files."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.conftest import need_binary

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"


def test_alert_cases_pass() -> None:
    promtool = need_binary("promtool", "prometheus")
    out = subprocess.run([promtool, "test", "rules", str(DASHBOARDS / "tests" / "alerts_test.yml")],
                         capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 0 and "SUCCESS" in out.stdout + out.stderr, out.stdout + out.stderr


def test_prometheus_rule_groups_are_valid_rules(tmp_path: Path) -> None:
    promtool = need_binary("promtool", "prometheus")
    rule = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "base" / "prometheusrule.yaml").read_text())
    extracted = tmp_path / "rules.yml"
    extracted.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = subprocess.run([promtool, "check", "rules", str(extracted)], capture_output=True, text=True,
                         check=False, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
