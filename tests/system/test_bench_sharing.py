"""benchmarks/bench_sharing.py --quick runs to the end: real runc pods on the simulated 4-GPU
node, the in-process agent pipeline with the kernel probes, the managed modes (static,
adaptive, elastic) on the trace-shaped heterogeneous mix, twice each (interleaved), adaptive
and elastic admitting the smallest declared demand first (the benchmark's default).

Asserted: every job of every run finished, the table and the JSON line came out with the
issue's keys, no managed mode let a job run into OOM, and the orderings that held in eight
quick runs on the 2-core VM (README "Performance"): adaptive's makespan within 5 % of
static's or better (4-21 % shorter where the numbers were kept) and its memory utilisation
higher (12-16 points). Not asserted, because they did not hold across runs (issue 21 left
open on them): adaptive < static on average completion -- 3.2 / 4.6 / 2.5 / 6.5 % lower in
four runs in a row on a quiet VM; while another engineer's benchmark loaded it, 0.0 % and
1.2 % lower, then 5.1 % and 21.2 % higher (a 1 % margin, then a 3 % tolerance failed) -- and
elastic <= adaptive on time to 95 % progress: elastic 4.7 / 7.1 / 5.3 / 3.9 / 2.6 / 10.9 /
2.6 % slower, once (the loaded run where adaptive was 21 % behind static) 21.9 % faster."""

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
