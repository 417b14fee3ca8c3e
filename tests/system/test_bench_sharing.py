"""benchmarks/bench_sharing.py --quick runs to the end: real runc pods on the simulated node,
the in-process agent pipeline with the kernel probes, all four modes.

What the modes measure depends on the machine, so completion and the managed modes' safety
are asserted: every job of every mode finished, the table and the JSON line came out with the
issue's keys, and no managed mode (static, adaptive, elastic) let a job run into OOM."""

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
                         timeout=240, check=False)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "Traceback" not in text, text
    assert re.search(r"^mode\s+avg completion s\s+makespan s\s+mem util\s+OOM\s+t95 progress s\s+done", out.stdout,
                     re.M), text
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(summary["modes"]) == {"none", "static", "adaptive", "elastic"}, summary
    for mode, values in summary["modes"].items():
        assert set(values) == KEYS, (mode, values)
    for mix, modes in summary["mixes"].items():
        for mode, values in modes.items():
            done, total = values["completed"].split("/")
            assert done == total, (mix, mode, values)
            if mode != "none":
                assert values["oom_failures"] == 0, (mix, mode, values)
