"""dcgm-exporter compatibility rules (issue 19 item 2): NVIDIA's dashboard queries get data.

tests/fixtures/dcgm/dashboard_queries.txt holds the queries of NVIDIA's dcgm-exporter Grafana
dashboard (only the queries). Each served one, with Grafana's "All" substituted for its
variables, must be a promql_expr_test of dashboards/tests/dcgm_compat_test.yml with at least one
expected sample, and that file must pass `promtool test rules` (the real binary) -- so every
served query returns exactly the data written there from gpuwatch-shaped input series. A query
the rules cannot serve must say why in the fixture and be named in README's DCGM section.
Also: the PrometheusRule component is the rules file, and every DCGM_FI_* name recorded is in
the README.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tests.conftest import need_binary

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
RULES = DASHBOARDS / "gpuwatch-dcgm-compat.yml"
PROMTOOL_TEST = DASHBOARDS / "tests" / "dcgm_compat_test.yml"
QUERIES = ROOT / "tests" / "fixtures" / "dcgm" / "dashboard_queries.txt"
COMPONENT = ROOT / "deploy" / "kubernetes" / "components" / "dcgm-compat" / "prometheusrule-dcgm-compat.yaml"
ALL = {"$instance": "n1:9400", "$gpu": "(0|1)"}  # Grafana's "All" over the test's one node, two GPUs


def dashboard_queries() -> list[tuple[str, str, str | None]]:
    """(panel, query, why unserved or None) per fixture line."""
    rows = []
    for line in QUERIES.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        panel, query, *rest = (part.strip() for part in line.split(" | "))
        why = rest[0].removeprefix("unserved:").strip() if rest else None
        rows.append((panel, query, why))
    return rows


def as_evaluated(query: str) -> str:
    """The query as Grafana sends it with "All" selected; label_values() as the PromQL it stands for."""
    for var, value in ALL.items():
        query = query.replace(var, value)
    match = re.fullmatch(r"label_values\((\w+), (\w+)\)", query)
    return f"group by ({match[2]}) ({match[1]})" if match else query


def test_every_served_dashboard_query_returns_data_in_the_promtool_test() -> None:
    tests = yaml.safe_load(PROMTOOL_TEST.read_text())["tests"]
    evaluated = {t["expr"]: t["exp_samples"] for case in tests for t in case.get("promql_expr_test", [])}
    rows = dashboard_queries()
    assert len(rows) == 10  # 8 panel targets and 2 variables of the published dashboard
    served = [(panel, query) for panel, query, why in rows if why is None]
    for panel, query in served:
        samples = evaluated.get(as_evaluated(query))
        assert samples, f"{panel}: {as_evaluated(query)!r} is not evaluated (with samples) in {PROMTOOL_TEST.name}"
    readme = (ROOT / "README.md").read_text()
    for panel, query, why in rows:
        if why is not None:
            assert len(why) > 20, f"{panel}: say why it cannot be served"
            metric = re.match(r"\w+", query)
            assert metric and metric[0] in readme, f"README does not name the unserved {metric}"
    assert len(served) == 9


def test_promtool_runs_the_dcgm_compat_tests() -> None:
    promtool = need_binary("promtool", "prometheus")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    out = subprocess.run([promtool, "test", "rules", str(PROMTOOL_TEST)], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0 and "SUCCESS" in out.stdout + out.stderr, out.stdout + out.stderr


def test_component_is_the_rules_file_and_readme_lists_every_dcgm_name() -> None:
    rule = yaml.safe_load(COMPONENT.read_text())
    assert rule["kind"] == "PrometheusRule" and rule["metadata"]["name"] == "gpuwatch-dcgm-compat"
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert rule["spec"]["groups"] == groups
    recorded = {r["record"] for g in groups for r in g["rules"] if r["record"].startswith("DCGM_FI_")}
    assert len(recorded) >= 20
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## DCGM compatibility"):]
    missing = sorted(name for name in recorded if f"`{name}`" not in section)
    assert not missing, f"README's DCGM section does not document {missing}"
