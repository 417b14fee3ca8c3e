"""Running a benchmark's quick mode from the system tests (benchmarks/bench_*.py --quick)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench_quick(bench: str, labels: Iterable[str], gap: str,
                    timeout_s: float) -> tuple[subprocess.CompletedProcess[str], dict[str, bool]]:
    """benchmarks/`bench` --quick, run from the repository root: it must exit 0 (targets met) or
    1 (some missed), print no traceback, and have a verdict row for each of `labels` (the label
    at the start of a line, `gap` (a regex), then "yes" or "NO"). The run and label -> met."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / bench), "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout_s, check=False)
    text = out.stdout + out.stderr
    assert out.returncode in (0, 1), text
    assert "Traceback" not in text, text
    verdicts = {}
    for label in labels:
        line = re.search(rf"^{re.escape(label)}{gap}(yes|NO)\b", out.stdout, re.M)
        assert line, f"no verdict for {label!r}:\n{text}"
        verdicts[label] = line.group(1) == "yes"
    return out, verdicts
