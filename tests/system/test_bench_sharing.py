"""benchmarks/bench_sharing.py --quick runs to the end: real runc pods on the simulated 4-GPU
node, the in-process agent pipeline with the kernel probes, the managed modes (static,
adaptive, elastic) on the trace-shaped heterogeneous mix, twice each (interleaved), adaptive
and elastic admitting the smallest declared demand first (the benchmark's default).

Asserted: every job of every run finished, the table and the JSON line came out with the
issue's keys, no managed mode let a job run into OOM, and what held in five quick runs on
the 2-core VM (README "Performance"; adaptive vs static average completion 3.2 / 4.6 / 2.5 /
6.5 % lower in four runs in a row, 0.0 % in a fifth while another benchmark ran on the VM;
makespan 18-20 % shorter, memory utilisation 12-13 points higher; elastic vs adaptive time to
95 % progress 4.7 / 7.1 / 5.3 / 3.9 / 2.6 % longer): adaptive's average completion no more
than 3 % above static's, its makespan within 5 % of static's or better, its memory
utilisation higher, and elastic's time to 95 % progress within 10 % of adaptive's. Not
asserted, because they did not hold reliably (issue 21 left open on them): adaptive < static
on average completion with a margin (a 1 % margin failed in the fifth run), and elastic <=
adaptive on time to 95 % progress (never held)."""

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
    assert m["adaptive"]["avg_completion_s"] <= 1.03 * m["static"]["avg_completion_s"], m
    assert m["adaptive"]["makespan_s"] <= 1.05 * m["static"]["makespan_s"], m
    assert m["adaptive"]["mem_util"] > m["static"]["mem_util"], m
    assert m["elastic"]["t95_progress_s"] <= 1.10 * m["adaptive"]["t95_progress_s"], m
