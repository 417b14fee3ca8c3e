"""benchmarks/bench_extender.py --quick runs to the end against a real Prometheus and prints its tables.

Whether the targets are met depends on the machine, so only completion is asserted: the
benchmark built and backfilled its data, the extender answered every request, and the
latency and memory tables came out (exit status 0 = targets met, 1 = a target missed).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import need_binary

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_extender.py"


@pytest.mark.slow
def test_bench_extender_quick_completes_with_a_table() -> None:
    need_binary("prometheus", "prometheus")
    need_binary("promtool", "prometheus")
    out = subprocess.run([sys.executable, str(BENCH), "--quick"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=False)
    text = out.stdout + out.stderr
    assert out.returncode in (0, 1), text
    assert "Traceback" not in text, text
    assert re.search(r"^phase\s+verb\s+nodes\s+reqs\s+err\s+p50 ms\s+p99 ms", out.stdout, re.M), text
    for phase in (r"back to back, 1 client", r"after [\d.]+ s idle \(refreshes\)"):
        for verb in ("filter", "prioritize"):
            row = re.search(rf"^{phase}\s+{verb}\s+100\s+(\d+)\s+(\d+)\s+[\d.]+\s+[\d.]+", out.stdout, re.M)
            assert row, f"no {phase} {verb} row:\n{text}"
            assert int(row.group(1)) > 0 and int(row.group(2)) == 0, row.group(0)  # answered, none failed
    assert re.search(r"^after the run\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+<80", out.stdout, re.M), text
    assert "where the time goes" in out.stdout and "build_state on both" in out.stdout, text
    assert "requests failed" not in out.stdout, text
    assert ("all targets met" in out.stdout) == (out.returncode == 0), text
