"""benchmarks/bench_sharing.py --quick runs to the end: real runc pods on the simulated 4-GPU
node, the in-process agent pipeline with the kernel probes, the managed modes (static,
adaptive, elastic) on the trace-shaped heterogeneous mix, twice each (interleaved).

Asserted: every job of every run finished, the table and the JSON line came out with the
issue's keys, no managed mode let a job run into OOM, and the orderings that held with a
margin over repeated runs on the 2-core VM (README "Performance") on this mix: adaptive's
makespan within 5 % of static's or better (measured 18-19 % better) and its memory
utilisation higher. Not asserted, because they did not hold across runs (issue 21 left open
on them): adaptive < static on average completion (+1 % quick, +8 % full) and elastic <=
adaptive on time to 95 % progress (+9 % quick, -15 % full)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import need_bcc, need_binary

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_sharing.py"
KEYS = {"avg_completion_s", "makespan_s", "mem_util", "oom_failures", "t95_progress_s"}


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.runc
@pytest.mark.bpf
def test_bench_sharing_quick_completes_with_a_table_and_the_json_line() -> None:
    need_bcc()
    need_binary("runc", "runc")
    out = subprocess.run([sys.executable, str(BENCH), "--quick"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=False)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "Traceback" not in text, text
    assert re.search(r"^mode\s+avg completion s\s+makespan s\s+mem util\s+OOM\s+t95 progress s\s+done", out.stdout,
                     re.M), text
    print(out.stdout[-1500:])
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(summary["modes"]) == {"static", "adaptive", "elastic"}, summary
    for mode, values in summary["modes"].items():
        assert set(values) == KEYS, (mode, values)
    for mix, modes in summary["mixes"].items():
        for mode, values in modes.items():
            done, total = values["completed"].split("/")
            assert done == total, (mix, mode, values)
            if mode != "none":
                assert values["oom_failures"] == 0, (mix, mode, values)
    m = summary["modes"]
    assert m["adaptive"]["makespan_s"] <= 1.05 * m["static"]["makespan_s"], m
    assert m["adaptive"]["mem_util"] > m["static"]["mem_util"], m
