"""benchmarks/bench_churn.py --quick: the agent's pipeline under container churn (issue 13, item 5).

20 container starts/s for 20 s on the simulated node (cgroups, bundles, native workers),
with the agent keeping at most 256 gone containers' counters so that the short run reaches
the cap. Asserted: the run completes with its tables; the counters stay within the cap plus
the live ones; the memory targets hold (RSS < 60 MiB, back within 10 MiB of idle); and the
cycle-CPU comparisons hold (end vs start of churn, after vs before churn with the same live
count and with none). Those compare medians of a few seconds of cycles on a shared machine,
so a run that misses only them is repeated once before the test fails.
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import need_root
from tests.system.bench_helpers import run_bench_quick

MEMORY_CHECKS = ("RSS < 60 MiB throughout", "RSS back within 10 MiB of idle after churn")
CPU_CHECKS = ("cycle CPU, end of churn vs start of churn", "cycle CPU, same live count, after churn vs before",
              "cycle CPU, no live containers, after churn vs before")


def run_quick() -> tuple[int, str, dict[str, bool]]:
    out, verdicts = run_bench_quick("bench_churn.py", MEMORY_CHECKS + CPU_CHECKS, r"\s+", timeout_s=180)
    assert (out.returncode == 0) == all(verdicts.values()), out.stdout + out.stderr
    return out.returncode, out.stdout, verdicts


@pytest.mark.slow
def test_bench_churn_quick_meets_its_targets() -> None:
    need_root()
    _, stdout, verdicts = run_quick()
    rate = re.search(r"^churn: (\d+) containers started in (\d+) s = ([\d.]+) starts/s", stdout, re.M)
    assert rate and float(rate.group(3)) >= 15.0, stdout  # the driver reached (most of) 20/s
    assert re.search(r"^\s+\d+ churn\s+[\d.]+\s+\d+\s+\d+", stdout, re.M), stdout  # the per-window table
    retained = [int(m.group(2)) for m in re.finditer(r"^\s+\d+ (churn|quiet|after)\s+[\d.]*\s+(?:\d+)\s+(\d+)",
                                                     stdout, re.M)]
    live = re.search(r"^churn, end\s+(\d+)", stdout, re.M)
    assert retained and live, stdout
    assert max(retained) <= 256 + 2 * int(live.group(1)), stdout  # the cap, plus the live and the newest
    assert max(retained) >= 256, stdout  # ... and the run did reach it
    for label in MEMORY_CHECKS:
        assert verdicts[label], f"{label}:\n{stdout}"
    if not all(verdicts[label] for label in CPU_CHECKS):
        _, stdout, verdicts = run_quick()  # timing on a shared machine: once more
        assert all(verdicts[label] for label in CPU_CHECKS), stdout
