"""benchmarks/bench_pipeline.py --quick: the agent's sample cycle on the simulated node (CI size).

2 GPUs x 20 containers x 2 native GPU processes, the agent's pipeline in its own process.
Asserted: the run completes with every row of its table, each target row has a verdict and
the exit status agrees with them, every process is attributed to its container, and the
identity resolver stays under its 1 ms target for unchanged processes, and with the NVML
cost model (the H100's call costs, issue 17) the NVML calls stay under 0.5 % of a core.

That last target has its margin built in rather than added: the cost model burns *thread CPU
time*, which host load barely changes (unlike wall time), and the agent's cadence measures
the process-utilisation call's CPU and spaces the reads so they use 0.3 % of a core whatever
they cost (at most: reads fall on whole cycles, every 2nd at 2 GPUs and 1 s); the process lists
and scalar calls add ~0.04 % at 2 GPUs. So the quick run sits at 0.2-0.3 % (0.18-0.27 %
measured here, on a loaded VM), 40 % or more under the target, and a busy machine moves it by
hundredths. The full-size run (8 x 200 x 4) is the README's; it takes minutes. Medians of a
few cycles on a shared machine: a run that misses a CPU target is repeated once before the
test fails.
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import need_root
from tests.system.bench_helpers import run_bench_quick

TARGET_ROWS = ("sample cycle minus driver (ms)", "  of which identity resolver (ms)",
               "scrape, build exposition CPU (ms)", "agent RSS (MiB)", "  NVML calls (cost model's share)")
NVML_COST_TARGET_PCT = 0.5


def run_quick() -> tuple[int, str, dict[str, bool]]:
    out, verdicts = run_bench_quick("bench_pipeline.py", TARGET_ROWS, r"\s.*\s", timeout_s=240)
    return out.returncode, out.stdout, verdicts


@pytest.mark.slow
def test_bench_pipeline_quick_meets_its_targets() -> None:
    need_root()
    rc, stdout, verdicts = run_quick()
    if rc != 0:  # noisy neighbours: one more run before calling it a regression
        rc, stdout, verdicts = run_quick()
    assert re.search(r"^40/40 GPU processes ready", stdout, re.M), stdout
    snapshot = re.search(r"^snapshot: 2 GPUs, 20 containers, .* 40 processes \(0 unattributed\)", stdout, re.M)
    assert snapshot, stdout
    assert verdicts["  of which identity resolver (ms)"], stdout
    cost = re.search(r"^  NVML calls \(cost model's share\)\s+([\d.]+)\s+([\d.]+)", stdout, re.M)
    before = re.search(r"^  before cadence: samples each sweep\s+([\d.]+)\s+([\d.]+)", stdout, re.M)
    assert cost and before, stdout
    assert float(cost.group(2)) < NVML_COST_TARGET_PCT, stdout
    assert float(cost.group(1)) < float(before.group(1)), f"the cadence saved nothing:\n{stdout}"
    assert rc == 0 and all(verdicts.values()), stdout
