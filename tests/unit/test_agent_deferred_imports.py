"""The agent's memory diet: what its process imports, checked in fresh interpreters.

`defer_package_init` must leave prometheus_client's heavy `__init__` (HTTP servers, push
gateway, ssl) unrun while the agent only uses submodules, and still give the whole package
to code that asks for it. The agent's own imports must not pull pyroute2 (and its asyncio, sqlite3), yaml or bcc
before something needs them.
"""

from __future__ import annotations

import json
import subprocess
import sys


def _run(code: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_submodules_import_without_the_package_init_and_the_package_still_works() -> None:
    result = _run("""
import json, sys
from gpuwatch.agent.daemon import defer_package_init
assert defer_package_init("prometheus_client")
assert not defer_package_init("prometheus_client")  # already there: nothing to do
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry
from prometheus_client import values  # a submodule by `from package import`
lean = {m: m in sys.modules for m in ("prometheus_client.exposition", "http.server", "ssl")}
from prometheus_client import Counter, generate_latest  # a name of the package's __init__
registry = CollectorRegistry()
Counter("jobs", "Jobs.", registry=registry).inc()
print(json.dumps({"lean": lean, "text": generate_latest(registry).decode(),
                  "module": type(sys.modules["prometheus_client"]).__name__}))
""")
    assert result["lean"] == {"prometheus_client.exposition": False, "http.server": False, "ssl": False}
    assert "jobs_total 1.0" in str(result["text"])
    assert result["module"] == "module"  # an ordinary module once loaded


def test_a_missing_package_is_left_alone() -> None:
    result = _run("""
import json
from gpuwatch.agent.daemon import defer_package_init
print(json.dumps({"deferred": defer_package_init("no_such_package_gpuwatch")}))
""")
    assert result["deferred"] is False


def test_the_agent_modules_import_no_optional_heavyweights() -> None:
    result = _run("""
import json, sys
from gpuwatch.agent.daemon import DEFERRED_PACKAGES, defer_package_init
for package in DEFERRED_PACKAGES:
    defer_package_init(package)
import gpuwatch.cli.agent, gpuwatch.agent.daemon, gpuwatch.pipeline.sampler, gpuwatch.exporter.metrics_server
import gpuwatch.exporter.collector, gpuwatch.signals.signal_collector, gpuwatch.signals.network
import gpuwatch.signals.progress, gpuwatch.signals.kmsg
heavy = ("pyroute2", "yaml", "bcc", "prometheus_client.exposition", "asyncio", "sqlite3")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy or m in heavy)))
""")
    assert result == []
